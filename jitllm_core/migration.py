"""Live migration of units (weights, compiled programs, KV pages) between devices, at a step boundary.

1. reserve on the target (all allocations happen first: running out of memory aborts before anything moves);
2. pre-stage weights and compile the new layout's programs, without the engine lock: tokens keep flowing;
3. pre-copy every KV page that is already full (full pages never change again);
4. take the engine lock (= wait for the step boundary), copy the pages not yet copied (the tail), switch the
   placement and programs atomically, release;
5. free the source.
Any failure before the switch rolls back: target allocations are freed and the engine never saw them.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from . import faults, registry
from .errors import JitllmError

_serial = threading.Lock()  # migrations run one after another, in the order they were asked for


@dataclass
class MigrationReport:
    units: list
    target: str
    ok: bool = True
    reason: str = ""
    noop: bool = False
    pause_ms: float = 0.0
    bytes_precopied: int = 0
    bytes_in_pause: int = 0
    bytes_weights: int = 0
    paths: dict = field(default_factory=dict)    # what -> mechanism, e.g. {"kv cpu:0->cpu:1": "peer"}
    recomputed_tokens: int = 0
    total_ms: float = 0.0

    @property
    def bytes_moved(self):
        return self.bytes_precopied + self.bytes_in_pause

    def __str__(self):
        if self.noop:
            return f"migrate {_span(self.units)} -> {self.target}: already there"
        if not self.ok:
            return f"migrate {_span(self.units)} -> {self.target}: FAILED, rolled back: {self.reason}"
        paths = ", ".join(f"{k}: {v}" for k, v in self.paths.items())
        return (f"migrate {_span(self.units)} -> {self.target}: pause {self.pause_ms:.2f} ms, "
                f"KV {self.bytes_precopied / 1e6:.2f} MB pre-copied + {self.bytes_in_pause / 1e6:.3f} MB in pause, "
                f"weights {self.bytes_weights / 1e6:.1f} MB staged, recomputed tokens {self.recomputed_tokens}"
                f"{'; ' + paths if paths else ''}")


def _span(units):
    ints = [u for u in units if isinstance(u, int)]
    names = [u for u in units if not isinstance(u, int)]
    parts = ([f"{min(ints)}-{max(ints)}" if len(ints) > 1 else str(ints[0])] if ints else []) + names
    return "units " + ",".join(parts)


def parse_units(spec, all_units):
    """'0-29', '3', 'embed,0-4', a range, an int or a list of those -> list of units in model order."""
    out = []
    items = spec.replace(" ", "").split(",") if isinstance(spec, str) else (
        [spec] if isinstance(spec, int) else list(spec))
    for it in items:
        if isinstance(it, str) and "-" in it:
            a, b = it.split("-", 1)
            if not (a.isdigit() and b.isdigit()):
                raise JitllmError(f"migrate: cannot read {it!r} as a layer range (e.g. 0-29)")
            out += range(int(a), int(b) + 1)
        elif isinstance(it, str) and it.isdigit():
            out.append(int(it))
        else:
            out.append(it)
    bad = [u for u in out if u not in all_units]
    if bad:
        raise JitllmError(f"migrate: unknown unit {bad[0]!r}")
    return [u for u in all_units if u in out]


class Migration:
    def __init__(self, eng, layers, device):
        self.eng = eng
        self.target = eng._device_name(device)
        self.units = parse_units(layers, eng.model.units)
        self.report = MigrationReport(self.units, self.target)

    def start(self, wait):
        if wait:
            return self.run()
        fut = Future()

        def work():
            try:
                fut.set_result(self.run())
            except BaseException as e:  # run() reports its own failures; this is for the unforeseen
                fut.set_exception(e)
        threading.Thread(target=work, daemon=True, name="jitllm-migrate").start()
        return fut

    def run(self):
        with _serial:
            t = time.perf_counter()
            moving = [u for u in self.units if self.eng.units[u].device != self.target]
            if not moving:
                self.report.noop = True
                return self.report
            self.moving = moving
            self.staged = {}          # unit -> {"kv": buffers, "pool": PagePool}
            self.new_pages = {}       # (seq id, unit) -> {source page: target page}
            self.weights_done = []
            try:
                self._prestage()
                self._precopy()
                self._pause_and_switch()
            except Exception as e:
                self._rollback()
                self.report.ok, self.report.reason = False, str(e) or type(e).__name__
            self.report.total_ms = (time.perf_counter() - t) * 1e3
            return self.report

    # -- 1 + 2: reserve, stage weights, compile
    def _prestage(self):
        eng, r = self.eng, self.report
        self.new_state = self.target not in eng.dev_state
        eng._state(self.target)
        for u in self.moving:
            r.bytes_weights += eng._load_weights(u, self.target)
            self.weights_done.append(u)
            if eng.units[u].pool is not None:
                self.staged[u] = {"kv": eng._alloc_kv(self.target, u), "pool": eng.page_pool(u)}
        r.paths["weights"] = "host-upload"
        self.layout = eng._layout()
        self.layout.update({u: (self.target, "resident") for u in self.moving})
        self.programs = self._target_programs()

    def _target_programs(self):
        """The programs of the layout after the move, the target's KV buffers bound; tunings not measured (the
        source goes on generating meanwhile)."""
        return self.eng._programs(self.layout, {u: s["kv"] for u, s in self.staged.items()}, measure=False)

    # -- 3: pages that are full never change again: copy them while the source keeps generating. The partial
    # tail page is copied too (it warms the target's memory) and copied again in the pause. A sliding-window
    # layer's pages are all copied in the pause: a few windows' worth, and the source frees and reuses them.
    def _precopy(self):
        eng = self.eng
        whole = [u for u in self.staged if not eng.config.window(u)]
        with eng._lock:  # a consistent view of which pages are full right now
            snapshot = [(seq.id, seq.n, {u: list(seq.pages.get(u, ())) for u in whole})
                        for seq in eng.sequences.values()]
        self.dirty, self.prefix = {}, {}
        for sid, n, pages in snapshot:
            full = n // eng.model.page
            for u, plist in pages.items():
                self.report.bytes_precopied += self._copy_pages(sid, u, plist)
                self.dirty[(sid, u)] = set(plist[full:])
                # the target's page list for the full pages, ready before the pause (pages are only appended)
                self.prefix[(sid, u)] = [self.new_pages[(sid, u)][p] for p in plist[:full]]

    def _copy_pages(self, sid, unit, src_pages, again=()):
        """Copy pages of one layer to the target pool (those not copied yet, and `again`), coalescing runs that
        are contiguous on both sides."""
        eng, st = self.eng, self.staged[unit]
        mapping = self.new_pages.setdefault((sid, unit), {})
        todo = [p for p in src_pages if p not in mapping or p in again]
        for p in todo:
            if p not in mapping:  # a page copied again (the tail, dirty since the pre-copy) goes where it went
                mapping[p] = st["pool"].alloc()
        page_bytes = eng.model.page_bytes()
        src_kv, moved, i = eng.units[unit].kv, 0, 0
        while i < len(todo):
            j = i + 1
            while j < len(todo) and todo[j] == todo[j - 1] + 1 and mapping[todo[j]] == mapping[todo[j - 1]] + 1:
                j += 1
            nbytes = (j - i) * page_bytes
            for part in ("k", "v"):
                faults.check("transfer", self.target, nbytes)
                mech = registry.copy(src_kv[part], todo[i] * page_bytes, st["kv"][part],
                                     mapping[todo[i]] * page_bytes, nbytes)
                self.report.paths[f"kv {eng.units[unit].device}->{self.target}"] = mech
                moved += nbytes
            i = j
        return moved

    # -- 4: at a step boundary, copy the rest and switch
    def _pause_and_switch(self):
        eng, r = self.eng, self.report
        with eng._lock:
            t = time.perf_counter()
            if eng._layout() != {**self.layout, **{u: (eng.units[u].device, eng.units[u].residency)
                                                   for u in self.moving}}:
                # another migration changed the placement since we compiled: bind again (rare, in the pause)
                self.layout = {**eng._layout(), **{u: (self.target, "resident") for u in self.moving}}
                self.programs = self._target_programs()
            for seq in eng.sequences.values():
                for u in self.staged:
                    again = self.dirty.get((seq.id, u), ())
                    live = [p for p in seq.pages.get(u, []) if p is not None]
                    r.bytes_in_pause += self._copy_pages(seq.id, u, live, again)
            live = {seq.id for seq in eng.sequences.values()}
            for (sid, u), mapping in self.new_pages.items():  # sequences gone (or resumed anew) since the pre-copy
                if sid not in live:
                    self.staged[u]["pool"].free(list(mapping.values()))
            old = {u: (eng.units[u].device, eng.units[u].kv, eng.units[u].residency) for u in self.moving}
            for u in self.moving:  # the switch: nothing below can fail
                st = eng.units[u]
                st.device, st.residency = self.target, "resident"
                if u in self.staged:
                    st.kv, st.pool, st.tables_for = self.staged[u]["kv"], self.staged[u]["pool"], {}
                    for seq in eng.sequences.values():
                        if u in seq.pages:
                            head = self.prefix.get((seq.id, u), [])
                            moved = self.new_pages[(seq.id, u)]
                            seq.pages[u] = head + [None if p is None else moved[p] for p in seq.pages[u][len(head):]]
            eng.segments = self.programs
            r.pause_ms = (time.perf_counter() - t) * 1e3
        # 5: free the source, after the pause (no step can use it any more)
        with eng._lock:
            for u, (dev, kv, residency) in old.items():
                if residency != "streamed":  # a streamed unit owns no weights on its device
                    eng._drop_weights(u, dev)
                if kv:
                    eng._free_kv(dev, kv)
            eng._release_unused_states()

    def _rollback(self):
        eng = self.eng
        for u in self.weights_done:
            eng._drop_weights(u, self.target)
        for s in self.staged.values():
            eng._free_kv(self.target, s["kv"])
        if self.new_state:
            eng._release_unused_states()
