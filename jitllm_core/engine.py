"""The engine: places units on devices, runs steps segment by segment, samples, streams text.

Concurrency: one lock guards the step loop. A step holds it; between steps (and while a streaming caller holds
a token) it is free, so `migrate` from any thread -- including the consumer of a stream -- runs at a step
boundary. Generations in other threads at once decode together: the decode steps they wait for at the same moment
run as one batched step (`Engine._decode`), each weight read once for all of them.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from . import background, faults, ir, ops, quant, registry, tuning
from .errors import BackendError, ContextLimitError, JitllmError, check_whole, is_whole
from .kvcache import SEQUENCES, PagePool, Parked, Sequence, first_live_page
from .llama import Llama, interleaves
from .lookup import SPECULATE, Drafter
from .memory import Arena
from .modelfile import ModelFile
from .models import default_model_path
from .placement import device_name, resolve
from .plugin import Launch
from .sampler import Sampler, check_options
from .tokenizer import StreamDecoder

# tokens per step (prefill chunk): a prefill matmul dequantizes each block of weights once a step, for all its
# tokens. 128 against 64 (benchmarks/ab_decode.py --prompt-tokens 256 --set engine.STEP_TOKENS 64 128): the 1B
# shape 108.3 -> 113.3 tok/s on one thread; 256 gained 1.5 % more for twice the activations' memory, whose
# attention scores and logits grow with the step (224 MB at 128 for the 1B at 8192 positions;
# docs/benchmarks-history.md)
STEP_TOKENS = 128
PAGE = 16          # positions per KV page
DEFAULT_CONTEXT = 8192  # KV positions reserved when the caller does not say (models may allow far more)
# what the CPU's integer dots see of a matmul input: "f32" its digits as accurate as f32 arithmetic (the default),
# "int8" one int8 per element, as llama.cpp quantizes activations (faster, logits ~1 off)
ACTIVATION_DIGITS = {"f32": quant.DIGITS, "int8": quant.INT8}
# how long a batched decode step waits for the other generations in their decode loop to ask for their next step
# (a generation samples and hands its token to its reader between steps: well under a millisecond)
BATCH_WAIT = 0.002


@dataclass
class Event:
    token_id: int
    text: str
    logprob: tuple = None  # with generate(logprobs=N): (the token's log probability, [(token id, log prob)] * N)


@dataclass
class Result:
    token_ids: list
    text: str
    finish_reason: str
    timings: dict = field(default_factory=dict)
    logprobs: list = None  # with generate(logprobs=N): each token's (log probability, its N likeliest alternatives)


def log_probs(logits, token, n):
    """(token's log probability under the model's distribution -- the logits' softmax, before any temperature --,
    the n likeliest tokens' [(id, log probability)], likeliest first)."""
    z = logits.astype(np.float64)
    z -= z.max() + np.log(np.exp(z - z.max()).sum())
    top = np.argpartition(-z, n)[:n] if 0 < n < len(z) else np.arange(len(z) if n else 0)
    top = top[np.argsort(-z[top], kind="stable")]
    return float(z[token]), [(int(i), float(z[i])) for i in top]


class Stream:
    """What generate(stream=True) returns: iterate it for Events; `result` is this generation's Result, complete
    once the iteration ends (eng.last is the latest generation's, whichever thread started it). close() ends the
    generation early and frees its KV pages."""

    def __init__(self, events, result):
        self._events, self.result = events, result

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._events)

    def close(self):
        self._events.close()


class DeviceState:
    """What one device holds for this engine: per-device activations, constants and resident weights."""

    def __init__(self, arena, model: Llama, constants):
        self.arena, self.dev = arena, arena.dev
        self.acts, self.consts = {}, {}
        self.weights = {}   # tensor name -> [Buffer, users]
        self.slots = []     # two {role: Buffer} for streamed units
        try:
            for n, (dt, size) in model.activations(arena.dev.caps.tile_dots).items():
                self.acts[n] = arena.alloc(max(4, size * ir.STORAGE_DTYPES[dt]))
            for name, data in constants.items():
                self.consts[name] = arena.alloc(data.nbytes)
        except Exception:
            self.release()
            raise
        for name, data in constants.items():
            self.dev.upload(self.consts[name], data)

    def release(self):
        """Free everything this device holds for the engine."""
        held = [*self.acts.values(), *self.consts.values(), *(b for s in self.slots for b in s.values()),
                *(b for b, _ in self.weights.values())]
        for b in held:
            self.arena.free(b)
        self.acts, self.consts, self.slots, self.weights = {}, {}, [], {}


@dataclass
class Segment:
    """Units run by one program on one device. A streamed unit is a segment of its own whose weights are copied
    from host memory into one of the device's two slots before it runs (the next one's copy overlaps it)."""
    device: str
    units: list
    program: object           # for a decode step (one token)
    streamed: object = None   # the streamed unit, or None
    slot: int = 0
    prefill: object = None    # for a step of several tokens
    batch: object = None      # for a batched decode step: compiled at the first one (`Engine._batch_program`)


