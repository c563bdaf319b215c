"""The `jitllm` command: run, chat, devices, bench, compile, plan.

Every JitllmError ends the command with `jitllm: error: <message>` on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from collections import deque
from pathlib import Path

from .errors import JitllmError, check_whole
from .lookup import SPECULATE
from .plan_cli import add_plan_arguments, parse_mem, run_plan

INSTALL_HINT = ("Install the CPU backend:  pip install jitllm-cpu-llvm\n"
                "  (from a checkout of the repository:  pip install ./plugins/cpu_llvm)")
CHAT_HELP = ("Type a message and press Enter. Commands (/move, /placement and /stats also work while a reply "
             "streams):\n"
             "  /move UNITS DEVICE    migrate layers, e.g. /move 0-29 vulkan:0 or /move embed,0-3 cpu:1\n"
             "  /placement            which device each unit is on\n"
             "  /stats                the engine's counters\n"
             "  /reset                forget the conversation\n"
             "  /quit                 leave (also Ctrl-D); Ctrl-C stops a reply")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except JitllmError as e:
        print(f"jitllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`jitllm run ... | head`): stop quietly, as a shell command does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail again
        return 141


def build_parser() -> argparse.ArgumentParser:
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument("-m", "--model", help="GGUF file or HF safetensors folder (default: SmolLM2-135M-Instruct)")
    engine.add_argument("--device", action="append", metavar="D",
                        help="device to use, e.g. cpu, cpu:1, vulkan:0 (repeatable; default: all available)")
    engine.add_argument("--kv-dtype", choices=("f16", "f32"), default="f16", help="KV cache dtype (default f16)")
    engine.add_argument("--activations", choices=("f32", "int8"), default="f32",
                        help="matmul inputs on the CPU: f32 (exact, default) or int8 (as llama.cpp: faster, logits "
                             "~1 off)")
    engine.add_argument("--mem", action="append", default=[], metavar="DEV=SIZE",
                        help="cap a device's memory, e.g. vulkan:0=60MB (repeatable); the planner fits under it")
    engine.add_argument("--n-device-layers", type=int, metavar="N",
                        help="llama.cpp's knob: N units on the best accelerator, the rest computed on the host")
    engine.add_argument("--max-context", type=int, metavar="N", help="KV cache positions (default: the model's, at most 8192)")
    engine.add_argument("--speculate", type=int, default=SPECULATE, metavar="N",
                        help="draft tokens from the context a decode step checks at once (prompt lookup; 0: off; "
                             f"default {SPECULATE}); the reply is the same either way")
    threads = argparse.ArgumentParser(add_help=False)
    threads.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: all cores)")
    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--max-tokens", type=int, default=256, metavar="N")
    sampling.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    sampling.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off")
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="P")
    sampling.add_argument("--seed", type=int)

    parser = argparse.ArgumentParser(prog="jitllm", description="LLM inference with kernels JIT-compiled for "
                                     "the devices it finds, and layers that move between them.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", parents=[engine, threads, sampling], help="generate a reply to one prompt")
    p.add_argument("text", nargs="?", metavar="PROMPT", help="the prompt (or -p PROMPT; default: read from stdin)")
    p.add_argument("-p", "--prompt", help="the prompt")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=True,
                      help="wrap the prompt in the model's chat template (default)")
    mode.add_argument("--raw", dest="chat", action="store_false", help="feed the prompt as it is")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", parents=[engine, threads, sampling], help="interactive multi-turn chat",
                       description=CHAT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", parents=[engine, threads], help="an OpenAI-compatible HTTP server: "
                       "/v1/chat/completions, /v1/completions, /v1/models")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free one)")
    p.add_argument("--max-sequences", type=int, default=4, metavar="N",
                   help="requests decoded in one batched step, and whose sliding windows the KV cache holds at once "
                        "(default 4); a step's rows they leave take drafts")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("devices", help="backends and devices found, with the reason for any that is missing")
    p.set_defaults(func=cmd_devices)

    p = sub.add_parser("bench", parents=[engine], help="prompt and decode tokens/s, beside llama.cpp if installed; "
                       "`bench batch`: several generations at once; `bench speculate`: replies that quote their "
                       "prompt, drafts checked or not; `bench migrate`: pause time of live migration")
    p.add_argument("what", nargs="?", choices=("speed", "batch", "speculate", "migrate"), default="speed",
                   help="speed (default): prompt and decode tokens/s (not speculating); batch: decode tokens/s of "
                        "--sequences generations at once; speculate: decode tokens/s of replies with drafts of up "
                        "to --speculate tokens and without; migrate: move all layers between devices")
    p.add_argument("--sequences", type=int, nargs="+", default=[1, 2, 4], metavar="N",
                   help="bench batch: generations at once (default 1 2 4)")
    p.add_argument("--profile", action="store_true",
                   help="also print time, bytes and GB/s per kernel of one decode and one prefill step")
    p.add_argument("--history", type=int, nargs="+", default=[256, 1800, 7000], metavar="N",
                   help="bench migrate: tokens of history before the move (default 256 1800 7000)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], metavar="N", help="thread counts (default 1 2)")
    p.add_argument("--prompt-tokens", type=int, default=37, metavar="N")
    p.add_argument("--decode-tokens", type=int, default=64, metavar="N")
    p.add_argument("--repeats", type=int, default=5, metavar="N", help="measured runs per engine (after a warm-up)")
    p.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false", help="skip llama.cpp")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("compile", help="compile a model's kernels ahead of time for a backend and architecture")
    p.add_argument("-m", "--model", help="GGUF file or HF safetensors folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--backend", default="cuda", help="backend name (default cuda)")
    p.add_argument("--arch", required=True, help="target architecture, e.g. sm_90")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("plan", help="candidate placements with their predicted cost")
    add_plan_arguments(p)
    p.set_defaults(func=run_plan)
    return parser


# ------------------------------------------------------------------------------------------------ engine

class ProgressBar:
    """`stage [#####.....] done/total` on a terminal, redrawn in place while the engine loads and compiles."""

    def __init__(self, file):
        self.file, self.drawn = file, False

    def __call__(self, stage, done, total):
        width = 30
        filled = width * done // total if total else width
        self.file.write(f"\r{stage[:28]:<28} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}\x1b[K")
        self.file.flush()
        self.drawn = True

    def clear(self):
        if self.drawn:
            self.file.write("\r\x1b[K")
            self.file.flush()


def open_engine(args, max_sequences=1):
    """The engine the options ask for; run and chat generate one sequence at a time, so a sliding-window layer's
    KV pool holds one window (`jitllm serve` takes --max-sequences)."""
    from .engine import Engine

    bar = ProgressBar(sys.stderr) if sys.stderr.isatty() else None
    try:
        return Engine(model=args.model, devices=args.device, threads=args.threads, kv_dtype=args.kv_dtype,
                      progress=bar, mem=parse_mem(args.mem), n_device_layers=args.n_device_layers,
                      max_context=args.max_context, activations=args.activations,
                      max_sequences=max_sequences, speculate=args.speculate)
    finally:
        if bar:
            bar.clear()


def sampling_options(args) -> dict:
    """The sampling options, checked before a model is loaded."""
    from .sampler import check_options

    options = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   seed=args.seed)
    check_options(**options)
    return options


def stream_to(out, events, on_token=None) -> tuple[str, bool]:
    """Write a streamed reply as it arrives; Ctrl-C stops it cleanly. Returns (text, interrupted)."""
    parts = []
    try:
        for ev in events:
            out.write(ev.text)
            out.flush()
            parts.append(ev.text)
            if on_token:
                on_token()
        interrupted = False
    except KeyboardInterrupt:
        events.close()
        interrupted = True
    out.write("\n")
    out.flush()
    return "".join(parts), interrupted


# ------------------------------------------------------------------------------------------------ run

def cmd_run(args) -> int:
    if args.prompt is not None and args.text is not None:
        raise JitllmError("two prompts: give it with -p PROMPT or as the last argument, not both")
    prompt = args.prompt if args.prompt is not None else args.text
    if prompt is None:
        if sys.stdin.isatty():
            raise JitllmError("no prompt: give one as the last argument, with -p PROMPT or on stdin")
        prompt = sys.stdin.read()
    options = sampling_options(args)
    eng = open_engine(args)
    try:
        if args.chat:
            events = eng.chat([{"role": "user", "content": prompt}], stream=True, **options)
        else:
            events = eng.generate(prompt, stream=True, **options)
        _, interrupted = stream_to(sys.stdout, events)
        if interrupted:
            print("[stopped]", file=sys.stderr)
            return 130
        print(summary(eng.last), file=sys.stderr)
        return 0
    finally:
        eng.close()


def summary(result) -> str:
    t = result.timings
    prompt = t["prompt_tokens"] / t["prefill_s"] if t["prefill_s"] else 0.0
    decode = t["decode_tokens"] / t["decode_s"] if t["decode_s"] else 0.0
    return (f"[{t['prompt_tokens']} prompt tokens at {prompt:.1f} tok/s, {len(result.token_ids)} generated at "
            f"{decode:.1f} tok/s; finish: {result.finish_reason}]")


# ------------------------------------------------------------------------------------------------ chat

def cmd_chat(args) -> int:
    options = sampling_options(args)
    eng = open_engine(args)
    try:
        return ChatSession(eng, options).loop()
    finally:
        eng.close()


class ChatSession:
    """Input is read on its own thread, so that /move, /placement and /stats run even while a reply streams;
    anything else typed meanwhile waits until the reply ends."""
    LIVE = ("/move", "/placement", "/stats")

    def __init__(self, eng, sampling):
        self.eng, self.sampling = eng, sampling
        self.messages = []
        self.lines = queue.Queue()
        self.deferred = deque()
        self.migrations = []  # threads waiting for a migration's report
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in sys.stdin:
            self.lines.put(line.strip())
        self.lines.put(None)  # end of input

    def loop(self) -> int:
        print(CHAT_HELP, file=sys.stderr)
        try:
            while True:
                if not self.deferred and sys.stdin.isatty():
                    print("> ", end="", flush=True)
                line = self.deferred.popleft() if self.deferred else self.lines.get()
                if line is None or line == "/quit":
                    return 0
                if line.startswith("/"):
                    self.command(line)
                elif line:
                    self.reply(line)
        finally:
            for t in self.migrations:
                t.join()

    def reply(self, text):
        self.messages.append({"role": "user", "content": text})
        events = self.eng.chat(list(self.messages), stream=True, **self.sampling)
        answer, interrupted = stream_to(sys.stdout, events, on_token=self._live_commands)
        if interrupted:
            print("[stopped]", file=sys.stderr)
        self.messages.append({"role": "assistant", "content": answer})

    def _live_commands(self):
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return
            if line and line.split()[0] in self.LIVE:
                print(file=sys.stderr)  # the reply is mid-line
                self.command(line)
            else:
                self.deferred.append(line)

    def command(self, line):
        name, *rest = line.split()
        try:
            if name == "/move" and len(rest) == 2:
                self.move(*rest)
            elif name == "/placement":
                self.show_placement()
            elif name == "/stats":
                print(json.dumps(self.eng.stats, indent=2, default=str), file=sys.stderr)
            elif name == "/reset":
                self.messages.clear()
                print("[conversation cleared]", file=sys.stderr)
            else:
                print(CHAT_HELP, file=sys.stderr)
        except JitllmError as e:
            print(f"jitllm: error: {e}", file=sys.stderr)

    def move(self, units, device):
        """Start migrating units ('0-29', '0-3,8', 'embed,0-4') to device; the report prints when it is done."""
        handle = self.eng.migrate(units, device, wait=False)
        print(f"[moving {units} to {device} ...]", file=sys.stderr)

        def report():
            try:
                print(f"\n[{handle.result()}]", file=sys.stderr)
            except JitllmError as e:
                print(f"\njitllm: error: {e}", file=sys.stderr)

        t = threading.Thread(target=report, daemon=True)
        t.start()
        self.migrations.append(t)

    def show_placement(self):
        """One line per run of consecutive units on the same device and residency."""
        runs = []
        for unit, where in self.eng.placement.items():
            if runs and runs[-1][2] == where:
                runs[-1][1] = unit
            else:
                runs.append([unit, unit, where])
        for first, last, (device, residency) in runs:
            units = str(first) if first == last else f"{first}..{last}"
            print(f"  {units:<24} {device:<12} {residency}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------ devices

def print_table(header, rows, file=None, right=()):
    """Columns padded to their widest cell; columns whose index is in `right` are right-aligned."""
    cells = [list(map(str, r)) for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip(),
              file=file or sys.stdout)


def cmd_serve(args) -> int:
    from .server import make_server
    check_whole("port", args.port, 0)
    eng = open_engine(args, max_sequences=args.max_sequences)
    try:
        server = make_server(eng, args.host, args.port)
    except OSError as e:
        eng.close()
        raise JitllmError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from e
    host, port = server.server_address[:2]
    print(f"serving {Path(eng.model_path).name} on http://{host}:{port}/v1 (chat/completions, completions, models); "
          "Ctrl-C stops", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("[stopped]", file=sys.stderr)
    finally:
        server.server_close()
        eng.close()
    return 0


def cmd_devices(args) -> int:
    from .registry import backend_status

    status = backend_status()
    rows = []
    for st in status:
        for d in st["devices"]:
            rows.append([st["name"], st["status"], d.name, f"{d.caps.memory_bytes / 2**30:.1f} GiB",
                         d.describe().removeprefix(d.name).lstrip(": ")])
        if not st["devices"]:
            rows.append([st["name"], st["status"], "-", "-", st["reason"] or "no devices"])
    if rows:
        print_table(["backend", "status", "device", "memory", "detail"], rows)
    if not any(st["status"] == "ok" and st["devices"] for st in status):
        only = os.environ.get("JITLLM_PLUGINS")
        if status:
            print("No backend found a usable device (reasons above).")
        elif only:
            print(f"No backend plugin loaded: JITLLM_PLUGINS={only} names none that is installed.")
        else:
            print("No backend plugin is installed, so jitllm has no device to run on.")
        print(INSTALL_HINT)
    return 0


# ------------------------------------------------------------------------------------------------ bench

def cmd_bench(args) -> int:
    if args.what == "migrate":
        from .bench_migrate import run
        run(model=args.model, histories=args.history)
        return 0
    if args.what == "speculate":
        from .bench_speculate import run
        run(model=args.model, devices=args.device, kv_dtype=args.kv_dtype, threads=args.threads,
            speculate=args.speculate, decode_tokens=args.decode_tokens, repeats=args.repeats,
            llama_cpp=args.llama_cpp, activations=args.activations)
        return 0
    if args.what == "batch":
        from .bench_batch import run
        run(model=args.model, devices=args.device, kv_dtype=args.kv_dtype, threads=args.threads,
            sequences=args.sequences, prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
            repeats=args.repeats, llama_cpp=args.llama_cpp, activations=args.activations)
        return 0
    from .bench import run_bench

    run_bench(model=args.model, devices=args.device, kv_dtype=args.kv_dtype, threads=args.threads,
              prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens, repeats=args.repeats,
              llama_cpp=args.llama_cpp, activations=args.activations)
    if args.profile:
        from .engine import Engine
        from .planner import multiply_add_peak
        from .profile import print_profile, profile_decode
        for threads in args.threads:
            eng = Engine(model=args.model, devices=args.device, threads=threads, kv_dtype=args.kv_dtype,
                         activations=args.activations)
            on = {seg.device for seg in eng.segments}  # a peak to weigh the prefill's matmuls against: one device's
            peak = multiply_add_peak(eng.devices[on.pop()]) if len(on) == 1 else None
            for tokens, what in ((1, "decode step"), (eng.model.T, f"prefill step of {eng.model.T} tokens")):
                print(f"\nprofile: {what}, {threads} thread(s)")
                print_profile(*profile_decode(eng, step_tokens=tokens), peak=peak if tokens > 1 else None)
            eng.close()
    return 0


# ------------------------------------------------------------------------------------------------ compile

def cmd_compile(args) -> int:
    from .registry import backend_status

    found = [st for st in backend_status() if st["name"] == args.backend]
    backend = found[0]["backend"] if found else None
    if not hasattr(backend, "compile_ahead"):
        why = f" ({found[0]['reason']})" if found and found[0]["reason"] else ""
        raise JitllmError(f"backend {args.backend!r} is not installed or cannot compile ahead of time{why}; "
                          "`jitllm devices` lists the backends found")
    from .llama import interleaves, model_kernels
    from .models import default_model_path

    path = args.model or default_model_path()
    kernels = model_kernels(path, interleave=interleaves(backend.threads))
    start = time.perf_counter()
    results = backend.compile_ahead(kernels, args.arch)
    seconds = time.perf_counter() - start
    cached = sum(1 for r in results if r["cached"])
    print(f"{args.backend} {args.arch}: {len(results)} kernels for {os.path.basename(path)} in {seconds:.1f} s "
          f"({cached} from the cache, {sum(r['bytes'] for r in results) / 1e6:.2f} MB of code)")
    slowest = sorted(results, key=lambda r: -r["seconds"])[:5]
    print_table(["slowest kernels", "seconds", "bytes"], [[r["name"], f"{r['seconds']:.2f}", r["bytes"]]
                                                          for r in slowest], right=(1, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
