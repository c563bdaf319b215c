"""`jitllm plan`: candidate layouts, their predicted cost, and the one placement="auto" would choose."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .costmodel import (GB, Hardware, ModelShape, Prediction, RESTS, candidates, choose, load_hardware_toml,
                        n_device_layers, predict, sweep, unified)
from .errors import JitllmError


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--what-if", metavar="HW_FILE",
                        help="predict for the hardware and model described in this TOML file; runs nothing")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--n-device-layers", metavar="N", type=int, action="append", default=[],
                        help="also show the layouts with N units on the device (repeatable)")
    parser.add_argument("--device", metavar="NAME", help="the accelerator to plan for (default: all)")
    parser.add_argument("--sweep", action="store_true",
                        help="tokens/s for every number of device layers, for each placement of the rest")
    parser.add_argument("--compare-unified", metavar="GBS", type=float,
                        help="with the sweep (implied): where host-compute falls below a unified-memory "
                             "machine of GBS GB/s holding the whole model")
    parser.add_argument("-m", "--model", help="model to plan for this machine's devices (default: the default model)")
    parser.add_argument("--mem", action="append", default=[], metavar="DEV=SIZE",
                        help="cap a device's memory, e.g. vulkan:0=60MB (repeatable)")
    parser.add_argument("--context", type=int, metavar="N", help="KV cache positions to plan for (default 4096)")
    parser.add_argument("--measure", type=int, metavar="N",
                        help="also run N tokens with each layout and print what the engine counted")


def run_plan(args: argparse.Namespace) -> int:
    if args.what_if is None:
        try:
            return run_plan_here(args)
        except JitllmError as e:
            print(f"jitllm: error: {e}", file=sys.stderr)
            return 2
    try:
        hw, shape = load_hardware_toml(args.what_if)
        if shape is None:
            raise JitllmError(f"{args.what_if}: no [model] section; --what-if needs one")
        if args.sweep or args.compare_unified is not None:
            run_sweep(hw, shape, args.device, args.compare_unified, args.json)
            return 0
        rows, chosen = plan_rows(hw, shape, args.device, args.n_device_layers)
    except JitllmError as e:
        print(f"jitllm: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([p.to_dict() | {"chosen": p is chosen} for p in rows]))
    else:
        plan_table(rows, chosen)
    return 0


def parse_mem(items) -> dict:
    """['vulkan:0=60MB', ...] -> {'vulkan:0': '60MB'}"""
    out = {}
    for item in items:
        dev, eq, size = item.partition("=")
        if not eq or not dev or not size:
            raise JitllmError(f"--mem {item!r}: expected DEVICE=SIZE, e.g. vulkan:0=60MB")
        out[dev] = size
    return out


def run_plan_here(args) -> int:
    """Plan for the devices of this machine (measured bandwidths) and a real model file."""
    from . import planner, registry
    from .engine import PAGE, STEP_TOKENS, Engine
    from .llama import Llama
    from .modelfile import ModelFile
    from .memory import Arena
    from .models import default_model_path

    path = args.model or default_model_path()
    devs = dict(registry.all_devices())
    if args.device:
        accel = registry.device(args.device)
        devs = {n: d for n, d in devs.items() if d.backend == "cpu"}
        devs[accel.name] = accel
    host = next((n for n, d in devs.items() if d.backend == "cpu"), None)
    if host is None:
        raise JitllmError("planning needs the CPU backend (the host) among the devices")
    mem = parse_mem(args.mem)
    arenas = {n: Arena(d, mem.get(n)) for n, d in devs.items()}
    context = args.context or 4096
    pages = -(-context // PAGE)
    model = Llama(ModelFile(path), STEP_TOKENS, PAGE, pages, "f16")
    hw = planner.hardware(devs, arenas, host, reserve=lambda caps: model.activation_bytes(caps.tile_dots))
    shape = planner.shape(model)
    rows, chosen = plan_rows(hw, shape, None, args.n_device_layers, planner.candidates)
    if args.json:
        print(json.dumps([p.to_dict() | {"chosen": p is chosen} for p in rows]))
    else:
        print(f"{os.path.basename(path)}, {context} positions of f16 KV cache; host {host}")
        plan_table(rows, chosen)
    if args.measure:
        measure(path, rows, devs, mem, context, args.measure, Engine, planner)
    return 0


def measure(path, rows, devs, mem, context, n, Engine, planner):
    """Run each fitting layout for n tokens; print measured tok/s and the engine's counters per token."""
    print(f"\nmeasured over {n} decode tokens (counters per token):")
    header = ["layout", "pred tok/s", "tok/s", "GB read per device", "crossings", "pred crossings"]
    table = []
    for p in rows:
        if not p.fits:
            continue
        placement = planner.to_placement(p.layout, None)
        eng = Engine(path, devices=list(devs), placement=placement, mem=mem, max_context=context, speculate=0)
        try:
            eng.generate("Hello", max_tokens=2, ignore_eos=True)
            eng.reset_stats()
            r = eng.generate("Tell me a story about a lighthouse.", max_tokens=n, ignore_eos=True)
            steps = max(1, eng.stats["steps"])
            tps = r.timings["decode_tokens"] / r.timings["decode_s"] if r.timings["decode_s"] else 0.0
            reads = ", ".join(f"{d} {b / steps / GB:.3f}" for d, b in eng.stats["bytes_read"].items())
            table.append([p.layout.label(), f"{p.tokens_per_s:.1f}", f"{tps:.1f}", reads,
                          f"{eng.stats['crossings'] / steps:.0f}", str(p.crossings)])
        finally:
            eng.close()
    widths = [max(len(r[i]) for r in [header] + table) for i in range(len(header))]
    for r in [header] + table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def plan_rows(hw: Hardware, shape: ModelShape, accel: str | None = None,
              extra_device_layers=(), candidates=candidates) -> tuple[list[Prediction], Prediction]:
    """The table's rows, best first: the best fitting layout of each family (auto's choice among them), and
    the layouts with each of extra_device_layers units on the device, fitting or not."""
    predictions = [predict(layout, hw, shape) for layout in candidates(hw, shape, accel)]
    chosen = choose(predictions)
    best: dict = {}
    for p in predictions:
        family = p.layout.family()
        if p.fits and (family not in best or p.tokens_per_s > best[family].tokens_per_s):
            best[family] = p
    rows = {p.layout: p for p in best.values()}
    for n, rest in ((n, rest) for n in extra_device_layers for rest in RESTS):
        layout = n_device_layers(n, hw, shape, accel, rest)
        rows.setdefault(layout, predict(layout, hw, shape))
    return sorted(rows.values(), key=lambda p: -p.tokens_per_s), chosen