class UnitState:
    """A unit's place: its device, its weight tensors there and, for layers, its KV page pool and page table."""

    def __init__(self, unit, device_name, residency="resident"):
        self.unit, self.device, self.residency = unit, device_name, residency
        self.kv = None          # {"k": Buffer, "v": Buffer, "ptab": Buffer, "bptab": Buffer}
        self.pool = None        # PagePool
        self.tables_for = {}    # "ptab" / "bptab" -> the sequences and page counts of the tables uploaded there


class _Waiting:
    """A generation's decode step, waiting to run (`Engine._decode`): its token, then any draft's."""

    def __init__(self, seq, tokens):
        self.seq, self.tokens, self.logits, self.error = seq, tokens, None, None

    @property
    def done(self):
        return self.logits is not None or self.error is not None


class Engine:
    def __init__(self, model=None, devices=None, placement="auto", threads=None, kv_dtype="f16",
                 max_context=None, progress=None, mem=None, n_device_layers=None, activations="f32",
                 max_sequences=SEQUENCES, prompt_cache=True, speculate=SPECULATE):
        if kv_dtype not in ("f16", "f32"):
            raise JitllmError(f"kv_dtype must be 'f16' or 'f32', not {kv_dtype!r}")
        if activations not in ACTIVATION_DIGITS:
            raise JitllmError(f"activations must be 'f32' or 'int8', not {activations!r}")
        for name, v in (("threads", threads), ("max_context", max_context), ("max_sequences", max_sequences)):
            if v is not None:  # None: all cores, the model's context (at most DEFAULT_CONTEXT)
                check_whole(name, v, 1)
        check_whole("speculate", speculate, 0)
        self.model_path = str(model) if model is not None else default_model_path()
        self.progress = progress or (lambda stage, done, total: None)
        self.mf = ModelFile(self.model_path)
        self.tokenizer = self.mf.tokenizer
        cfg = self.config = self.mf.config
        self.max_context = min(int(max_context or min(cfg.context, DEFAULT_CONTEXT)), cfg.context)
        self.kv_dtype = kv_dtype
        n_pages = -(-self.max_context // PAGE)
        self.model = Llama(self.mf, STEP_TOKENS, PAGE, n_pages, kv_dtype, ACTIVATION_DIGITS[activations],
                           max_sequences, batch=max(max_sequences, 1 + speculate))
        self.constants = self.model.constants_data()  # the rope tables
        self.devices = self._pick_devices(devices, threads)
        caps = {self._device_name(k): v for k, v in (mem or {}).items()}
        self.arenas = {n: Arena(d, caps.get(n)) for n, d in self.devices.items()}
        self._lock = threading.Lock()
        # decode steps asked for; generations in their decode loop; whether a thread runs those waiting
        self._waiting, self._decoding, self._leading = [], 0, False
        self._waiting_cv = threading.Condition()
        self._seq_ids = iter(range(1, 1 << 62))
        self.sequences = {}
        self.prompt_cache = prompt_cache
        # draft tokens a decode step checks at most (`PromptLookup`); the rows of a batched step that the
        # generations decoding at once leave free
        self.speculate = speculate
        self.parked = []    # finished generations' sequences, oldest first (`Parked`): the prompt cache
        self.dev_state = {}
        self.units = {}
        self.segments = []
        self.last = None
        self.plan = None    # the cost model's prediction, when the planner chose the placement
        self.stats = {"steps": 0, "tokens": 0, "bytes_read": {}, "bytes_crossed": {}, "crossings": 0,
                      "bytes_per_token": 0, "batched_steps": 0}
        self._streamer = ThreadPoolExecutor(1, thread_name_prefix="jitllm-stream")
        # the batched steps' programs that drafts run in, compiled from an engine's first reply on (`_compile_batched`)
        self._batch_build = None
        layout = resolve(self, placement, n_device_layers)
        total = len(layout)
        for i, (unit, (dev_name, residency)) in enumerate(layout.items()):
            self.progress("loading weights", i, total)
            self._place_unit(unit, dev_name, residency)
        self.progress("loading weights", total, total)
        self._build_segments()

    # ------------------------------------------------------------------ devices and placement
    def _pick_devices(self, names, threads):
        if isinstance(names, str):  # one device
            names = [names]
        if names is not None and not names:
            raise JitllmError("devices is empty: name at least one (e.g. ['cpu']), or None for all available")
        if names is None:
            devs = list(registry.all_devices().values())
            if not devs:
                registry.device("cpu")  # raises the "no backend installed" explanation
        else:
            devs = [registry.device(n) for n in names]
        if threads:
            cpus = [d for d in devs if d.backend == "cpu"]
            for d in cpus:
                d.configure(threads=max(1, int(threads) // len(cpus)))
        return {d.name: d for d in devs}

    @property
    def placement(self):
        """unit -> (device, residency); a unit resident on the host CPU while others sit on an accelerator is
        'host-compute'."""
        host = self.host_device()
        accel = any(st.device != host for st in self.units.values())
        return {u: (st.device, "host-compute" if accel and st.device == host and st.residency == "resident"
                    else st.residency) for u, st in self.units.items()}

    def host_device(self):
        return next((n for n, d in self.devices.items() if d.backend == "cpu"), None)

    def _device_name(self, name):
        return device_name(name, self.devices)

    def _state(self, dev_name):
        if dev_name not in self.dev_state:
            self.dev_state[dev_name] = DeviceState(self.arenas[dev_name], self.model, self.constants)
        return self.dev_state[dev_name]

    def _load_weights(self, unit, dev_name):
        """Upload (or share) the unit's weights on dev_name; returns bytes uploaded. All or nothing."""
        ds, moved, taken, by_kernel = self._state(dev_name), 0, [], []
        interleave = self._interleaves(dev_name)
        try:
            for name in self.model.weight_shapes(unit):
                if name in ds.weights:
                    ds.weights[name][1] += 1
                    taken.append(name)
                    continue
                buf = ds.arena.alloc(self.model.tensor_bytes(name, unit, interleave))
                ds.weights[name] = [buf, 1]
                taken.append(name)
                moved += buf.nbytes
                repacking = self.model.repacking(name, unit, interleave)
                if repacking:
                    by_kernel.append((name, buf, *repacking))
                else:
                    self._upload_from_host(ds, name, unit, interleave, buf)
            self._repack(ds, unit, interleave, by_kernel)
        except Exception:
            self._drop_weights(unit, dev_name, taken)
            raise
        return moved

    def _upload_from_host(self, ds, name, unit, interleave, buf):
        """A weight's bytes as `Llama.host_data` gives them (repacked by NumPy where its layout needs it) into buf."""
        view = buf.host_view()  # a host-visible device's buffer: repacked in place, not copied in
        data = self.model.host_data(name, unit, interleave=interleave, out=view)
        if data is not view:
            ds.dev.upload(buf, data)

    def _repack(self, ds, unit, interleave, weights):
        """Weights (name, buffer, kernel, file bytes) repacked by their device (`Llama.repacking`): the file's bytes
        uploaded into scratch buffers, one program of the layouts' kernels writing the buffers from there (the 1B
        shape's 800 MB on two threads: 0.20 s uploaded, 0.12 s repacked, where NumPy's passes took 0.8 s)."""
        scratch = []
        try:
            for _, _, kernel, raw in weights:
                scratch.append(ds.arena.alloc(kernel.buffers["raw"].size * 4))
                ds.dev.upload(scratch[-1], raw)
            if weights:
                launches = [Launch(k, {"raw": s, "out": buf}) for (_, buf, k, _), s in zip(weights, scratch)]
                ds.dev.program(launches).run({})
        except BackendError:  # no room for the file's bytes beside the weights, or kernels the device cannot run
            for name, buf, _, _ in weights:  # (storage ranges too small for them): NumPy's on the host
                self._upload_from_host(ds, name, unit, interleave, buf)
        finally:
            for b in scratch:
                ds.arena.free(b)

    def _drop_weights(self, unit, dev_name, names=None):
        """Release the unit's share of its weights on dev_name (all of them, or `names`)."""
        ds = self.dev_state[dev_name]
        for name in self.model.weight_shapes(unit) if names is None else names:
            entry = ds.weights[name]
            entry[1] -= 1
            if entry[1] == 0:
                ds.arena.free(entry[0])
                del ds.weights[name]

    def _release_unused_states(self):
        """Free the activations of devices that no longer hold any unit."""
        used = {st.device for st in self.units.values()}
        for name in [n for n in self.dev_state if n not in used]:
            self.dev_state.pop(name).release()

    def _alloc_kv(self, dev_name, unit):
        arena, m = self.arenas[dev_name], self.model
        half = m.kv_bytes(unit) // 2
        kv = {}
        try:
            for name, size in (("k", half), ("v", half), ("ptab", m.n_pages * 4),
                               ("bptab", m.batch * m.n_pages * 4)):
                kv[name] = arena.alloc(size)
        except Exception:
            self._free_kv(dev_name, kv)
            raise
        return kv

    def _free_kv(self, dev_name, kv):
        for b in kv.values():
            self.arenas[dev_name].free(b)

    def _place_unit(self, unit, dev_name, residency="resident"):
        st = UnitState(unit, dev_name, residency)
        if residency == "streamed":
            self._state(dev_name)
        else:
            self._load_weights(unit, dev_name)
        if isinstance(unit, int):
            st.kv, st.pool = self._alloc_kv(dev_name, unit), self.page_pool(unit)
        self.units[unit] = st

    def _bind(self, unit, dev_name, kv=None, slot=None, prefill=False, batch=False):
        """Launches of one unit with its buffer names resolved on dev_name (weights in `slot` when streamed), for a
        decode step, a prefill step or a batched decode step (`Llama.unit_launches`)."""
        ds, out = self.dev_state[dev_name], []
        kv = kv or self.units[unit].kv or {}
        weight = (lambda n: ds.weights[n][0]) if slot is None else (lambda n: ds.slots[slot][_role(n)])
        # a device may decline the prefill matmul (Caps.extra["prefill_matmul"]): its prefill then runs the decode one
        prefill = prefill and self.devices[dev_name].caps.extra.get("prefill_matmul", True)
        caps = self.devices[dev_name].caps
        for lt in self.model.unit_launches(unit, prefill, self._interleaves(dev_name), ops.gemm_tile(caps.registers),
                                           batch, caps.tile_dots):
            bufs = {}
            for param, ref in lt.buffers.items():
                kind, name = ref.split(":", 1)
                bufs[param] = {"w": weight, "a": ds.acts.__getitem__,
                               "c": ds.consts.__getitem__, "kv": kv.__getitem__}[kind](name)
            out.append(Launch(lt.kernel, bufs, lt.scalars))
        return out

    def _layout(self):
        return {u: (st.device, st.residency) for u, st in self.units.items()}

    def _programs(self, layout, kvs=None, measure=True):
        """One program per segment -- consecutive resident units on one device, or one streamed unit -- for a
        layout unit -> (device, residency). kvs overrides the KV buffers of some units (a migration binds the
        target's before switching; it does not measure tunings, as the reply goes on meanwhile: tuning.tune)."""
        segs, n_streamed = [], {}
        for unit in self.model.units:
            d, res = layout[unit]
            if res == "streamed":
                k = n_streamed[d] = n_streamed.get(d, -1) + 1
                segs.append(Segment(d, [unit], None, unit, k % 2))
            elif segs and segs[-1].device == d and segs[-1].streamed is None:
                segs[-1].units.append(unit)
            else:
                segs.append(Segment(d, [unit], None))
        for d in n_streamed:
            self._ensure_slots(d, [u for u in self.model.units if layout[u] == (d, "streamed")])
        bound = [[[ln for u in seg.units for ln in self._bind(u, seg.device, (kvs or {}).get(u),
                                                               seg.slot if seg.streamed is not None else None, pre)]
                  for pre in (False, True)] for seg in segs]
        for d in dict.fromkeys(seg.device for seg in segs):  # the decode steps' kernels, where weights stream
            tuning.tune(self.devices[d], [ln.kernel for seg, (step, _) in zip(segs, bound) if seg.device == d
                                          for ln in step], self.progress, measure)
        for i, (seg, launches) in enumerate(zip(segs, bound)):
            self.progress("compiling kernels", i, len(segs))
            faults.check("compile", seg.device)
            # the prefill program first: its module is the larger, so its compile starts while decode's is lowered
            seg.prefill, seg.program = (self.devices[seg.device].program(lns) for lns in reversed(launches))
        for seg in segs:   # compile errors come from here, not from the first step
            seg.program.ready(), seg.prefill.ready()
        self.progress("compiling kernels", len(segs), len(segs))
        return segs

    def _ensure_slots(self, dev_name, units):
        """Two weight slots on the device, each large enough for any of the streamed units' tensors."""
        need = {}
        for u in units:
            for name in self.model.weight_shapes(u):
                need[_role(name)] = max(need.get(_role(name), 0),
                                        self.model.tensor_bytes(name, u, self._interleaves(dev_name)))
        ds = self._state(dev_name)
        if ds.slots and all(ds.slots[0].get(r) is not None and ds.slots[0][r].nbytes >= n for r, n in need.items()):
            return
        for s in ds.slots:
            for b in s.values():
                ds.arena.free(b)
        ds.slots = []
        for _ in range(2):
            ds.slots.append({r: ds.arena.alloc(n) for r, n in need.items()})

    def _stream_in(self, seg):
        """Copy a streamed unit's weights from host memory into its slot; returns bytes copied."""
        ds, moved = self.dev_state[seg.device], 0
        for name in self.model.weight_shapes(seg.streamed):
            data = self.model.host_data(name, seg.streamed, keep=True, interleave=self._interleaves(seg.device))
            ds.dev.upload(ds.slots[seg.slot][_role(name)], data)
            moved += data.nbytes
        return moved

    def _build_segments(self):
        self.segments = self._programs(self._layout())
        self.stats["bytes_per_token"] = self._weight_bytes()

    def _compile_batched(self):
        """Start compiling the batched steps' programs as background work (`background`: while no reply runs),
        once: a reply drafts only once they are ready, so that its first draft does not wait for them (2.6 s for
        SmolLM2 with a cold kernel cache). Started by the first reply after its prompt (not by `Engine()`: it would
        slow the first token)."""
        with self._lock:
            if self._batch_build is None:
                segs = list(self.segments)
                self._batch_build = background.start(lambda: [self._batch_program(seg) for seg in segs],
                                                     "jitllm-build")

    def wait_compiled(self):
        """Compile the batched steps' programs that drafts run in, if the engine has not yet, and wait for them;
        replies draft only once they are ready."""
        self._compile_batched()
        background.wait(self._batch_build)

    def _weight_bytes(self):
        """Weight bytes one decode step reads: every unit's tensors, but only one row of the embedding (and a
        mixture's share of its experts)."""
        return sum(self._step_bytes(u) // (self.config.vocab if u == "embed" else 1) for u in self.model.units)

    def _interleaves(self, dev_name):
        return interleaves(self.devices[dev_name].caps.threads)

    def _step_bytes(self, unit, tokens=1):
        """The unit's weight bytes a decode step (of `tokens` sequences) reads, in the layout of the device it is
        on (`Llama.step_bytes`)."""
        return self.model.step_bytes(unit, self._interleaves(self.units[unit].device), tokens)


    # ------------------------------------------------------------------ sequences and steps
    def new_sequence(self):
        seq = Sequence(next(self._seq_ids))
        self.sequences[seq.id] = seq
        return seq

    def free_sequence(self, seq):
        with self._lock:
            self._release(seq)

    def _release(self, seq):
        """Give a sequence's pages back to their pools. Lock held."""
        self._cut(seq, 0)
        seq.pages.clear()
        self.sequences.pop(seq.id, None)

    def _cut(self, seq, keep):
        """Give back a sequence's pages from page `keep` on, in every layer (those a window passed are gone)."""
        for u, pages in seq.pages.items():
            self.units[u].pool.free([p for p in pages[keep:] if p is not None])
            del pages[keep:]

    # -- the prompt cache: a finished generation's sequence is parked with its tokens; a later prompt that starts
    # with them resumes it (a chat's next turn, the same prompt again) instead of computing those positions again
    def _park(self, seq, tokens, exact):
        with self._lock:
            if not self.segments:  # closed meanwhile: the pages went with the pools
                return
            self.parked.append(Parked(seq, tokens, exact))
            while len(self.parked) > self.model.sequences:
                self._release(self.parked.pop(0).seq)

    def _resume(self, ids):
        """(a sequence for a prompt, the positions it already holds): the parked one that holds the most of the
        prompt, cut back to those positions, else a new one. Lock held."""
        best, held = None, 0
        for p in self.parked if self.prompt_cache else ():
            n = p.reusable(ids, self.model.T)
            if n > held and self._windows_hold(p.seq, n):
                best, held = p, n
        if best is None:
            return self.new_sequence(), 0
        self.parked.remove(best)
        seq = best.seq
        self._cut(seq, -(-held // PAGE))
        # a new identity: the page tables uploaded for it, and what a migration under way copied of it, are stale
        self.sequences.pop(seq.id)
        seq.id, seq.n = next(self._seq_ids), held
        self.sequences[seq.id] = seq
        return seq, held

    def _windows_hold(self, seq, n):
        """Whether every sliding-window layer still holds the pages a step from position n reads."""
        return all(seq.pages[u][i] is not None for u in seq.pages if self.config.window(u)
                   for i in range(first_live_page(n, self.config.window(u), PAGE), -(-n // PAGE)))

    def page_pool(self, unit):
        """A new KV page pool for a layer (`Llama.pool_pages`)."""
        m = self.model
        note = (f" (a sliding-window layer's pool holds {m.sequences} sequences' windows: Engine(max_sequences=))"
                if self.config.window(unit) and m.pool_pages(unit) < m.n_pages else "")
        return PagePool(m.pool_pages(unit), note)

    def _ensure_pages(self, seq, pos, end):
        """Pages for positions up to end, in every layer; a sliding-window layer's pages behind the window of the
        step from pos freed first (never read again)."""
        need = -(-end // PAGE)
        for u, st in self.units.items():
            if st.pool is None:
                continue
            pages = seq.pages.setdefault(u, [])
            window = self.config.window(u)
            for i in range(first_live_page(pos, window, PAGE) - 1 if window else -1, -1, -1):
                if pages[i] is None:
                    break
                st.pool.free([pages[i]])
                pages[i] = None
            while len(pages) < need:
                while not st.pool.free_pages and self.parked:  # a full pool: parked sequences go first, oldest first
                    self._release(self.parked.pop(0).seq)
                pages.append(st.pool.alloc())

    def _upload_tables(self, seqs, name):
        """Every layer's page tables of seqs, a row of the KV buffer `name` each ("ptab": one sequence's step;
        "bptab": a batched step's, a row per token), where they changed since the last upload there."""
        for u, st in self.units.items():
            if st.pool is None:
                continue
            key = (tuple((seq.id, len(seq.pages[u])) for seq in seqs), st.kv[name])
            if st.tables_for.get(name) != key:
                table = np.zeros((len(seqs), self.model.n_pages), np.int32)  # rows as the kernels' stride
                for row, seq in zip(table, seqs):  # a freed page's entry is never read (the window starts after it)
                    row[:len(seq.pages[u])] = [0 if p is None else p for p in seq.pages[u]]
                self.devices[st.device].upload(st.kv[name], table)
                st.tables_for[name] = key

    def _check_step(self, seq, tokens):
        """Raise what running tokens at positions seq.n.. would fail on. Lock held."""
        if not self.segments:
            raise JitllmError("the engine is closed")
        if seq.n + len(tokens) > self.max_context:
            raise ContextLimitError(f"context limit reached: {seq.n + len(tokens)} positions > max_context "
                                    f"{self.max_context}")
        bad = next((t for t in tokens if not 0 <= t < self.config.vocab), None)
        if bad is not None:  # the embedding kernel would read outside its table
            raise JitllmError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab})")

    def _step(self, seq, tokens, t0):
        """Run tokens at positions seq.n.. through every segment; returns logits rows [t0, n). Lock held."""
        self._check_step(seq, tokens)
        self._ensure_pages(seq, seq.n, seq.n + len(tokens))
        return self._step_ready(seq, tokens, t0)

    def _step_ready(self, seq, tokens, t0):
        """`_step` once its tokens are checked and its pages there."""
        n, pos = len(tokens), seq.n
        self._upload_tables([seq], "ptab")
        logits = self._run(tokens, {"pos": pos, "n_tokens": n, "t0": t0},
                           (lambda seg: seg.prefill) if n > 1 else (lambda seg: seg.program))
        seq.n += n
        self._count([(pos, n)])
        return logits

    def _step_batch(self, seqs, tokens):
        """One decode step of several sequences, token i at the end of seqs[i] -- a sequence named k times takes k
        tokens, at its next k positions (a draft) -- (each checked, its pages there: `_run_waiting`), every weight
        read once for all; returns their logits rows. Lock held."""
        if self._batch_build is not None:  # the background work's programs (its compile error, if any, raised here)
            background.wait(self._batch_build).result()
        self._upload_tables(seqs, "bptab")
        ahead, positions = {}, []
        for seq in seqs:
            positions.append(seq.n + ahead.get(seq.id, 0))
            ahead[seq.id] = ahead.get(seq.id, 0) + 1
        positions = np.asarray(positions, np.int32)
        for d in {st.device for st in self.units.values() if st.pool is not None}:
            self.dev_state[d].dev.upload(self.dev_state[d].acts["tpos"], positions)
        logits = self._run(tokens, {"pos": 0, "n_tokens": len(tokens), "t0": 0}, self._batch_program)
        for seq in seqs:
            seq.n += 1
        self.stats["batched_steps"] += 1
        self._count([(int(p), 1) for p in positions])
        return logits

    def _batch_program(self, seg):
        """A segment's program for a batched decode step, compiled at the first one (an engine that never runs
        two generations at once needs none) or, where the engine drafts, as background work after its first reply
        (`_compile_batched`; `_step_batch` waits for that)."""
        if seg.batch is None:
            background.pause()
            slot = seg.slot if seg.streamed is not None else None
            seg.batch = self.devices[seg.device].program(
                [ln for u in seg.units for ln in self._bind(u, seg.device, slot=slot, batch=True)])
            seg.batch.ready()
        return seg.batch

    def _run(self, tokens, values, program):
        """Run a step's tokens through every segment (`program(segment)`, with scalars `values`); returns the
        logits rows from values["t0"] on."""
        n, values = len(tokens), {**values, **self.model.constants}
        t0 = values["t0"]
        first = self.dev_state[self.segments[0].device]
        first.dev.upload(first.acts["tok"], np.asarray(tokens, np.int32))
        streamed = [seg for seg in self.segments if seg.streamed is not None]
        pending = {id(streamed[0]): self._streamer.submit(self._stream_in, streamed[0])} if streamed else {}
        prev = None
        for seg in self.segments:
            d = seg.device
            if prev is not None and prev != d:
                self._cross(prev, d, n * self.config.dim * 4)
            if seg.streamed is not None:
                nbytes = pending.pop(id(seg)).result()
                self._account("bytes_crossed", f"host->{d}", nbytes)
                self.stats["crossings"] += 1
                after = streamed.index(seg) + 1
                if after < len(streamed):  # the other slot is free: copy the next unit while this one runs
                    pending[id(streamed[after])] = self._streamer.submit(self._stream_in, streamed[after])
            program(seg).run(values)
            prev = d
        last = self.dev_state[prev]
        rows = n - t0
        V = self.config.vocab
        return last.dev.download(last.acts["logits"], rows * V * 4, t0 * V * 4).view(np.float32).reshape(rows, V)

    def _decode(self, seq, tokens):
        """The logits of seq's next decode step: rows for its token (tokens[0], at its end) and for as many of the
        draft after it (tokens[1:]) as the step had room for. The decode steps other generations ask for at the
        same moment join it: one thread at a time leads, running those waiting as one batched step, while the
        others wait for their logits (not for the engine's lock, which the leader may take again at once)."""
        w, cv = _Waiting(seq, tokens), self._waiting_cv
        with cv:
            self._waiting.append(w)
            cv.notify_all()
        while True:
            with cv:
                cv.wait_for(lambda: w.done or not self._leading)
                if w.done:
                    break
                self._leading = True
            try:
                with self._lock:
                    self._run_waiting()
            finally:
                with cv:
                    self._leading = False
                    cv.notify_all()
        if w.error is not None:
            raise w.error
        return w.logits

    def _run_waiting(self):
        """Run the first `Llama.batch` decode steps waiting, once every generation in its decode loop has asked for its
        next (or BATCH_WAIT passed), their drafts in the rows left (first come, first served): one token alone as a
        plain decode step. A step that cannot run (its context full) gets its error; the others run. Lock held."""
        with self._waiting_cv:
            self._waiting_cv.wait_for(lambda: len(self._waiting) >= min(self._decoding, self.model.batch), BATCH_WAIT)
            batch, self._waiting[:self.model.batch] = self._waiting[:self.model.batch], []
        ready, room = [], self.model.batch - len(batch)
        for w in batch:  # every step taken from the queue ends done, with logits or an error: its thread waits on it
            w.tokens = w.tokens[:1 + room]
            try:
                self._check_step(w.seq, w.tokens)
                self._ensure_pages(w.seq, w.seq.n, w.seq.n + len(w.tokens))
                ready.append(w)
                room -= len(w.tokens) - 1
            except Exception as e:  # noqa: BLE001 -- its generation raises it
                w.error = e
        try:
            if len(ready) == 1 and len(ready[0].tokens) == 1:
                ready[0].logits = self._step_ready(ready[0].seq, ready[0].tokens, 0)
            elif ready:
                rows = iter(self._step_batch([w.seq for w in ready for _ in w.tokens],
                                             [t for w in ready for t in w.tokens]))
                for w in ready:
                    w.logits = np.stack([next(rows) for _ in w.tokens])
        except Exception as e:  # noqa: BLE001 -- every waiting generation learns why its step failed
            for w in ready:
                w.error = e

    def _chunks(self, ids):
        """ids in steps of the model's size (STEP_TOKENS when the engine was made)."""
        T = self.model.T
        return [ids[i:i + T] for i in range(0, len(ids), T)]

    def _cross(self, src, dst, nbytes):
        a, b = self.dev_state[src].acts["x"], self.dev_state[dst].acts["x"]
        registry.copy(a, 0, b, 0, nbytes)
        self._account("bytes_crossed", f"{src}->{dst}", nbytes)
        self.stats["crossings"] += 1

    def _account(self, table, key, nbytes):
        self.stats[table][key] = self.stats[table].get(key, 0) + nbytes

    def _count(self, spans):
        """Bytes each device's memory served this step: every unit's weights (a streamed unit's from its slot,
        after the copy) and the KV rows attention read. spans: (first position, tokens) of each sequence the step
        ran."""
        s = self.stats
        s["steps"] += 1
        s["tokens"] += sum(n for _, n in spans)
        kv_row = 2 * self.model.page_bytes() // self.model.page  # K and V of one position
        for u, st in self.units.items():
            b = self._step_bytes(u, len(spans))
            if st.pool is not None:
                window = self.config.window(u)
                b += kv_row * sum(min(pos + n, window + n - 1) if window else pos + n for pos, n in spans)
            self._account("bytes_read", st.device, b)

    # ------------------------------------------------------------------ public API
    def apply_chat_template(self, messages, add_generation_prompt=True):
        from .chat import render_chat
        tok = self.tokenizer
        return render_chat(tok.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=tok.bos_token or "", eos_token=tok.eos_token or "")

    def encode(self, prompt):
        """A prompt's token ids: a string encoded, or a sequence of whole numbers as it is."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = list(prompt) if isinstance(prompt, (list, tuple, np.ndarray)) else None
        if ids is None or not all(map(is_whole, ids)):
            raise JitllmError(f"a prompt is a string or a list of token ids (whole numbers), not {_brief(prompt)}")
        return [int(i) for i in ids]

    def session(self):
        """A sequence that stays alive between calls: `with eng.session() as s: s.feed(ids)`."""
        return Session(self)

    def score(self, token_ids):
        """Teacher-forced logits for every position: shape (len, vocab), float32."""
        with self.session() as s:
            return s.feed(token_ids)

    def generate(self, prompt, max_tokens=256, temperature=0.0, top_k=0, top_p=1.0, seed=None, stop=None,
                 ignore_eos=False, stream=False, logprobs=None):
        check_options(max_tokens=max_tokens)
        if logprobs is not None:
            check_whole("logprobs", logprobs, 0)
        stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
        if not isinstance(stops, (list, tuple)) or not all(isinstance(x, str) and x for x in stops):
            raise JitllmError(f"stop is a non-empty string or a list of them, not {_brief(stop)}")
        ids = self.encode(prompt)
        if not ids:
            raise JitllmError("the prompt is empty")
        if len(ids) >= self.max_context:
            raise ContextLimitError(f"the prompt has {len(ids)} tokens; max_context is {self.max_context}")
        result = Result([], "", "length", logprobs=None if logprobs is None else [])
        it = self._generate(ids, max_tokens, Sampler(temperature, top_k, top_p, seed), list(stops), ignore_eos,
                            result, logprobs)
        if stream:
            return Stream(it, result)
        for _ in it:
            pass
        return result

    def chat(self, messages, **kw):
        return self.generate(self.apply_chat_template(messages), **kw)

    def _generate(self, ids, max_tokens, sampler, stops, ignore_eos, result, logprobs=None):
        with self._lock:
            seq, cached = self._resume(ids)
        out, text, emitted, reason, clean, decoding = result.token_ids, "", 0, "length", False, False
        dec = StreamDecoder(self.tokenizer)
        timings = result.timings = {"prompt_tokens": len(ids), "cached_tokens": cached, "prefill_s": 0.0,
                                    "decode_tokens": 0, "decode_s": 0.0, "drafted_tokens": 0, "accepted_tokens": 0}
        self.last = result
        # rows of logits not yet sampled: the last step's, in order; drafts[i] the token rows[i + 1] followed
        rows, drafts, drafted = [], [], 0
        drafter = Drafter(ids, self.speculate) if self.speculate else None
        background.reply_started()  # background work waits till the reply's end
        try:
            t = time.perf_counter()
            chunks = self._chunks(ids[cached:])  # from a step boundary: the steps a fresh run takes
            for i, chunk in enumerate(chunks):
                with self._lock:  # logits of the last chunk's last token only
                    rows = list(self._step(seq, chunk, len(chunk) - 1 if i == len(chunks) - 1 else len(chunk)))
            timings["prefill_s"] = time.perf_counter() - t
            if drafter is not None:
                self._compile_batched()
            while len(out) < max_tokens:
                row = rows.pop(0)
                tok = sampler(row)
                if not ignore_eos and tok in self.tokenizer.eos_ids:
                    reason = "eos"
                    break
                out.append(tok)
                lp = None
                if logprobs is not None:
                    lp = log_probs(row, tok, logprobs)
                    result.logprobs.append(lp)
                text += dec.push(tok)
                hit = min((text.find(s) for s in stops if s in text), default=-1)
                if hit >= 0:
                    text, reason = text[:hit], "stop"
                safe = len(text) if hit >= 0 else len(text) - _held_back(text, stops)
                result.text = text
                if safe > emitted or hit < 0:
                    yield Event(tok, text[emitted:safe], lp)
                    emitted = safe
                if hit >= 0 or len(out) >= max_tokens:
                    break
                if drafter is not None:
                    drafter.push(tok)
                if rows and drafts.pop(0) == tok:  # the next row is the step this token would have had
                    timings["accepted_tokens"] += 1
                    timings["decode_tokens"] += 1
                    continue
                if drafter is not None:
                    drafter.checked(drafted, drafted - len(rows))
                self._forget(seq, rows)  # drafted past the reply: the next step writes over those positions
                if seq.n + 1 > self.max_context:
                    reason = "context"
                    break
                t = time.perf_counter()
                if not decoding:
                    decoding = True
                    with self._waiting_cv:
                        self._decoding += 1
                # drafts once the batched programs are ready (`_compile_batched`); guesses scored meanwhile
                draft = [] if drafter is None else \
                    drafter.draft(self.max_context - seq.n - 1 if self._batch_build.done() else 0)
                rows = list(self._decode(seq, [tok] + draft))
                drafts = draft[:len(rows) - 1]
                drafted = len(drafts)
                timings["drafted_tokens"] += drafted
                timings["decode_s"] += time.perf_counter() - t
                timings["decode_tokens"] += 1
            if reason != "stop":
                text += dec.flush()
            clean = True
        except GeneratorExit:  # closed early: what the sequence holds is whole
            clean = True
            raise
        finally:
            background.reply_ended()
            self._forget(seq, rows)
            if decoding:
                with self._waiting_cv:
                    self._decoding -= 1
                    self._waiting_cv.notify_all()
            result.text, result.finish_reason = text, reason
            if clean and self.prompt_cache:
                self._park(seq, (ids + out)[:seq.n], len(ids) // self.model.T * self.model.T)
            else:
                self.free_sequence(seq)

    def _forget(self, seq, rows):
        """Drop the rows of a draft's tokens a generation did not take: seq ends before them."""
        if rows:
            with self._lock:
                seq.n -= len(rows)
            rows.clear()

    def reset_stats(self):
        self.stats.update(steps=0, tokens=0, bytes_read={}, bytes_crossed={}, crossings=0, batched_steps=0)

    def migrate(self, layers, device, wait=True):
        """Move units (layer indices, ranges, 'embed', 'head', or a string like '0-29') to `device` while
        generation goes on; returns the report, or with wait=False a future whose .result() is the report."""
        from .migration import Migration
        if not self.segments:
            raise JitllmError("the engine is closed")
        if self._batch_build is not None:
            background.wait(self._batch_build)  # the build binds buffers that a move frees
        return Migration(self, layers, device).start(wait)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Free every device buffer; the engine is unusable after (calls raise "the engine is closed")."""
        self._streamer.shutdown()
        if self._batch_build is not None:
            background.wait(self._batch_build)  # its programs bind the buffers freed below
        with self._lock:
            for st in self.units.values():
                if st.kv:
                    self._free_kv(st.device, st.kv)
            for ds in self.dev_state.values():
                ds.release()
            for seq in self.sequences.values():  # their pages went with the pools: a stream still open frees none
                seq.pages.clear()
            self.units, self.dev_state, self.segments, self.sequences, self.parked = {}, {}, [], {}, []


class Session:
    """One sequence and its KV pages; feed() appends tokens and returns their logits."""

    def __init__(self, eng):
        self.eng, self.seq = eng, eng.new_sequence()

    def feed(self, token_ids):
        ids = self.eng.encode(token_ids)
        if not ids:
            raise JitllmError("feed needs at least one token")
        out = []
        for chunk in self.eng._chunks(ids):
            with self.eng._lock:
                out.append(self.eng._step(self.seq, chunk, 0).copy())
        return np.concatenate(out)

    def close(self):
        self.eng.free_sequence(self.seq)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _brief(value):
    """A value as an error message shows it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _role(tensor_name):
    """'blk.7.attn_q.weight' -> 'attn_q.weight': the same tensor of every layer shares a streaming slot."""
    return tensor_name.split(".", 2)[2] if tensor_name.startswith("blk.") else tensor_name


def _held_back(text, stops):
    """Length of the longest suffix of text that could still grow into a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                best = max(best, k)
                break
    return best
