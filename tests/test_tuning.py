"""Lowering options tuned by measurement (jitllm_core.tuning): the CPU's prefetch of streamed weights; and what the
CPU lowering emits for a decode matvec's streamed weights (a prefetch per line, each input broadcast used at once;
on a VNNI CPU, compiled from any x86 host, each product in one instruction and no spills); and the attention's
loops (each key or value vector widened once for all the heads that share it); and the memory that weights stream
from (huge pages)."""
import collections
import mmap
import re

import llvmlite.binding as llvm
import numpy as np
import pytest

from jitllm_core import ir, ops, planner, quant, tuning
from jitllm_core.plugin import Launch
from backend_check import run_on_device

lower = pytest.importorskip("jitllm_cpu_llvm.lower", reason="the CPU backend plugin is not installed")
runtime = pytest.importorskip("jitllm_cpu_llvm.runtime", reason="the CPU backend plugin is not installed")
assembly = pytest.importorskip("jitllm_cpu_llvm.assembly", reason="the CPU backend plugin is not installed")

ROWS, COLS = 576, 1536  # a 553 KB R4 matrix: large enough to be prefetched (lower.PREFETCH_MIN)


def matvec(rows=ROWS, cols=COLS):
    return ops.matmul(quant.PACKED["R4"], rows, cols, 4)


def module(k, prefetch=(), width=None, isa=None, optimized=False):
    """The module of kernel k alone with its support for these prefetch distances (for this CPU's vector width and
    instructions unless given), before LLVM's passes or after them."""
    mod = assembly.module(k, width or runtime.simd_width(), runtime.isa() if isa is None else frozenset(isa),
                          {"prefetch": prefetch})
    if optimized:
        runtime.optimize(mod)
    return mod


def module_text(k, prefetch=(), width=None, isa=None, optimized=False):
    return str(module(k, prefetch, width, isa, optimized))


def vnni_decode_loop(name):
    """(layout, its 2048 x 8192 decode matvec's innermost loop) compiled for an Ice Lake server (VNNI, GFNI), as a
    decode step's program compiles it: streamed, so prefetched; tuned, so without the machine scheduler
    (runtime.machine_scheduled)."""
    fmt = quant.packed_format(quant.get_format(name, 8192), 2048)
    return fmt, assembly.product_loop(assembly.assembly(ops.matmul(fmt, 2048, 8192, 1), "icelake-server", False))


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JITLLM_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_matvecs_are_tagged_by_layout_and_measured_as_one_token():
    k = matvec()
    assert k.tune_tag == "matvec_R4" and k.tune_scalars == {"n_tokens": 1, "t0": 0}
    assert ops.matmul(quant.PACKED["R4K"], 16, 256, 4).tune_tag == "matvec_R4K"


def test_cpu_tuning_picks_a_candidate_per_tag_and_caches_it(cpu, fresh_cache, monkeypatch):
    k, probed, probe = matvec(), [], tuning._Probe.__init__

    def spy(self, dev, kernel, variants):
        probed.append(kernel)
        probe(self, dev, kernel, variants)
    monkeypatch.setattr(tuning._Probe, "__init__", spy)
    # a step of 128 tokens: the 16-row kernel's input and digits outweigh k's whole, its weights do not
    tuning.tune(cpu, [ops.matmul(quant.PACKED["R4"], 16, COLS, 128), k])
    assert probed == [k]  # the tag's kernel with the most weights speaks for it
    assert cpu.tuned["matvec_R4"]["prefetch"] in cpu.tunables["prefetch"]
    assert len(list((fresh_cache / "measure").glob("*.json"))) == 1
    chosen = cpu.tuned.pop("matvec_R4")

    tuning.tune(cpu, [k])
    assert probed == [k] and cpu.tuned["matvec_R4"] == chosen  # recorded: not measured again
    monkeypatch.setattr(cpu, "lowering", "a newer lowering")  # what was measured with other code is not reused
    tuning.tune(cpu, [k])
    assert probed == [k, k]
    monkeypatch.setattr(cpu, "lowering", runtime.LOWERING)
    for i, candidate in enumerate(cpu.tunables["prefetch"]):  # forced (benchmarks/ab_decode.py): whatever was measured
        monkeypatch.setattr(tuning, "FORCED", {"prefetch": i})
        tuning.tune(cpu, [k])
        assert cpu.tuned["matvec_R4"] == {"prefetch": candidate}
    cpu.tuned.pop("matvec_R4")


