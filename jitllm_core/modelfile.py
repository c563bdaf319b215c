"""Model files seen the same way whatever their format: a GGUF file or an HF safetensors folder (config.json and
its tensors) becomes a `Config` (`architectures`), a table of tensors under GGUF's names, and a tokenizer. Values
no model has, and models the Llama builder would compute wrong (weights it does not read, a rope scaling it does
not know), are refused here, naming the file and the key.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import architectures as archs
from .architectures import Config
from .errors import ModelFileError


def _refuse_unused(where, names):
    """Weights the architecture does not read (an output bias, an MLP bias...) mean a model it would compute
    wrong: refused rather than ignored."""
    if names:
        first = sorted(names)[0]
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise ModelFileError(where, f"tensor {first!r}{more} is not used by the architecture as jitllm computes it, "
                                    "so this model is not supported")


@dataclass
class Tensor:
    name: str
    shape: tuple
    type_name: str
    raw: callable  # -> uint8 array of the tensor's bytes (a view of the mapped file)


class _Tensors:
    def tensor(self, name, shape):
        t = self.tensors.get(name)
        if t is None:
            raise ModelFileError(self.path, f"missing tensor {name!r}")
        if tuple(t.shape) != tuple(shape):
            raise ModelFileError(self.path, f"tensor {name!r} has shape {tuple(t.shape)}, the architecture needs "
                                            f"{tuple(shape)}")
        return t


class SpecFile(_Tensors):
    """A model known only by its config and tensor types -- no data: enough to build every kernel, e.g. to
    compile ahead of time for a shape that is not on disk. types: tensor name -> (shape, type name)."""

    def __init__(self, config: Config, types: dict, path="<spec>"):
        self.path, self.config = path, config
        self.tensors = {n: Tensor(n, shape, t, None) for n, (shape, t) in types.items()}


class ModelFile(_Tensors):
    """A GGUF file or an HF safetensors folder, seen through GGUF tensor names."""

    def __init__(self, path):
        self.path = Path(path)
        if self.path.is_dir():
            self._open_hf()
        elif self.path.exists():
            self._open_gguf()
        else:
            raise ModelFileError(self.path, "no such file or folder")

    # -- GGUF
    def _open_gguf(self):
        from .gguf import GGUFFile
        from .tokenizer import Tokenizer
        g = self.gguf = GGUFFile(self.path)
        arch = g.get("general.architecture")
        if arch not in archs.GGUF_ARCHS:
            raise ModelFileError(self.path, f"architecture {arch!r} is not supported ({', '.join(archs.GGUF_ARCHS)})")
        p = lambda key, kind, *d: archs.number(self.path, f"{arch}.{key}", g.get(f"{arch}.{key}", *d), kind)
        n_head = p("attention.head_count", int)
        dim = p("embedding_length", int)
        emb = g.tensors.get("token_embd.weight")
        if emb is None:
            raise ModelFileError(self.path, "missing tensor 'token_embd.weight'")
        head_key, head_dim, rope_dim = self._gguf_head_dim(arch, p, dim // n_head if n_head > 0 else 0)
        context = p("context_length", int)
        self.config = Config(
            n_layer=p("block_count", int), dim=dim, n_head=n_head, n_kv=p("attention.head_count_kv", int, n_head),
            head_dim=head_dim, ffn=p("feed_forward_length", int), vocab=int(emb.shape[0]),
            eps=p("attention.layer_norm_rms_epsilon", float),
            rope_base=p("rope.freq_base", float, 10000.0), context=context, rope_dim=rope_dim,
            rope_scaling=archs.rope_scaling(self.path, f"{arch}.rope.scaling", self._gguf_rope_scaling(arch, context),
                                            context))
        self.config.check(self.path, dict(
            n_layer=f"{arch}.block_count", dim=f"{arch}.embedding_length", n_head=f"{arch}.attention.head_count",
            n_kv=f"{arch}.attention.head_count_kv", head_dim=head_key,
            ffn=f"{arch}.feed_forward_length", vocab="the rows of token_embd.weight",
            eps=f"{arch}.attention.layer_norm_rms_epsilon", rope_base=f"{arch}.rope.freq_base",
            context=f"{arch}.context_length", rope_dim=f"{arch}.rope.dimension_count"))
        archs.gguf_features(self.config, arch, p, self.path)
        self.tensors = {n: Tensor(n, _read_shape(n, t.shape), t.type_name, (lambda n=n: g.raw(n)))
                        for n, t in g.tensors.items()}
        self._split_fused(arch == "phi3")
        _refuse_unused(self.path, set(self.tensors) - self.tensor_names())
        if arch in archs.HALVES_ARCHS:
            self._rope_pairs()
        self.tokenizer = Tokenizer.from_gguf(g)
        if self.tokenizer.vocab_size > self.config.vocab:  # the embedding would be read past its last row
            raise ModelFileError(self.path, f"the tokenizer has {self.tokenizer.vocab_size} tokens but "
                                            f"token_embd.weight only {self.config.vocab} rows")

    def _gguf_head_dim(self, arch, p, default):
        """(the key it came from, the head size, the dimensions the rope turns; 0: all), as llama.cpp reads them:
        attention.key_length where the converter wrote it (Qwen3's heads are wider than embedding_length /
        head_count), rope.dimension_count. Values of another size than the keys are refused: computed as whole
        heads, they would be wrong."""
        g, key = self.gguf, f"{arch}.attention.key_length"
        head_key, head_dim = (key, p("attention.key_length", int)) if g.get(key, None) is not None else (
            f"{arch}.embedding_length / {arch}.attention.head_count", default)
        if g.get(f"{arch}.attention.value_length", None) is not None and p("attention.value_length", int) != head_dim:
            raise ModelFileError(self.path, f"{arch}.attention.value_length is {p('attention.value_length', int)} but "
                                            f"the head size is {head_dim} ({head_key}); heads of mixed sizes are not "
                                            "supported")
        rot = p("rope.dimension_count", int, head_dim)
        return head_key, head_dim, 0 if rot == head_dim else rot

    def _gguf_rope_scaling(self, arch, context):
        """rope.scaling.type and its parameters (or the older rope.scale_linear), as llama.cpp reads them: YaRN's
        scores' factor its own times attn_factor; Phi-3's LongRoPE as tensors of per-pair factors, the scores'
        factor as written. Llama 3's scaling is instead baked into a rope_freqs.weight tensor."""
        g, key = self.gguf, lambda k: f"{arch}.rope.scaling.{k}"
        orig = g.get(key("original_context_length"), None)
        names = {f"{kind}_factor": f"rope_factors_{kind}.weight" for kind in ("short", "long")}
        if any(n in g.tensors for n in names.values()):
            out = {"rope_type": "longrope", "original_max_position_embeddings": orig,
                   "attention_factor": g.get(key("attn_factor"), 1.0)}
            for name, n in names.items():
                if n not in g.tensors:
                    raise ModelFileError(self.path, f"missing tensor {n!r} (LongRoPE's factors come in pairs)")
                out[name] = _as_f32(g.raw(n), g.tensors[n].type_name, f"{self.path}: tensor {n!r}").tolist()
            return out
        factor = g.get(key("factor"), None) or g.get(f"{arch}.rope.scale_linear", None)
        kind = g.get(key("type"), "linear" if factor else None)
        if kind != "yarn":
            return {"rope_type": kind, "factor": factor} if kind else {}
        for k, plain in (("yarn_log_multiplier", 0.0), ("yarn_ext_factor", 1.0), ("yarn_attn_factor", 1.0)):
            if g.get(key(k), plain) != plain:  # DeepSeek's and others' variations of it
                raise ModelFileError(self.path, f"{key(k)} is {g.get(key(k))}; only {plain} is supported")
        out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
               "beta_fast": g.get(key("yarn_beta_fast"), None), "beta_slow": g.get(key("yarn_beta_slow"), None)}
        attn = g.get(key("attn_factor"), None)
        if attn is not None and factor:  # a multiplier of YaRN's own factor
            own = archs.rope_scaling(self.path, key("type"), out, context)["attention_factor"]
            out["attention_factor"] = own * attn
        return out

    def tensor_names(self):
        """Every tensor the architecture reads (GGUF names), optional ones included."""
        cfg, names = self.config, {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight",
                                   "rope_factors_long.weight", "rope_factors_short.weight"}
        for i in range(cfg.n_layer):
            names.update(f"blk.{i}.{g}.weight" for g in self.HF_NAMES)
            if cfg.bias:
                names.update(f"blk.{i}.{g}.bias" for g in ("attn_q", "attn_k", "attn_v"))
            if cfg.qk_norm:
                names.update(f"blk.{i}.{g}.weight" for g in self.HF_QK_NORMS)
            if cfg.sandwich:
                names.update(f"blk.{i}.{g}.weight" for g in ("post_attention_norm", "post_ffw_norm"))
            if cfg.experts:
                names.update(f"blk.{i}.{g}.weight" for g in ("ffn_gate_inp", *archs.EXPERTS))
            if cfg.shared_ffn:
                names.update(f"blk.{i}.{g}.weight" for g in archs.SHARED_HF)
        return names

    def _split_fused(self, fused_ffn):
        """Phi-3's fused matrices as the builder's: attn_qkv (the query's rows, the key's, the value's) and, where
        fused_ffn, an ffn_up of twice the FFN's rows (the gate's, then the up projection's)."""
        cfg = self.config
        q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv * cfg.head_dim
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            parts = [("attn_qkv", [("attn_q", q), ("attn_k", kv), ("attn_v", kv)])]
            if fused_ffn:
                parts.append(("ffn_up", [("ffn_gate", cfg.ffn), ("ffn_up", cfg.ffn)]))
            for fused, split in parts:
                t = self.tensors.pop(p + fused + ".weight", None)
                if t is None:
                    continue
                if t.shape[0] != sum(rows for _, rows in split):
                    raise ModelFileError(self.path, f"tensor {t.name!r} has {t.shape[0]} rows; the architecture needs "
                                                    f"{' + '.join(str(r) for _, r in split)}")
                start = 0
                for name, rows in split:
                    self.tensors[p + name + ".weight"] = _rows(t, p + name + ".weight", start, rows)
                    start += rows

    def _rope_pairs(self):
        """The rope kernel rotates each head's adjacent pairs, as llama GGUF files store the query and key rows; HF
        models rotate the two halves of a head, and llama.cpp's converter keeps that order for Qwen, Phi-3 and Gemma
        files (`architectures.HALVES_ARCHS`: its rope there is "neox"). Such rows -- with their biases and norms (a
        head's, or OLMo 2's of every head) -- are reordered to pairs as they load: the rows the rope turns
        (Phi-4-mini's halves are of the first 3 in 4), the rest left where they are."""
        cfg = self.config
        for i in range(cfg.n_layer):
            for g, heads in (("attn_q", cfg.n_head), ("attn_k", cfg.n_kv)):
                for name, h in ((f"blk.{i}.{g}.weight", heads), (f"blk.{i}.{g}.bias", heads),
                                (f"blk.{i}.{g}_norm.weight", heads if cfg.qk_norm == "whole" else 1)):
                    t = self.tensors.get(name)
                    if t is not None:
                        self.tensors[name] = Tensor(name, t.shape, t.type_name,
                                                    lambda t=t, h=h: _permute_rows(t.raw(), t, h, cfg.rotary))

    # -- HF safetensors folder
    HF_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
    HF_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    # Gemma's and OLMo 2's: post_attention_layernorm norms the attention's output (a llama's is the MLP's input
    # norm); OLMo 2 has no pre_feedforward_layernorm (nor input_layernorm)
    HF_SANDWICH = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                   "post_ffw_norm": "post_feedforward_layernorm"}
    HF_FUSED = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}  # Phi-3's (`_split_fused`)

    def _open_hf(self):
        from .safetensors import SafetensorsFolder
        from .tokenizer import Tokenizer
        st = SafetensorsFolder(self.path)
        c = st.config
        where = self.path / "config.json"

        def need(key, kind=None, default=None):
            """c[key] as kind; a key missing or null takes the default, if there is one."""
            v = c.get(key)
            if v is None:
                if default is None:
                    raise ModelFileError(where, f"missing key {key!r}")
                v = default
            return v if kind is None else archs.number(where, key, v, kind)
        if need("model_type") not in archs.HF_TYPES:
            raise ModelFileError(where, f"model_type {c['model_type']!r} is not supported")
        gemma = c["model_type"].startswith("gemma")
        act_key, acts = ("hidden_activation", ("gelu_pytorch_tanh",)) if gemma else ("hidden_act", ("silu", "swish"))
        if c.get(act_key, acts[0]) not in acts:
            raise ModelFileError(where, f"{act_key} {c[act_key]!r} is not supported ({', '.join(acts)})")
        n_head, dim = need("num_attention_heads", int), need("hidden_size", int)
        theta_key, theta, scaling = archs.hf_rope(where, c)
        self.config = Config(
            n_layer=need("num_hidden_layers", int), dim=dim, n_head=n_head,
            n_kv=need("num_key_value_heads", int, n_head),
            head_dim=need("head_dim", int, dim // n_head if n_head > 0 else 0),
            ffn=need("intermediate_size", int), vocab=need("vocab_size", int), eps=need("rms_norm_eps", float),
            rope_base=theta, context=need("max_position_embeddings", int, 4096), rope_scaling=scaling)
        cfg = self.config
        archs.hf_features(cfg, c, need, where)
        cfg.check(where, dict(n_layer="num_hidden_layers", dim="hidden_size", n_head="num_attention_heads",
                              n_kv="num_key_value_heads", head_dim="head_dim", ffn="intermediate_size",
                              vocab="vocab_size", eps="rms_norm_eps", rope_base=theta_key,
                              context="max_position_embeddings", rope_dim="partial_rotary_factor"))
        self.tensors, used = {}, set()

        def read(gguf_name, hf_name):
            """The file's tensor hf_name as the builder reads gguf_name (`_read_shape`), or None if absent."""
            t = st.tensors.get(hf_name)
            if t is None:
                return None
            used.add(hf_name)
            return Tensor(gguf_name, _read_shape(gguf_name, t.shape), t.type_name, lambda: st.raw(hf_name))

        def add(gguf_name, hf_name):
            t = read(gguf_name, hf_name)
            if t is not None:
                if gemma and gguf_name.endswith("norm.weight"):  # Gemma's norms scale by 1 + w; GGUF files hold 1 + w
                    t = Tensor(gguf_name, t.shape, "F32",
                               lambda raw=t.raw, kind=t.type_name: (_as_f32(raw(), kind, hf_name) + 1).view(np.uint8))
                self.tensors[gguf_name] = t
        add("token_embd.weight", "model.embed_tokens.weight")
        add("output_norm.weight", "model.norm.weight")
        add("output.weight", "lm_head.weight")
        for i in range(cfg.n_layer):
            names = {**self.HF_NAMES, **(self.HF_QK_NORMS if cfg.qk_norm else {}),
                     **(self.HF_SANDWICH if cfg.sandwich else {}),
                     **(self.HF_FUSED if c["model_type"] == "phi3" else {})}
            for g, h in names.items():
                add(f"blk.{i}.{g}.weight", f"model.layers.{i}.{h}.weight")
                if cfg.bias and g in ("attn_q", "attn_k", "attn_v"):
                    add(f"blk.{i}.{g}.bias", f"model.layers.{i}.{h}.bias")
            if c["model_type"] in archs.MOE_HF_STACKED:
                router, gate_up, down = archs.MOE_HF_STACKED[c["model_type"]]
                add(f"blk.{i}.ffn_gate_inp.weight", f"model.layers.{i}.{router}.weight")
                add(f"blk.{i}.ffn_down_exps.weight", f"model.layers.{i}.{down}.weight")
                both = read(f"blk.{i}.ffn_gate_up_exps.weight", f"model.layers.{i}.{gate_up}.weight")
                if both is not None:  # each expert's gate rows then its up rows: [experts x 2 x ffn, dim]
                    if both.shape[0] % (2 * cfg.experts):
                        raise ModelFileError(where, f"model.layers.{i}.{gate_up}.weight is {tuple(both.shape)}, "
                                                    f"not {cfg.experts} experts' gate and up projections")
                    rows = both.shape[0] // (2 * cfg.experts)
                    for j, g in enumerate(("ffn_gate_exps", "ffn_up_exps")):
                        name = f"blk.{i}.{g}.weight"
                        self.tensors[name] = _stacked(name, [_rows(both, name, (2 * e + j) * rows, rows)
                                                             for e in range(cfg.experts)], where)
            elif cfg.experts:
                for g, h in archs.SHARED_HF.items() if cfg.shared_ffn else ():
                    add(f"blk.{i}.{g}.weight", f"model.layers.{i}.{h}.weight")
                router, expert, parts = archs.MOE_HF[c["model_type"]]
                add(f"blk.{i}.ffn_gate_inp.weight", f"model.layers.{i}.{router}.weight")
                for g, part in zip(archs.EXPERTS, parts):
                    hf = [f"model.layers.{i}.{expert.format(e=e)}{part}.weight" for e in range(cfg.experts)]
                    if all(n in st.tensors for n in hf):
                        self.tensors[f"blk.{i}.{g}.weight"] = _stacked(f"blk.{i}.{g}.weight",
                                                                       [read(n, n) for n in hf], where)
        self._split_fused(c["model_type"] == "phi3")
        self._rope_pairs()
        # older checkpoints saved the rotary frequencies, which are computed from the config instead
        _refuse_unused(self.path, {n for n in st.tensors if n not in used and not n.endswith("rotary_emb.inv_freq")})
        if "output.weight" not in self.tensors and c.get("tie_word_embeddings") is False:
            raise ModelFileError(self.path, "lm_head.weight is missing and config.json says tie_word_embeddings: false")
        self.tokenizer = Tokenizer.from_hf_folder(self.path)

    def f32(self, name, shape):
        """A small tensor (norm weight, bias) as f32."""
        t = self.tensor(name, shape)
        return _as_f32(t.raw(), t.type_name, f"{self.path}: tensor {name!r}")

    def rope(self, positions, local=False):
        """(per-pair inverse frequencies, per-pair factors of their cosines and sines), head_dim / 2 of each; the
        pairs past the part of a head the rope turns turn by 0 (they stay as they are). Scaled as the model asks:
        Llama 3's, linear, YaRN's, LongRoPE's (its long factors where the engine holds more positions than the
        original context: llama.cpp's rule; transformers switches to them once a sequence passes it). local: of the
        sliding-window layers where their base differs (Gemma 3's, unscaled)."""
        cfg, s = self.config, self.config.rope_scaling
        rot, rest = cfg.rotary, (cfg.head_dim - cfg.rotary) // 2
        base = cfg.local_rope_base if local else cfg.rope_base
        inv = 1.0 / (base ** (np.arange(0, rot, 2, dtype=np.float32) / rot))
        kind = None if local else s.get("rope_type")
        if not local and "rope_freqs.weight" in self.tensors:
            inv = inv / self.f32("rope_freqs.weight", (rot // 2,))
        if kind == "linear":  # positions divided by the factor
            inv = inv / s["factor"]
        elif kind == "llama3":
            inv = archs.llama3_scaling(inv, s)
        elif kind == "yarn":
            inv = archs.yarn_scaling(inv, s, rot, base)
        elif kind == "longrope":
            inv = inv / s["long_factor" if positions > s["original_max_position_embeddings"] else "short_factor"]
        scale = s["attention_factor"] if kind in ("yarn", "longrope") else 1.0
        return (np.concatenate([inv, np.zeros(rest)]).astype(np.float32),
                np.concatenate([np.full(rot // 2, scale), np.ones(rest)]).astype(np.float32))


def _rows(t, name, start, rows):
    """Rows [start, start + rows) of a tensor (a quantized one's too: its rows are whole blocks), as a tensor."""
    def raw():
        data = t.raw()
        per = len(data) // t.shape[0]
        return data[start * per:(start + rows) * per]
    return Tensor(name, (rows, *t.shape[1:]), t.type_name, raw)


def _read_shape(name, shape):
    """The shape the builder reads a (GGUF-named) tensor in: a mixture's experts, [experts, rows, cols] in a file,
    as their matrices one after another; a [1, n] vector (Qwen2-MoE's shared expert's gate, as transformers holds
    it) as [n]."""
    if archs.experts_tensor(name) and len(shape) == 3:
        return shape[0] * shape[1], *shape[2:]
    return (shape[-1],) if name.endswith("gate_inp_shexp.weight") else tuple(shape)


def _stacked(name, parts, where):
    """Tensors of one shape and type one after another (a mixture's experts), as one tensor."""
    first = parts[0]
    for t in parts:
        if (t.shape, t.type_name) != (first.shape, first.type_name):
            raise ModelFileError(where, f"tensor {t.name!r} is {t.type_name} {tuple(t.shape)}, unlike "
                                        f"{first.name!r} ({first.type_name} {tuple(first.shape)})")
    return Tensor(name, (len(parts) * first.shape[0], *first.shape[1:]), first.type_name,
                  lambda: np.concatenate([t.raw() for t in parts]))


def _as_f32(raw, type_name, what):
    """A float tensor's bytes as f32 values."""
    if type_name == "F32":
        return np.frombuffer(raw, np.float32).copy()
    if type_name == "F16":
        return np.frombuffer(raw, np.float16).astype(np.float32)
    if type_name == "BF16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise ModelFileError(what, f"type {type_name}; a float type is needed here")


def _permute_rows(raw, t, n_heads, rot):
    """Reorder each head's first rot rows (or bias entries) from HF's two halves to GGUF's interleaved pairs."""
    heads = raw.reshape(n_heads, t.shape[0] // n_heads, -1).copy()
    heads[:, :rot] = heads[:, :rot].reshape(n_heads, 2, rot // 2, -1).swapaxes(1, 2).reshape(n_heads, rot, -1)
    return heads.reshape(-1)
