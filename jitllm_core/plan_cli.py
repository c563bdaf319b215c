"""`jitllm plan`: candidate layouts, their predicted cost, and the one placement="auto" would choose."""
from __future__ import annotations

import argparse
import json
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


def run_plan(args: argparse.Namespace) -> int:
    if args.what_if is None:
        print("jitllm plan: planning for this machine's devices is not available yet; "
              "use --what-if HW_FILE", file=sys.stderr)
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


def plan_rows(hw: Hardware, shape: ModelShape, accel: str | None = None,
              extra_device_layers=()) -> tuple[list[Prediction], Prediction]:
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