def test_a_candidate_replaces_the_default_only_when_clearly_faster():
    """Within the noise of the default (MARGIN), the default stands; past it, the fastest candidate."""
    assert tuning.MARGIN > 0.01 and tuning.choose([1.0, 0.99, 1.2]) == 0
    assert tuning.choose([1.0, 1.2, 1.0 - 2 * tuning.MARGIN]) == 2
    assert tuning.choose([1.0, 0.5, 0.4]) == 2 and tuning.choose([1.0, 1.1]) == 0


def test_tuning_streams_the_weights_not_a_larger_input(cpu):
    """A matvec's input digits, sized for a step's tokens, can outweigh its weights; the copies the measurement
    rotates past the caches are of the weights, which a step streams, not of the input it reads a token's worth of."""
    k = ops.matmul(quant.PACKED["R4"], 576, COLS, 128)
    assert k.buffers["xq"].size > k.buffers["w"].size
    probe = tuning._Probe(cpu, k, [{"prefetch": ()}])
    try:
        copies = collections.Counter(p for p, _ in probe.bufs)
        assert copies["w"] > 1 and copies["xq"] == 1
    finally:
        probe.free()


def test_largest_cache_is_read_from_what_linux_says(tmp_path):
    """Each cache's size as sysfs writes it (K, M or G), the largest taken; what does not parse is passed over."""
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "480M"), ("index4", "n/a")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert runtime.largest_cache(tmp_path) == 480 << 20
    assert runtime.largest_cache(tmp_path / "none") == 0


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no madvise(MADV_HUGEPAGE) here")
def test_a_large_buffer_starts_on_a_huge_page_and_asks_for_huge_pages(cpu):
    """A buffer of a huge page or more starts on a huge page's boundary, reads as zeros, and its mapping carries
    the kernel's huge page advice (VmFlags "hg"); a small one is only aligned for vectors."""
    from jitllm_cpu_llvm.runtime import HUGE_PAGE
    big, small = cpu.alloc(3 * HUGE_PAGE + 4096), cpu.alloc(4096)
    try:
        assert big.addr % HUGE_PAGE == 0 and small.addr % 64 == 0
        assert not big.host_view().any()
        flags, inside = None, False
        for line in open("/proc/self/smaps"):
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo <= big.addr < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
        assert flags is not None and "hg" in flags
    finally:
        cpu.free(big), cpu.free(small)


def test_tuning_copies_exceed_the_largest_cache(cpu, monkeypatch):
    """Where the CPU's largest cache could hold ROTATION_BYTES of copies (a Xeon's L3, said to be 480 MB), they
    exceed it CACHE_MULTIPLE times: read from its L3 the candidates tied, from memory they ranked as in decode. A
    matrix so small that it would take more than MAX_COPIES copies takes that many."""
    assert cpu.cache_bytes == runtime.largest_cache() >= 0
    monkeypatch.setattr(cpu, "cache_bytes", 2 * tuning.ROTATION_BYTES)
    for k, tiny in ((matvec(), False), (matvec(16, 256), True)):  # 553 KB; 2.5 KB
        probe = tuning._Probe(cpu, k, [{"prefetch": ()}])
        try:
            weights = [b.nbytes for p, b in probe.bufs if p == "w"]
            if tiny:
                assert len(weights) == tuning.MAX_COPIES
            else:
                assert sum(weights) > tuning.CACHE_MULTIPLE * cpu.cache_bytes - weights[0]
        finally:
            probe.free()


def test_tuning_measures_within_its_budget_but_never_fewer_than_min_rounds(cpu, monkeypatch):
    """Where runs are slow the measurement stops once BUDGET_S has passed, each candidate having run MIN_ROUNDS
    times; where they are fast all ROUNDS fit."""
    probe = tuning._Probe(cpu, matvec(), [{"prefetch": ()}, {"prefetch": cpu.tunables["prefetch"][0]}])
    runs, timed = [], tuning.seconds
    monkeypatch.setattr(tuning, "seconds", lambda fn: runs.append(fn) or timed(fn))
    try:
        for budget, rounds in ((0.0, tuning.MIN_ROUNDS), (1e9, tuning.ROUNDS)):
            monkeypatch.setattr(tuning, "BUDGET_S", budget)
            runs.clear()
            probe.fastest()
            assert len(runs) == 2 * rounds
    finally:
        probe.free()