def plan_table(predictions: list[Prediction], chosen: Prediction | None, file=None) -> None:
    """Print predictions as a table; mark chosen with '*' and layouts over capacity with '!'."""
    file = file or sys.stdout
    devices = list(predictions[0].memory_bytes)
    header = (["", "layout"] + [f"{d} GB/{predictions[0].capacity_bytes[d] / GB:g}" for d in devices]
              + ["host read GB/tok", "crossings/tok", "tok/s"])
    body = [["*" if p is chosen else "" if p.fits else "!", p.layout.label()]
            + [f"{p.memory_bytes[d] / GB:.2f}" for d in devices]
            + [f"{p.host_read_bytes / GB:.2f}", str(p.crossings), f"{p.tokens_per_s:.1f}"] for p in predictions]
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    for r in [header] + body:
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip(),
              file=file)
    print("* = placement=\"auto\" chooses this; ! = does not fit in memory", file=file)


def run_sweep(hw: Hardware, shape: ModelShape, accel: str | None, unified_gbs: float | None,
              as_json: bool) -> None:
    accel = accel or (hw.accelerators[0].name if hw.accelerators else None)
    if accel is None:
        raise JitllmError("--sweep needs an accelerator in the hardware file")
    table = sweep(hw, shape, accel)
    reference = unified(unified_gbs * GB, shape) if unified_gbs is not None else None
    below = None
    if reference is not None:
        below = next((k for k in range(shape.n_units, -1, -1)
                      if table["host-compute"][k].tokens_per_s < reference.tokens_per_s), None)
    if as_json:
        print(json.dumps({"device": accel,
                          "layouts": [p.to_dict() | {"rest": rest} for rest in RESTS for p in table[rest]],
                          "unified": None if reference is None else {
                              "bandwidth_gbs": unified_gbs, "tokens_per_s": reference.tokens_per_s,
                              "host_compute_below_at": below}}))
        return
    header = [f"{accel} layers"] + [f"{rest} tok/s" for rest in RESTS]
    body = [[str(k)] + [f"{table[rest][k].tokens_per_s:.1f}" + (" " if table[rest][k].fits else "!")
                        for rest in RESTS] for k in range(shape.n_units, -1, -1)]
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    for r in [header] + body:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)).rstrip())
    print(f"rest of the {shape.n_units} units: host-compute or streamed for {accel}, or resident on "
          f"{hw.host.name} (host); ! = does not fit in memory")
    if reference is not None:
        where = ("never, for any number of layers" if below is None else
                 f"at {below} {accel} layers or fewer" if below < shape.n_units else "at every number of layers")
        print(f"unified memory at {unified_gbs:g} GB/s: {reference.tokens_per_s:.1f} tok/s; "
              f"host-compute falls below it {where}")
