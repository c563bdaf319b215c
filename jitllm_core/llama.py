"""Llama-family models and their relatives (Llama 2/3, SmolLM2/3, Granite, Mistral, Qwen2/3, Phi-3, Gemma 2/3) as
kernels: a model file's config and weights (`modelfile.ModelFile`) -> the launches of each unit.

Units: "embed", layers 0..n-1, "head" (final norm + LM head). A unit is a list of Launch templates: a kernel
and, per buffer parameter, the name of a weight ("w:blk.3.attn_q"), a per-device activation ("a:x"), or a
per-layer KV / page-table buffer ("kv:k"). The runtime binds names to buffers on the unit's device.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import ir, modelfile, ops, quant
from .architectures import experts_tensor
from .cache import cache_dir, digest, write_atomic
from .errors import ModelFileError
from .kvcache import SEQUENCES, window_pages
from .modelfile import ModelFile, SpecFile
from .quant import BLOCK_WORDS, ROWS, get_format, packed_format, repack, repack_kernel

# a packed file is as new as the code that wrote it: its layout's, and the loader's (which reorders some rows)
LAYOUTS = digest(*(Path(m.__file__).read_bytes() for m in (quant, modelfile)))


def rope_table(freqs: np.ndarray, positions: int, scale) -> np.ndarray:
    """cos and sin of every position's angle for each pair ([positions, pairs, 2] f32, `ops.rope`'s `rot`), times
    the pair's scale (YaRN's and LongRoPE's attention factor): the angle an f32 product, as the kernels computed it,
    its cosine and sine in f32 (within an ulp of f64's rounded; 131,072 positions of 64 pairs in 25 ms where f64
    took 630)."""
    ang = np.arange(positions, dtype=np.float32)[:, None] * np.asarray(freqs, np.float32)[None, :]
    scale = np.asarray(scale, np.float32)
    return np.stack([np.cos(ang) * scale, np.sin(ang) * scale], -1)


@dataclass
class LaunchTemplate:
    kernel: object
    buffers: dict          # param -> "w:<tensor>" | "a:<activation>" | "kv:k" | "kv:v" | "kv:ptab" | "c:<const>"
    scalars: dict = field(default_factory=dict)


# scalars of a launch that computes every token of the step, not only those from the step's t0 (the first whose
# output is wanted: the last of a prompt's last chunk, none of its other chunks', the first of a scored sequence)
EVERY_TOKEN = {"t0": "zero"}
# the widest matrix a prefill matmul launch takes whole. The 1B's 8,192-column down projections whole, against in
# chunks of 2,048 (benchmarks/ab_gemm.py, one thread): R4K 21.6 -> 19.5 ms at 128 tokens, 6.33 -> 5.46 at 32;
# the 1B's 32-token prompt 99.1 -> 103.2 tok/s, 256 tokens unchanged (ab_decode.py, alternated)
PREFILL_CHUNK_COLS = 8192
WIDE_THREADS = 1024
# tokens of a batched decode step (several sequences' tokens, `Engine._decode`) that a matmul multiplies by each
# weight it loads (`ops.matmul(tokens=...)`). The step is bound by the dots, not by unpacking weights: the 1B
# shape's step of 4 sequences on one thread 58.9 / 59.1 / 59.9 ms in tiles of 2 / 4 / 8, on two 33.1-33.7 / 35.0-35.9
# (of 8 sequences 59.3-62.6 / 65.5-69.5); its step of one, 24 ms
BATCH_TOKENS = 2


def interleaves(threads: int) -> bool:
    """The schedule for a device that runs `threads` parallel iterations at once (Caps.threads). Few, as a CPU's
    cores: weights row-interleaved, ROWS rows the SIMD lanes of one iteration, and prefill dequantizes blocks of
    rows to f32 for a register-tile matmul (`ops.prefill_matmul`). Many, as a GPU's thousands: the file's
    layouts, one row per iteration whose lanes split the row's blocks, and prefill runs that matmul for every
    token, the row coming back from cache -- ROWS rows per iteration would leave most of such a device idle
    (measured on an H200: 1-2 % of its bandwidth in decode)."""
    return threads < WIDE_THREADS


def _column_chunk(fmt, cols):
    """Columns of a matrix in layout fmt that a prefill matmul launch takes at a time (0: all): matrices wider than
    PREFILL_CHUNK_COLS (a larger model's FFN down projection) go in chunks of whole blocks, so that a chunk's input
    columns stay nearer while every row is multiplied by them."""
    if cols <= PREFILL_CHUNK_COLS:
        return 0
    return next((c for c in range(PREFILL_CHUNK_COLS // fmt.block * fmt.block, 0, -fmt.block) if cols % c == 0), 0)


def prefill_matmuls(fmt, rows, cols, T, accumulate=False, bias=False, tile=ops.GEMM_TILE, tile_dots=False):
    """A prefill matmul of weights in layout fmt as (kernel, {scalar: value}) per column chunk (`_column_chunk`),
    in launch order: the first adds the bias (and accumulates if the matmul does), the others add to what it
    wrote. tile_dots: integer tile matmuls (`ops.tile_matmul`) instead."""
    ccols = _column_chunk(fmt, cols)
    for c0 in range(0, cols, ccols or cols):
        acc, b = accumulate or c0 > 0, bias and c0 == 0
        yield (ops.tile_matmul(fmt, rows, cols, T, acc, b, ccols) if tile_dots else
               ops.prefill_matmul(fmt, rows, cols, T, acc, b, ccols, tile), {"col0": c0} if ccols else {})


class Llama:
    """Kernels and buffer bindings for every unit of one model at one step size."""

    def __init__(self, mf: ModelFile, T: int, page: int, n_pages: int, kv_dtype: str, digits=quant.DIGITS,
                 sequences=SEQUENCES, batch=None):
        """n_pages: KV pages of each layer's pool, which is also the longest page table (one sequence may use
        the whole pool); a sliding-window layer's pool holds `sequences` windows instead (`pool_pages`). batch:
        the most tokens a batched decode step takes (`unit_launches`): a token of each sequence decoding, and
        drafts (default: `sequences`)."""
        self.mf, self.cfg, self.T = mf, mf.config, T
        self.page, self.n_pages, self.kv_dtype, self.sequences = page, n_pages, kv_dtype, sequences
        self.batch = min(batch or sequences, T)
        self.positions = page * n_pages  # the longest sequence: its rope table's rows
        self.digits = digits  # of the dot4 layouts' inputs: quant.DIGITS (as accurate as f32) or quant.INT8
        cfg = self.cfg
        if cfg.n_head % cfg.n_kv or cfg.head_dim % 2:
            raise ModelFileError(mf.path, f"unsupported head layout ({cfg.n_head} heads, {cfg.n_kv} kv heads, "
                                          f"head size {cfg.head_dim})")
        self.units = ["embed"] + list(range(cfg.n_layer)) + ["head"]
        self.head_tensor = "output.weight" if "output.weight" in mf.tensors else "token_embd.weight"
        self._held = {}  # packed weights of streamed units (memory-mapped), read from host memory every step
        self.constants = {"zero": 0}  # scalar values the launches name, the same at every step

    # -- sizes of the per-device activations
    def activations(self, tile_dots=False):
        """{name: (dtype, elements)}; tile_dots: with the inputs and scratch of integer tile matmuls (`_tile_matmul`),
        which a device of matrix instructions takes (`Caps.tile_dots`)."""
        c, T = self.cfg, self.T
        q, kv, ffn = c.n_head * c.head_dim, c.n_kv * c.head_dim, max(c.ffn, c.shared_ffn)
        inp = T * max(c.dim, q, ffn)  # the widest matmul input of a step
        # a mixture's: the router's logits, its choice and weights, and the experts' down projections' input as
        # the dot4 layouts read it (`_inputs(into="h")`: the MLP's input stays quantized for every slot's gate / up)
        moe = {"router": ("f32", T * c.experts), "sel": ("i32", T * c.experts_used),
               "wt": ("f32", T * c.experts_used), "hq": ("u8", T * ffn * self.digits),
               "hd": ("f32", T * ffn // 32), "hs": ("f32", T * ffn // 16)} if c.experts else {}
        return {**moe, "tok": ("i32", T), "tpos": ("i32", self.batch), "x": ("f32", T * c.dim),
                "xn": ("f32", T * c.dim), "q": ("f32", T * q),
                "k": ("f32", T * kv), "v": ("f32", T * kv), "att": ("f32", T * q), "g": ("f32", T * ffn),
                "u": ("f32", T * ffn), "h": ("f32", T * ffn), "logits": ("f32", T * c.vocab),
                # an output before it joins x, normed or scaled
                **({"y": ("f32", T * c.dim)} if c.sandwich or c.residual_scale != 1.0 or c.experts else {}),
                "scores": ("f32", T * c.n_head * self.n_pages * self.page),
                # the prefill matmuls' scratch: blocks of a layer matrix, dequantized (a column chunk's are no wider)
                "wdq": ("f32", max((ops.prefill_scratch(self.fmt(name, shape), *shape, T)
                                    for name, (shape, as_f32) in self.weight_shapes(0).items()
                                    if not as_f32 and shape[0] % ROWS == 0), default=1)),
                # a matmul's input as the dot4 layouts read it (ops.quantize_input)
                "xq": ("u8", inp * self.digits), "xd": ("f32", inp // 32), "xs": ("f32", inp // 16),
                **(self._tile_activations(inp // T) if tile_dots else {})}

    def _tile_activations(self, cols):
        """The integer tile matmuls' input, quantized in spans of ops.TILE_SPAN for `cols` columns at most, and their
        scratch: each layer matrix's (`ops.tile_scratch`), the largest."""
        Tp = ops.tile_tokens(self.T)
        words, scales = zip(*[ops.tile_scratch(shape[0], min(shape[1], PREFILL_CHUNK_COLS))
                              for shape, as_f32 in self.weight_shapes(0).values()
                              if not as_f32 and shape[0] % ROWS == 0 and shape[1] % ops.TILE_SPAN == 0] or [(1, 1)])
        return {"xt": ("u8", Tp * quant.DIGITS * cols), "xtd": ("f32", Tp * cols // ops.TILE_SPAN),
                "xts": ("f32", Tp * cols // 32), "wt": ("i32", max(words)), "wts": ("f32", max(scales))}

    def activation_bytes(self, tile_dots=False):
        """What a device that runs a unit holds besides the units: activations (`activations(tile_dots)`),
        constants (the rope tables), a margin."""
        rope = self.positions * self.cfg.head_dim * 4 * len(self.ropes())  # rope_table's cos and sin, f32
        return sum(size * ir.STORAGE_DTYPES[dt] for dt, size in self.activations(tile_dots).values()) + rope + (1 << 20)

    def ropes(self):
        """The frequencies and scales (`ModelFile.rope`) of the constants the rope launches read ("c:<name>"):
        every layer's, and the sliding-window layers' own where their base differs (Gemma 3's)."""
        local = {"rope_local": self.mf.rope(self.positions, local=True)} if self.cfg.local_rope_base else {}
        return {"rope": self.mf.rope(self.positions), **local}

    def constants_data(self):
        """The constants themselves: each position's cosines and sines (`rope_table`)."""
        return {name: rope_table(freqs, self.positions, scale) for name, (freqs, scale) in self.ropes().items()}

    def weight_shapes(self, unit):
        """tensor name -> (shape, True if read as f32 constant data rather than by a matmul)"""
        c = self.cfg
        if unit == "embed":
            return {"token_embd.weight": ((c.vocab, c.dim), False)}
        if unit == "head":
            return {"output_norm.weight": ((c.dim,), True), self.head_tensor: ((c.vocab, c.dim), False)}
        p, q, kv = f"blk.{unit}.", c.n_head * c.head_dim, c.n_kv * c.head_dim
        e, mlp = (c.experts, "_exps") if c.experts else (1, "")  # a mixture's: the experts' matrices stacked
        w = {p + "attn_q.weight": ((q, c.dim), False),
             p + "attn_k.weight": ((kv, c.dim), False), p + "attn_v.weight": ((kv, c.dim), False),
             p + "attn_output.weight": ((c.dim, q), False),
             p + f"ffn_gate{mlp}.weight": ((e * c.ffn, c.dim), False),
             p + f"ffn_up{mlp}.weight": ((e * c.ffn, c.dim), False),
             p + f"ffn_down{mlp}.weight": ((e * c.dim, c.ffn), False)}
        if c.experts:
            w[p + "ffn_gate_inp.weight"] = ((c.experts, c.dim), False)  # the router
        if c.shared_ffn:  # a shared expert, and its gate's weights
            w.update({p + "ffn_gate_shexp.weight": ((c.shared_ffn, c.dim), False),
                      p + "ffn_up_shexp.weight": ((c.shared_ffn, c.dim), False),
                      p + "ffn_down_shexp.weight": ((c.dim, c.shared_ffn), False),
                      p + "ffn_gate_inp_shexp.weight": ((c.dim,), True)})
        if c.pre_norm:
            w.update({p + n: ((c.dim,), True) for n in ("attn_norm.weight", "ffn_norm.weight")})
        if c.bias:
            w.update({p + "attn_q.bias": ((q,), True), p + "attn_k.bias": ((kv,), True),
                      p + "attn_v.bias": ((kv,), True)})
        if c.qk_norm:
            whole = c.qk_norm == "whole"
            w.update({p + "attn_q_norm.weight": ((q if whole else c.head_dim,), True),
                      p + "attn_k_norm.weight": ((kv if whole else c.head_dim,), True)})
        if c.sandwich:
            w.update({p + n: ((c.dim,), True) for n in ("post_attention_norm.weight", "post_ffw_norm.weight")})
        return w

    def host_data(self, name, unit, keep=False, interleave=True, out=None):
        """A weight's bytes as a device holds it: f32 for norms and biases; quantized tensors in the layout
        self.fmt names (quant.repack, one tensor at a time; a view of the mapped file where it is the file's).
        keep: the result is read again later (a streamed unit's weights are copied from host memory every step),
        so it is a memory-mapped file in the cache rather than a copy in memory. out: uint8 bytes (a device
        buffer's host view) that a repacked tensor is written into, and returned, instead of new memory."""
        shape, as_f32 = self.weight_shapes(unit)[name]
        if as_f32 and name == "output_norm.weight" and self.cfg.logit_scale != 1.0:
            # Granite's logits divided by its logits_scaling: the final norm's weight divided instead (logits are
            # linear in it)
            return self.mf.f32(name, shape) / np.float32(self.cfg.logit_scale)
        if as_f32:
            return self.mf.f32(name, shape)
        fmt, raw = self._file_format(name, shape), self.mf.tensor(name, shape).raw()
        packed = self.fmt(name, shape, interleave)
        if packed is fmt:
            return raw
        if not keep:
            return repack(fmt, raw, shape[0], out)
        if packed.name not in self._held.get(name, {}):
            st = os.stat(self.mf.path)
            key = digest(os.path.abspath(self.mf.path), st.st_size, st.st_mtime_ns, name, packed.name, LAYOUTS)
            path = cache_dir("packed") / f"{key}.bin"
            if not path.exists():
                write_atomic(path, repack(fmt, raw, shape[0]).tobytes())
            self._held.setdefault(name, {})[packed.name] = np.memmap(path, np.uint8, mode="r")
        return self._held[name][packed.name]

    def repacking(self, name, unit, interleave=True):
        """(the IR kernel that repacks the weight on a device, the file's bytes of it) where its layout's words are
        written once for NumPy and the IR (`quant.BLOCK_WORDS`); else None (`host_data` gives its bytes)."""
        shape, as_f32 = self.weight_shapes(unit)[name]
        if as_f32:
            return None
        fmt = self._file_format(name, shape)
        if fmt.name not in BLOCK_WORDS or self.fmt(name, shape, interleave) is fmt:
            return None
        return repack_kernel(fmt, shape[0], shape[-1]), self.mf.tensor(name, shape).raw()

    def tensor_bytes(self, name, unit, interleave=True):
        """Bytes of a weight as a device holds it (norms and biases become f32)."""
        shape, as_f32 = self.weight_shapes(unit)[name]
        return int(math.prod(shape)) * 4 if as_f32 else self.fmt(name, shape, interleave).nbytes(*shape)

    @functools.lru_cache(maxsize=None)
    def unit_bytes(self, unit, interleave=True):
        """A unit's weight bytes; the interleaved layouts' are the larger, so the default is what plans use."""
        return sum(self.tensor_bytes(t, unit, interleave) for t in self.weight_shapes(unit))

    @functools.lru_cache(maxsize=None)  # read at every step (the engine's counters)
    def step_bytes(self, unit, interleave=True, tokens=1):
        """The weight bytes a decode step of `tokens` sequences (a batched one: `Engine._step_batch`) reads of a
        unit: a mixture's experts, the share its tokens use -- a batch's the most they can (tokens that share an
        expert read it once: the figure is then above what was read; the router's choice stays on the device)."""
        c = self.cfg
        share = lambda t: min(1, tokens * c.experts_used / c.experts) if experts_tensor(t) else 1
        return round(sum(self.tensor_bytes(t, unit, interleave) * share(t) for t in self.weight_shapes(unit)))

    def _file_format(self, name, shape):
        t = self.mf.tensor(name, shape)
        return get_format(t.type_name, shape[-1], f"{self.mf.path}: tensor {name!r}")

    def fmt(self, name, shape, interleave=True):
        """The layout kernels read the tensor in: its file format's packed form (interleave, see `interleaves`),
        else the file format."""
        fmt = self._file_format(name, shape)
        rows = shape[0] // self.cfg.experts if experts_tensor(name) else shape[0]  # an expert's groups
        return packed_format(fmt, rows) if interleave else fmt

    def _prefill_matmul(self, fmt, rows, prefill, interleave):
        """Whether a matmul of `rows` rows of weights in layout fmt goes through the prefill matmul (weights
        dequantized to f32 once per step, `ops.prefill_matmul`): in a prefill step on an interleaving device (a
        GPU's prefill runs the decode matmul for every token instead), for rows in whole groups of ROWS (its
        vectors), unless the dot4 layouts' int8 inputs make the decode matmul the faster one."""
        return prefill and interleave and rows % ROWS == 0 and not (fmt.digits and self.digits == quant.INT8)

    def _tile_matmul(self, fmt, rows, cols, prefill, interleave, tile_dots):
        """Whether a matmul goes through the integer tile matmul (`ops.tile_matmul`) instead of the prefill one: on a
        device of matrix instructions (tile_dots), for the formats of that form, in the exact mode."""
        return tile_dots and self._prefill_matmul(fmt, rows, prefill, interleave) and self.digits == quant.DIGITS \
            and ops.tile_dots_fit(fmt, rows, cols)

    def _mm(self, name, x, y, rows, cols, acc=False, bias=None, logits=False, prefill=False, interleave=True,
            tile=ops.GEMM_TILE, scalars=EVERY_TOKEN, slot=None, into="x", batch=False, tile_dots=False):
        """Matmul launches, for every token (`scalars` EVERY_TOKEN) or from the step's `t0` ({}: where only the
        wanted tokens' outputs are, the LM head's and the last layer's queries and after its attention). Through the
        prefill matmul (`_prefill_matmul`, its register tile `tile`), the weights are dequantized to f32 once
        and reused by every token of the step. slot: a mixture of experts' weights, each token's rows those of the
        expert the router chose for it in that slot (the decode matmul, token by token). into: the dot4 layouts'
        quantized input's buffers (`_inputs`). batch: a batched decode step's, each weight used for BATCH_TOKENS
        tokens at a time. tile_dots: the device runs integer tile matmuls (`_tile_matmul`)."""
        c = self.cfg
        fmt = self.fmt(name, (rows * (c.experts if slot is not None else 1), cols), interleave)
        bufs = {"y": f"a:{y}", **({"b": f"w:{bias}"} if bias else {})}
        if slot is not None:
            self.constants[f"slot{slot}"] = slot
            return [LaunchTemplate(ops.matmul(fmt, rows, cols, self.T, acc, False, not interleave, self.digits,
                                              experts=c.experts, used=c.experts_used),
                                   {"w": f"w:{name}", "x": f"a:{x}", "sel": "a:sel", **bufs, **self._digits(fmt, into)},
                                   {**scalars, "slot": f"slot{slot}"})]
        if not self._prefill_matmul(fmt, rows, prefill, interleave):
            # a prefill step's int8 dots (the dot4 layouts') in tiles of tokens (the LM head's one token needs none)
            tokens = ops.INT8_TOKENS if prefill and fmt.digits and self.digits == quant.INT8 and not logits else \
                BATCH_TOKENS if batch else 1
            return [LaunchTemplate(ops.matmul(fmt, rows, cols, self.T, acc, bias is not None, not interleave,
                                              self.digits, tokens),
                                   {"w": f"w:{name}", "x": f"a:{x}", **bufs, **self._digits(fmt, into)}, scalars)]
        out = []
        tiles = self._tile_matmul(fmt, rows, cols, prefill, interleave, tile_dots)
        inputs = {"xq": "a:xt", "xd": "a:xtd", "xs": "a:xts", "wt": "a:wt", "wts": "a:wts"} if tiles else \
            {"x": f"a:{x}", "wdq": "a:wdq"}
        for mm, at in prefill_matmuls(fmt, rows, cols, self.T, acc, bias is not None, tile, tiles):
            names = {s: f"{s}_{v}" for s, v in at.items()}  # constants, the same at every step
            self.constants.update({names[s]: v for s, v in at.items()})
            outs = {b: n for b, n in bufs.items() if b in mm.buffers}  # a later column chunk's: no bias
            out.append(LaunchTemplate(mm, {"w": f"w:{name}", **inputs, **outs}, {**scalars, **names}))
        return out

    @staticmethod
    def _quantized(into="x"):
        """A matmul's input as `ops.quantize_input` writes it: into the activations `{into}q`, `{into}d`,
        `{into}s`."""
        return {"xq": f"a:{into}q", "xd": f"a:{into}d", "xs": f"a:{into}s"}

    def _digits(self, fmt, into="x"):
        """A matmul's quantized input buffers, where its layout is a dot4 one."""
        return self._quantized(into) if fmt.digits else {}

    def _inputs(self, x, cols, unit, names, prefill=False, interleave=True, into="x", tile_dots=False):
        """The launches that write activation x as the matmuls of weights `names` (of `unit`) read it, quantized: as
        the dot4 layouts' do (`_digits(into)`), if any of them is such a matmul (the prefill matmul reads x itself; a
        mixture of experts' never runs there), and as integer tile matmuls do (`_tile_matmul`), if any is one."""
        shapes = self.weight_shapes(unit)
        fmts = [(n, self.fmt(n, shapes[n][0], interleave), shapes[n][0]) for n in names]
        out = []
        if any(f.digits and (experts_tensor(n) or not self._prefill_matmul(f, shape[0], prefill, interleave))
               for n, f, shape in fmts):
            out.append(LaunchTemplate(ops.quantize_input(cols, self.T, self.digits),
                                      {"x": f"a:{x}", **self._quantized(into)}))
        if any(not experts_tensor(n) and self._tile_matmul(f, shape[0], shape[1], prefill, interleave, tile_dots)
               for n, f, shape in fmts):
            out.append(LaunchTemplate(ops.quantize_input(cols, self.T, quant.DIGITS, ops.TILE_SPAN, 32),
                                      {"x": f"a:{x}", "xq": "a:xt", "xd": "a:xtd", "xs": "a:xts"}))
        return out

    def unit_launches(self, unit, prefill=False, interleave=True, tile=ops.GEMM_TILE, batch=False, tile_dots=False):
        """The unit's launches for a decode step, or (prefill=True) for a step of many tokens, or (batch=True) for
        a decode step of up to self.batch tokens, each at the end of its sequence or of a draft before it (positions
        and page tables per token: activation tpos, KV buffer bptab), in the schedule `interleaves` chooses for the device (and with the prefill matmul's
        `tile`, `ops.gemm_tile`; tile_dots: on a device of matrix instructions, `_tile_matmul`)."""
        c, T = self.cfg, self.T
        norm = ops.rmsnorm(c.dim, T, c.eps, not interleave)
        if unit == "embed":
            fmt = self.fmt("token_embd.weight", (c.vocab, c.dim), interleave)
            return [LaunchTemplate(ops.embed(fmt, c.vocab, c.dim, T, c.embed_scale),
                                   {"tok": "a:tok", "w": "w:token_embd.weight", "x": "a:x"})]
        if unit == "head":
            # the LM head is a decode matmul in every step (only the step's last tokens are wanted)
            return [LaunchTemplate(norm, {"x": "a:x", "w": "w:output_norm.weight", "out": "a:xn"}),
                    *self._inputs("xn", c.dim, unit, [self.head_tensor], interleave=interleave),
                    *self._mm(self.head_tensor, "xn", "logits", c.vocab, c.dim, logits=True, interleave=interleave,
                              scalars={}, batch=batch),
                    *([LaunchTemplate(ops.softcap(c.vocab, T, c.final_softcap), {"x": "a:logits"})]
                      if c.final_softcap else [])]
        p, q, kv = f"blk.{unit}.", c.n_head * c.head_dim, c.n_kv * c.head_dim
        b = (lambda n: p + n + ".bias") if c.bias else (lambda n: None)
        cache = dict(page=self.page, n_pages=self.pool_pages(unit), max_pages=self.n_pages, kv_dtype=self.kv_dtype)
        batched = self.batch if batch else 0  # the position ops' batch size (0: one sequence's step)
        kvb = {"ptab": "kv:bptab", "tpos": "a:tpos"} if batch else {"ptab": "kv:ptab"}
        kvb.update(kc="kv:k", vc="kv:v")
        mm = functools.partial(self._mm, prefill=prefill, interleave=interleave, tile=tile, batch=batch,
                               tile_dots=tile_dots)
        inputs = lambda x, cols, *names, into="x": self._inputs(x, cols, unit, [p + n + ".weight" for n in names],
                                                                prefill, interleave, into, tile_dots)
        # the last layer's queries and what follows its attention feed only the LM head: from t0 (its keys and
        # values, every token's, go to the cache), as llama.cpp's graph keeps only the output rows there
        only_wanted = {} if unit == c.n_layer - 1 else EVERY_TOKEN
        mm_wanted = functools.partial(mm, scalars=only_wanted)
        norm_heads = lambda x, heads, w, scalars: LaunchTemplate(  # the whole vector: one head of them all
            ops.head_rmsnorm(*((1, heads * c.head_dim) if c.qk_norm == "whole" else (heads, c.head_dim)), T, c.eps),
            {"q": f"a:{x}", "w": f"w:{p}{w}.weight"}, scalars)
        qk_norms = [norm_heads("q", c.n_head, "attn_q_norm", only_wanted),
                    norm_heads("k", c.n_kv, "attn_k_norm", EVERY_TOKEN)] if c.qk_norm else []
        window = c.window(unit)
        rot = "c:rope_local" if window and c.local_rope_base else "c:rope"

        def joined(name, y, rows, cols):
            """The matmul of weight `name` by y added into x; with sandwich norms, normed first (into y, xn); with a
            residual scale (Granite's), scaled as it joins."""
            if c.residual_scale != 1.0:
                return [*mm_wanted(p + name + ".weight", y, "y", rows, cols),
                        LaunchTemplate(ops.add(c.dim, T, c.residual_scale), {"y": "a:y", "x": "a:x"}, only_wanted)]
            if not c.sandwich:
                return mm_wanted(p + name + ".weight", y, "x", rows, cols, acc=True)
            post = "post_attention_norm" if name == "attn_output" else "post_ffw_norm"
            return [*mm_wanted(p + name + ".weight", y, "y", rows, cols),
                    LaunchTemplate(norm, {"x": "a:y", "w": f"w:{p}{post}.weight", "out": "a:xn"}, only_wanted),
                    LaunchTemplate(ops.add(c.dim, T), {"y": "a:xn", "x": "a:x"}, only_wanted)]
        act = ops.gelu_mul if c.act == "gelu_tanh" else ops.silu_mul
        src = "xn" if c.pre_norm else "x"  # the blocks' input: x normed, or x itself (OLMo 2)

        def pre_norm(name, scalars):
            return [LaunchTemplate(norm, {"x": "a:x", "w": f"w:{p}{name}.weight", "out": "a:xn"}, scalars)
                    ] if c.pre_norm else []

        def gated(name, width, matmul=mm_wanted):
            """The MLP's gate and up projections of src (`name`: "ffn", an expert's "ffn_*_exps", the shared
            expert's "ffn_*_shexp"), width wide, through `matmul`, activated into h."""
            return [*matmul(p + name.replace("*", "gate") + ".weight", src, "g", width, c.dim),
                    *matmul(p + name.replace("*", "up") + ".weight", src, "u", width, c.dim),
                    LaunchTemplate(act(width, T), {"g": "a:g", "u": "a:u", "h": "a:h"}, only_wanted)]

        def mlp():
            if not c.experts:
                return [*inputs(src, c.dim, "ffn_gate", "ffn_up"), *gated("ffn_*", c.ffn),
                        *inputs("h", c.ffn, "ffn_down"),
                        *joined("ffn_down", "h", c.dim, c.ffn)]
            # a mixture of experts: its input quantized once, the router's logits and choice, then each slot's
            # expert (its down projection's input quantized apart) joining the residual times its weight, then a
            # shared expert joining it times its gate
            shared = ("ffn_gate_shexp", "ffn_up_shexp") if c.shared_ffn else ()
            out = [*inputs(src, c.dim, "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", *shared),
                   *mm_wanted(p + "ffn_gate_inp.weight", src, "router", c.experts, c.dim),
                   LaunchTemplate(ops.moe_route(c.experts, c.experts_used, T, c.experts_normalize),
                                  {"r": "a:router", "sel": "a:sel", "wt": "a:wt"}, only_wanted)]
            for j in range(c.experts_used):
                expert = functools.partial(mm, scalars=only_wanted, slot=j)
                out += [*gated("ffn_*_exps", c.ffn, expert),
                        *inputs("h", c.ffn, "ffn_down_exps", into="h"),
                        *expert(p + "ffn_down_exps.weight", "h", "y", c.dim, c.ffn, into="h"),
                        LaunchTemplate(ops.add(c.dim, T, c.residual_scale, used=c.experts_used),
                                       {"y": "a:y", "wt": "a:wt", "x": "a:x"}, {**only_wanted, "slot": f"slot{j}"})]
            if c.shared_ffn:
                out += [*gated("ffn_*_shexp", c.shared_ffn),
                        *inputs("h", c.shared_ffn, "ffn_down_shexp", into="h"),
                        *mm_wanted(p + "ffn_down_shexp.weight", "h", "y", c.dim, c.shared_ffn, into="h"),
                        LaunchTemplate(ops.add_gated(c.dim, T), {"y": "a:y", "xin": f"a:{src}", "x": "a:x",
                                                                 "w": f"w:{p}ffn_gate_inp_shexp.weight"}, only_wanted)]
            return out
        return [
            *pre_norm("attn_norm", EVERY_TOKEN),
            *inputs(src, c.dim, "attn_q", "attn_k", "attn_v"),
            *mm_wanted(p + "attn_q.weight", src, "q", q, c.dim, bias=b("attn_q")),
            *mm(p + "attn_k.weight", src, "k", kv, c.dim, bias=b("attn_k")),
            *mm(p + "attn_v.weight", src, "v", kv, c.dim, bias=b("attn_v")),
            *qk_norms,
            *([] if unit in c.nope_layers else [  # SmolLM3's layers without rope
                LaunchTemplate(ops.rope(heads, c.head_dim, T, self.positions, batched),
                               {"q": f"a:{x}", "rot": rot, **({"tpos": "a:tpos"} if batch else {})}, scalars)
                for x, heads, scalars in (("q", c.n_head, only_wanted), ("k", c.n_kv, EVERY_TOKEN))]),
            LaunchTemplate(ops.kv_store(c.n_kv, c.head_dim, T, **cache, batched=batched),
                           {"k": "a:k", "v": "a:v", **kvb}),
            LaunchTemplate(ops.attention(c.n_head, c.n_kv, c.head_dim, T, **cache, wide=not interleave,
                                         window=window, scale=c.attn_scale or None, softcap=c.attn_softcap,
                                         batched=batched),
                           {"q": "a:q", "s": "a:scores", "out": "a:att", **kvb}, only_wanted),
            *inputs("att", q, "attn_output"),
            *joined("attn_output", "att", c.dim, q),
            *pre_norm("ffn_norm", only_wanted),
            *mlp(),
        ]

    def page_bytes(self):
        """Bytes of one KV page of one layer, for K or for V."""
        c = self.cfg
        return self.page * c.n_kv * c.head_dim * ir.STORAGE_DTYPES[self.kv_dtype]

    def pool_pages(self, unit):
        """Pages of a layer's KV pool: the whole context's, or a sliding-window layer's `sequences` windows (the
        pages behind a window are freed as it slides, `Engine._ensure_pages`)."""
        window = self.cfg.window(unit)
        return min(self.n_pages, self.sequences * window_pages(window, self.T, self.page)) if window else self.n_pages

    def kv_bytes(self, unit):
        """A layer's KV pool, K and V."""
        return 2 * self.pool_pages(unit) * self.page_bytes()


def model_kernels(path, T=64, page=16, context=None, kv_dtype="f16", interleave=True):
    """Every distinct kernel the model (a path, or a SpecFile) needs on a device of that schedule
    (`interleaves`), for ahead-of-time compilation."""
    mf = path if isinstance(path, SpecFile) else ModelFile(path)
    ctx = min(context or mf.config.context, 8192)
    max_pages = -(-ctx // page)
    m = Llama(mf, T, page, max_pages, kv_dtype)
    seen = {}
    for u in m.units:
        for lt in m.unit_launches(u, interleave=interleave) + m.unit_launches(u, True, interleave):
            seen.setdefault(lt.kernel.key(), lt.kernel)
    return list(seen.values())