def test_tuning_without_room_keeps_the_defaults_uncached(fresh_cache):
    dev = runtime.CpuDevice("cpu:small", 1, 4 << 20)  # 4 MB: no room for the rotated copies
    tuning.tune(dev, [matvec()])
    assert dev.tuned["matvec_R4"] == {"prefetch": dev.tunables["prefetch"][0]} == {"prefetch": lower.PREFETCH_DEEP}
    assert not list((fresh_cache / "measure").glob("*.json"))


def matvec_inputs():
    """Random buffers for matvec(): Q4_1 weights with small finite scales, its input as quantize_input writes it."""
    rng = np.random.default_rng(3)
    fmt, raw = quant.get_format("Q4_1", COLS), rng.integers(0, 256, (ROWS * COLS // 32, 20)).astype(np.uint8)
    raw[:, 0:4] = (rng.standard_normal((len(raw), 2)) * 0.01).astype(np.float16).view(np.uint8)
    return {"w": quant.repack(fmt, raw.reshape(-1), ROWS), "x": rng.standard_normal(4 * COLS).astype(np.float32),
            "xq": rng.integers(0, 256, 4 * quant.DIGITS * COLS).astype(np.uint8),
            "xd": np.full(4 * COLS // 32, 1e-3, np.float32),
            "xs": rng.standard_normal(4 * COLS // 16).astype(np.float32), "y": np.zeros(4 * ROWS, np.float32)}


def outputs_tuned(cpu, k, options):
    """k's output on the CPU for each of its tag's lowering options (None: not tuned)."""
    outs = []
    for o in options:
        if o is not None:
            cpu.tune(k.tune_tag, o)
        try:
            outs.append(run_on_device(cpu, k, matvec_inputs(), {"n_tokens": 4, "t0": 0})["y"])
        finally:
            cpu.tuned.pop(k.tune_tag, None)
    assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
    return outs


def test_prefetch_options_change_the_code_not_the_results(cpu):
    k = matvec()
    for prefetch in cpu.tunables["prefetch"]:
        assert ("call void @llvm.prefetch" in module_text(k, prefetch, optimized=True)) == bool(prefetch)
    outs = outputs_tuned(cpu, k, [{"prefetch": p} for p in cpu.tunables["prefetch"]])
    for out in outs[1:]:
        np.testing.assert_array_equal(outs[0], out)


def test_a_kernels_variants_are_one_lowering_compiled_apart(cpu, fresh_cache, monkeypatch):
    """The tuner's variants of a kernel differ only in their support (lower.support_ir): the kernel is lowered
    once for all of them, and each is compiled into code of its own."""
    k, lowered, lower_kernel = matvec(ROWS, COLS + 256), [], lower.kernel_module  # a shape no other test compiles
    monkeypatch.setattr(lower, "kernel_module", lambda *a, **kw: lowered.append(a[1]) or lower_kernel(*a, **kw))
    codes = []
    try:
        for prefetch in cpu.tunables["prefetch"]:
            cpu.tune(k.tune_tag, {"prefetch": prefetch})
            codes.append(cpu.kernel_code(k))
    finally:
        cpu.tuned.pop(k.tune_tag, None)
    assert len(lowered) == 1
    assert len({c.path for c in codes}) == len(codes) and all(c.wait() for c in codes)


@pytest.mark.parametrize("target", [None, "icelake-server"], ids=["this CPU", "VNNI"])
def test_machine_scheduler_left_out_only_for_streaming_kernels(cpu, target):
    """LLVM's machine scheduler orders a kernel's whole module: a matvec tuned for streaming goes without it, with
    VNNI or without; a kernel never tuned (a prefill gemm, a norm) or an untuned matvec keeps it; the code differs,
    the results do not."""
    dev = cpu if target is None else assembly.device(target)
    k, gemm, norm = matvec(), ops.prefill_matmul(quant.PACKED["R4"], 64, COLS, 8), ops.rmsnorm(COLS, 4, 1e-5)
    assert gemm.tune_tag and not norm.tune_tag
    scheduled = lambda kernel: runtime.machine_scheduled(dev, kernel)
    try:
        dev.tune(k.tune_tag, {"prefetch": lower.PREFETCH})
        assert not scheduled(k) and scheduled(gemm) and scheduled(norm)
        if target is None:  # and a program's kernel is compiled so
            bufs = {p: cpu.alloc(b.size * ir.STORAGE_DTYPES[b.dtype]) for p, b in k.buffers.items()}
            assert not cpu.program([Launch(k, bufs)]).kernel_code[k.key()].schedule
            for b in bufs.values():
                cpu.free(b)
    finally:
        dev.tuned.pop(k.tune_tag)
    assert scheduled(k)
    assert target or assembly.assembly(k, schedule=False) != assembly.assembly(k)
    if target is None:  # tuned: without the scheduler; not tuned: with it
        outs = outputs_tuned(cpu, k, [{"prefetch": lower.PREFETCH}, None])
        np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("rows, cols", [(ROWS, COLS), (192, 576)], ids=["553KB", "69KB"])
@pytest.mark.parametrize("width, isa", [(8, {"avx2"}), (16, {"avx512bw", "avx2"})])
def test_prefetch_once_per_line_of_streamed_weights(width, isa, rows, cols):
    """An R4 block of 16 rows is 5 lines (the scales' words, then 4 words of nibbles, 64 bytes each): its
    iteration prefetches each once, whether the 16 rows take one vector of lanes or two (AVX2: each reads half
    of every line) and though its words are read in an unrolled loop, and nothing else (not the input's digits).
    A small matrix too: a decode step reads every matrix from DRAM, the default model's 69 KB key projection
    (192 x 576) as well. Each distance's prefetches go where it says (the default's far one non-temporal), once
    the support's prefetches (lower.support_ir) are inlined."""
    k, lines = matvec(rows, cols), quant.PACKED["R4"].unit * quant.ROWS // 64
    assert module_text(k, width=width, isa=isa).count(f"call void @{lower.PREFETCH_AHEAD}(") == lines
    for distances in (lower.PREFETCH, lower.PREFETCH_L2, lower.PREFETCH_DEEP):
        text = module_text(k, distances, width, isa, optimized=True)
        assert text.count("call void @llvm.prefetch.p0(") == lines * len(distances)
        calls = re.findall(r'llvm\.prefetch\.p0\(ptr [^,]+, i32 0, i32 (\d), i32 1\)', text)
        localities = collections.Counter(int(n) for n in calls)
        assert localities == collections.Counter(locality for _, locality in distances for _ in range(lines))


def selected_constants(text):
    """The i32 constants lowered code selects (a claimed chunk's least size among them: select(chunk < least,
    least, chunk); a share's whole extent on one thread, and 1, the least of any chunk, too)."""
    return {int(n) for n in re.findall(r'select\s+i1 %"?[\w.]+"?, i32 (\d+), i32 %', text)}


def test_claimed_chunks_stream_at_least_claim_bytes_of_weights(monkeypatch):
    """Each chunk a thread claims of a parallel loop starts a new stream, whose first lines wait on DRAM: a decode
    matvec's chunks hold at least CLAIM_BYTES of its weights -- SmolLM2's 1536 x 576 projection, 96 row groups of
    5,760 bytes, at least 23 of them a chunk (4 chunks a thread of two would be 6) -- and 1 row group where none
    is asked. Its weights, not a larger input: the 576 x 1536 one's input digits for a step of 128 tokens (590
    KB) outweigh its weights (553 KB), and its chunks are 9 of its 36 row groups, not 8."""
    k = ops.matmul(quant.PACKED["R4"], 1536, 576, 1)
    least = -(-lower.CLAIM_BYTES // quant.PACKED["R4"].nbytes(quant.ROWS, 576))
    assert least == 23 and selected_constants(module_text(k)) == {96, 23, 1}
    wide = ops.matmul(quant.PACKED["R4"], 576, 1536, 128)
    assert wide.buffers["xq"].size > wide.buffers["w"].size
    assert selected_constants(module_text(wide)) == {36, 9, 1}
    monkeypatch.setattr(lower, "CLAIM_BYTES", 0)
    assert selected_constants(module_text(k)) == {96, 1}


def broadcast_use_spans(text):
    """For each value broadcast to all lanes (a splat: a shufflevector by zeros, with the casts of it) that two
    instructions use, how many instructions apart they are."""
    lines, root, uses = text.splitlines(), {}, {}
    for ln in lines:
        splat = re.match(r"\s*(%\S+) = shufflevector .*, <\d+ x i32> zeroinitializer$", ln)
        cast = re.match(r"\s*(%\S+) = bitcast <[^>]+> (%\S+) to", ln)
        if splat:
            root[splat.group(1)] = splat.group(1)
        elif cast and cast.group(2) in root:
            root[cast.group(1)] = root[cast.group(2)]
    for i, ln in enumerate(lines):
        if " = bitcast " not in ln:
            for name in set(re.findall(r"%[\w.]+", ln.split(" = ", 1)[-1])) & root.keys():
                uses.setdefault(root[name], []).append(i)
    return [u[1] - u[0] for u in uses.values() if len(u) == 2]


@pytest.mark.parametrize("layout, words", [("R6", 48), ("R8", 32)])
def test_each_input_broadcast_feeds_both_vectors_of_lanes_at_once(layout, words):
    """With 8 lanes (AVX2: 16 registers, two vectors to a row group) a block's input words or elements, broadcast,
    are each used by both vectors of lanes within a few instructions: R6's sums per digit of the input (4 dot4s
    each, written out) and R8's unrolled f32 sum are computed for both vectors in turn (lower.joint_dot4_sums,
    unrolled_reduces). The first vector's whole block first kept all of them live until the second vector's (a
    quarter of an R6 block: 48 input words; an R8 block: 32 elements), spilled to the stack."""
    k = ops.matmul(quant.PACKED[layout], 64, 512, 1)
    mod = module(k, (), 8, {"avx2"})
    # the vectors' loads of one input word merged into one broadcast, by the passes an AVX2 CPU's program gets (an
    # AVX-512 host's passes write it as a shuffle of the word's bytes, which broadcast_use_spans does not follow)
    runtime.optimize(mod, runtime.target_machine("znver3"))
    spans = broadcast_use_spans(str(mod))
    assert len(spans) >= words and max(spans) <= 64, sorted(spans)


@pytest.mark.parametrize("layout", ["R4XS", "R4NL"])
@pytest.mark.parametrize("width, isa", [(8, {"avx2"}), (16, {"avx512bw", "avx2"})], ids=["avx2", "avx512-no-vnni"])
def test_codes_looked_up_above_127_dot_in_pmaddubsw_without_vnni(layout, width, isa):
    """IQ4's codes are looked up as levels + 128, bytes up to 255, whose pmaddubsw pair sums with signed digits
    would overflow an i16: without VNNI their dot4s take two pmaddubsw (the bytes' low nibbles, their high ones),
    not bytes widened to i32 and multiplied (2048 x 8192 at 0.4 G weights/s on a Zen 1, 10x under R4K's)."""
    text = module_text(ops.matmul(quant.PACKED[layout], 64, 512, 1), (), width, isa)
    assert re.search(r"pmadd\.ub\.sw|pmaddubs\.w\.512", text)
    assert not re.findall(r"= mul <\d+ x i32>", text)


@pytest.mark.skipif(not llvm.get_process_triple().startswith("x86_64"), reason="compiles for an x86 CPU")
@pytest.mark.parametrize("cpu_name", ["znver3", "icelake-server"])
def test_multiply_add_meter_keeps_its_sums_in_registers(cpu_name):
    """The multiply-add peak is measured with as many sums as the prefill tile's (AVX2: 6 chains of 2 vectors;
    AVX-512: 16 of 1), all in registers: 16 chains on AVX2 spilled, and its peak read half the machine's."""
    k = planner.multiply_add_meter(assembly.device(cpu_name))
    loop = next(b for b in assembly.loops(assembly.assembly(k, cpu_name)) if any("vfmadd" in x for x in b))
    assert assembly.spill_stores(loop) == 0
    assert sum(x.startswith("vfmadd") for x in loop) % (12 if cpu_name == "znver3" else 16) == 0


def test_tuning_without_measuring_gives_the_defaults_unrecorded(cpu, fresh_cache, monkeypatch):
    def measured(*a):
        raise AssertionError("measured although told not to")
    monkeypatch.setattr(tuning._Probe, "__init__", measured)
    tuning.tune(cpu, [matvec()], measure=False)
    assert cpu.tuned.pop("matvec_R4") == {"prefetch": lower.PREFETCH_DEEP}
    assert not list((fresh_cache / "measure").glob("*.json"))


@pytest.mark.skipif(not llvm.get_process_triple().startswith("x86_64"), reason="compiles for an x86 CPU")
@pytest.mark.parametrize("name", ["Q4_1", "Q4_K", "Q6_K"])
def test_vnni_decode_loops_take_each_digit_product_once_in_registers(name):
    """On an AVX-512 VNNI CPU (the kind the CPU targets are set on; compiled here for an Ice Lake server, not run) a
    dot4 layout's decode loop makes the products of each weight with each input digit in one `vpdpbusd` apiece
    (16 lanes of 4: 64 a instruction), none by the AVX2 fallback, and keeps its values in registers: a change made
    for AVX2 must not cost the machines the targets were met on."""
    fmt, body = vnni_decode_loop(name)
    mnemonics = [x.split()[0] for x in body]
    weights = fmt.block * quant.ROWS // fmt.pieces
    assert mnemonics.count("vpdpbusd") == quant.DIGITS * weights // 64
    assert "vpmaddubsw" not in mnemonics and "vpmaddwd" not in mnemonics
    assert assembly.spill_stores(body) == 0, body


@pytest.mark.skipif(not llvm.get_process_triple().startswith("x86_64"), reason="compiles for an x86 CPU")
def test_high_nibbles_take_one_instruction_where_the_cpu_has_gfni():
    """A nibble word's high nibbles, (q >> 4) & 0x0F0F0F0F, are its bytes shifted: one `vgf2p8affineqb` on a CPU
    with GFNI (an Ice Lake server's, compiled here) for the shift and mask's two (R4K's decode loop 591 -> 558
    instructions a block, the 1B shape's decode 14.46 -> 15.24 tok/s on one thread on an AMX Xeon)."""
    fmt, body = vnni_decode_loop("Q4_K")
    mnemonics = [x.split()[0] for x in body]
    words = fmt.block * quant.ROWS // 8 // 16  # nibble words a block of 16 rows, 16 to a vector
    assert mnemonics.count("vgf2p8affineqb") >= words and mnemonics.count("vpsrld") < words, mnemonics


@pytest.mark.skipif(not llvm.get_process_triple().startswith("x86_64"), reason="compiles for an x86 CPU")
def test_attention_widens_each_key_once_for_its_group_of_heads():
    """The 1B shape's attention (4 heads a KV head), compiled for an Ice Lake server: every loop that widens f16
    keys or values makes 4 multiply-adds a widened vector, one for each head that shares it -- each head's scores
    in a loop of their own widened every key once a head (1B prefill attention 1.5-2.3x slower)."""
    asm = assembly.assembly(ops.attention(32, 8, 64, 4, 16, 64, 64, "f16"), "icelake-server")
    widening = [collections.Counter(x.split()[0] for x in b) for b in assembly.loops(asm)]
    widening = [c for c in widening if c["vcvtph2ps"] and c["vfmadd231ps"] + c["vfmadd132ps"] + c["vfmadd213ps"]]
    assert widening and all(c["vfmadd231ps"] + c["vfmadd132ps"] + c["vfmadd213ps"] >= 4 * c["vcvtph2ps"]
                            for c in widening), widening


@pytest.mark.skipif(not llvm.get_process_triple().startswith("x86_64"), reason="compiles for an x86 CPU")
def test_attention_prefetches_its_kv_heads_pages_ahead_into_l2():
    """The paged attention's first query (a decode step's only one) prefetches, KV_AHEAD pages ahead, every cache
    line of its KV head's keys (64 dims x 16 positions of f16: 32 lines) and values (16 rows of 128 bytes: 2 lines
    each) into L2 -- pool pages lie anywhere, and decode at 3,000 positions ran its attention at 7 GB/s without."""
    asm = assembly.assembly(ops.attention(32, 8, 64, 4, 16, 64, 64, "f16"), "icelake-server")
    mnemonics = [x.split()[0] for b in asm.splitlines() for x in [b.strip()] if x and not x.startswith(".")]
    assert mnemonics.count("prefetcht1") == 32 + 16 * 2, collections.Counter(m for m in mnemonics if "prefetch" in m)


def test_a_module_makes_each_pure_instruction_once_a_block():
    """The lowering's builder makes an instruction with the same operands once a basic block (a 6-bit embedding
    row, every element's address and field spelled out by the IR, was 76,000 instructions, 29 % of them
    literal repeats): no block of the lowered module holds two arithmetic, cast or address instructions alike."""
    text = module_text(ops.embed(quant.PACKED["R6"], 256, 2048, 4))
    repeats, seen, made = [], set(), 0
    for line in text.splitlines():
        if re.match(r"^[\w.\"]+:", line):  # a basic block's label
            seen = set()
        m = re.match(r'\s+%"?[^"=]+"? = (.*)', line)
        if m and not m.group(1).startswith(("load", "call", "alloca", "phi", "atomicrmw")):
            repeats += [m.group(1)] if m.group(1) in seen else []
            seen.add(m.group(1))
            made += 1
    assert not repeats and made > 1000, (made, repeats[:5])
