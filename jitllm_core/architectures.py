"""What the architectures jitllm computes are made of, read from a config.json or a GGUF file's keys: the `Config`
(the Llama block's shapes and the features some architectures add to it) and the readers of those features -- rope
scalings, sliding windows, mixtures of experts, Gemma's, OLMo's, Granite's and SmolLM3's -- each refusing values
no model has by name. The files themselves are read in `modelfile`."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .errors import ModelFileError


GGUF_ARCHS = ("llama", "smollm3", "granite", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "olmo2", "qwen3moe",
              "olmoe", "granitemoe", "qwen2moe")
# GGUF architectures whose query and key rows rotate halves (`_rope_pairs`)
HALVES_ARCHS = ("qwen2", "qwen3", "phi3", "gemma2", "gemma3", "olmo2", "qwen3moe", "olmoe", "qwen2moe")
HF_TYPES = ("llama", "smollm3", "granite", "qwen2", "qwen3", "mistral", "phi3", "gemma2",  # config.json model_type
            "gemma3_text", "olmo2", "olmo3", "mixtral", "qwen3_moe", "olmoe", "granitemoe", "qwen2_moe")
# query and key norms by GGUF architecture or config.json model_type: each head's, or the whole vector's
QK_NORMS = {"qwen3": "head", "qwen3moe": "head", "qwen3_moe": "head", "olmoe": "whole"}
# architectures with a mixture of experts -> whether the chosen experts' weights are divided by their sum, as
# llama.cpp computes a GGUF file (Mixtral's are llama files with experts); config.json's norm_topk_prob says
MOE_GGUF = {"llama": True, "qwen3moe": True, "olmoe": False, "granitemoe": True, "qwen2moe": False}
# config.json's -> (its router, an expert's prefix, the expert's gate, up and down projections), under model.layers.i
_MLP_EXPERTS = ("mlp.gate", "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj"))  # Qwen's, OLMoE's
MOE_HF = {"mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.", ("w1", "w3", "w2")),
          **dict.fromkeys(("qwen3_moe", "olmoe", "qwen2_moe"), _MLP_EXPERTS)}
# a shared expert (Qwen2-MoE's: every token's, gated by sigmoid(x . w)): its tensors under model.layers.i
SHARED_HF = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
             "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# the width of the experts' MLPs and of the shared expert's, where config.json says them
MOE_FFN_HF = {"qwen3_moe": ("moe_intermediate_size", None),
              "qwen2_moe": ("moe_intermediate_size", "shared_expert_intermediate_size")}
# config.json's whose experts are stacked in the file -> (its router; the experts' gate and up projections, each
# expert's gate rows then its up rows, [experts, 2 x ffn, dim]; their down projections, [experts, dim, ffn])
MOE_HF_STACKED = {"granitemoe": ("block_sparse_moe.router.layer", "block_sparse_moe.input_linear",
                                 "block_sparse_moe.output_linear")}
GRANITES = ("granite", "granitemoe")  # Granite's multipliers: its dense files and its mixtures of experts
MOE_COUNT = ("num_local_experts", "num_experts")  # config.json's key of the experts' count (either, by version)
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # a mixture's tensors: its experts' matrices stacked
# OLMo 3's layers that see every key, one in this many, where a GGUF file (llama.cpp's olmo2) has a window
OLMO3_FULL_EVERY = 4
# SmolLM3's layers without rope, one in this many (the last of each run), where a file does not list them
NOPE_EVERY = 4
# Gemma's layers that see every key, one in this many (the last of each run), where a file does not list them
GEMMA_FULL_EVERY = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}
GEMMA_LOCAL_ROPE_BASE = 10000.0  # Gemma 3's sliding-window layers' rope base where a file does not say it
# Granite's multipliers -- embedding, residual, attention scores, logits (divided by the last) -- and each one's
# default where a file leaves it out: transformers' (the scores' 1.0), llama.cpp's (0: 1 / sqrt(head_dim))
GRANITE_HF = (("embedding_multiplier", 1.0), ("residual_multiplier", 1.0), ("attention_multiplier", 1.0),
              ("logits_scaling", 1.0))
GRANITE_GGUF = (("embedding_scale", 1.0), ("residual_scale", 1.0), ("attention.scale", 0.0), ("logit_scale", 1.0))
GEMMA_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")  # Gemma 2's, the same key in both kinds of file


@dataclass
class Config:
    n_layer: int
    dim: int
    n_head: int
    n_kv: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float
    rope_base: float
    context: int
    bias: bool = False     # q, k, v biases (Qwen2)
    qk_norm: str = ""      # query and key RMS-normed before the rope: "head" each head (Qwen3), "whole" (OLMo 2)
    pre_norm: bool = True  # attention and MLP inputs RMS-normed (OLMo 2 norms their outputs only, `sandwich`)
    rope_scaling: dict = field(default_factory=dict)
    rope_dim: int = 0      # the first dimensions of each head the rope turns (0: all of them; Phi-4-mini's 3 in 4)
    # a mixture of experts in every layer's MLP (0: a dense one): that many, experts_used of them per token, each
    # an MLP of ffn wide; their weights divided by the chosen ones' sum where experts_normalize (Mixtral, Qwen3-MoE)
    experts: int = 0
    experts_used: int = 0
    experts_normalize: bool = True
    shared_ffn: int = 0    # a shared expert's width, every token's MLP beside its chosen ones (0: none; Qwen2-MoE)
    sliding_window: int = 0                       # keys a token sees, itself included (0: every earlier one)
    full_layers: frozenset = frozenset()          # layers that see every key despite a sliding window
    nope_layers: frozenset = frozenset()          # layers without rope (SmolLM3's one in 4)

    # Gemma 2 and 3's
    embed_scale: float = 1.0      # the embedding rows times this (Gemma: sqrt(dim), as an f32)
    act: str = "silu"             # the MLP gate's activation: "silu" or "gelu_tanh"
    sandwich: bool = False        # attention and MLP outputs RMS-normed before they join the residual
    attn_scale: float = 0.0       # the scores' scale (0: 1 / sqrt(head_dim))
    attn_softcap: float = 0.0     # scores -> cap * tanh(scores / cap) (0: none)
    final_softcap: float = 0.0    # logits -> cap * tanh(logits / cap) (0: none)
    local_rope_base: float = 0.0  # the sliding-window layers' rope base, unscaled, where it differs (0: the same)
    # Granite's (with embed_scale and attn_scale)
    residual_scale: float = 1.0   # each block's output times this as it joins the residual
    logit_scale: float = 1.0      # the logits divided by this

    def window(self, layer):
        """The sliding window of a layer's attention (0: none)."""
        return 0 if layer in self.full_layers else self.sliding_window

    def check(self, where, keys):
        """Refuse values no model has (a zero head count, a NaN epsilon...), naming the file and the key each
        came from (keys: field -> key); they would otherwise divide by zero or turn every logit into NaN."""
        for f in ("n_layer", "dim", "n_head", "n_kv", "head_dim", "ffn", "vocab", "context"):
            least = 0 if f == "n_layer" else 1
            if getattr(self, f) < least:
                raise ModelFileError(where, f"{keys[f]} is {getattr(self, f)}; it must be at least {least}")
        if not math.isfinite(self.eps) or self.eps < 0:
            raise ModelFileError(where, f"{keys['eps']} is {self.eps}; it must be a finite number >= 0")
        if not math.isfinite(self.rope_base) or self.rope_base <= 0:
            raise ModelFileError(where, f"{keys['rope_base']} is {self.rope_base}; it must be a finite number > 0")
        if self.rope_dim % 2 or not 0 <= self.rope_dim <= self.head_dim:
            raise ModelFileError(where, f"{keys['rope_dim']} gives a rope over {self.rope_dim} dimensions of a head; "
                                        f"an even number up to the head size ({self.head_dim}) is needed")
        for name in LONGROPE_FACTORS:
            if name in self.rope_scaling and len(self.rope_scaling[name]) != self.rotary // 2:
                raise ModelFileError(where, f"the rope's {name} lists {len(self.rope_scaling[name])} factors; the "
                                            f"rope turns {self.rotary // 2} pairs")

    @property
    def rotary(self):
        """The dimensions of each head the rope turns."""
        return self.rope_dim or self.head_dim


def number(where, key, value, kind):
    """A config value as kind (int or float), or an error naming the key: files may hold a string there."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int and ok and isinstance(value, float):
        ok = value.is_integer()
    if not ok:
        raise ModelFileError(where, f"{key} is {value!r}; {'a whole number' if kind is int else 'a number'} is needed")
    return kind(value)


# rope scalings computed here -> their parameters, with the default of each that may be left out (None: required;
# 0.0: derived from the others as transformers derives it, `_long_context`)
ROPE_SCALINGS = {"linear": {"factor": None},
                 "llama3": {"factor": None, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
                 "yarn": {"factor": 0.0, "original_max_position_embeddings": 0.0, "attention_factor": 0.0,
                          "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0},
                 "longrope": {"factor": 0.0, "original_max_position_embeddings": 0.0, "attention_factor": 0.0}}
ROPE_ALIASES = {"su": "longrope"}  # Phi-3's first name for LongRoPE
LONGROPE_FACTORS = ("short_factor", "long_factor")  # per rotated pair: within the original context, past it


def rope_scaling(where, key, s, context=0, original=0):
    """The rope scaling a model asks for, as {"rope_type": kind, parameter: value}; {} for none. A kind not
    computed here (dynamic...) is refused: left out, it would give wrong logits silently. context: the model's
    (max_position_embeddings), original: a top-level original_max_position_embeddings (Phi-3's), which comes
    before the table's -- what YaRN's and LongRoPE's derived parameters are derived from."""
    if not s:
        return {}
    if not isinstance(s, dict):
        raise ModelFileError(where, f"{key} is {s!r}; a table of rope scaling parameters is needed")
    kind = s.get("rope_type", s.get("type"))
    if kind in (None, "default", "none"):
        return {}
    kind = ROPE_ALIASES.get(kind, kind)
    if kind not in ROPE_SCALINGS:
        raise ModelFileError(where, f"{key}: rope scaling {kind!r} is not supported ({', '.join(ROPE_SCALINGS)} are)")
    out = {"rope_type": kind}
    for name, default in ROPE_SCALINGS[kind].items():
        v = s.get(name)
        if v is None:
            if default is None:
                raise ModelFileError(where, f"{key}: rope scaling {kind!r} needs {name!r}")
            out[name] = default
            continue
        out[name] = number(where, f"{key}.{name}", v, float)
        if not math.isfinite(out[name]) or out[name] <= 0:
            raise ModelFileError(where, f"{key}.{name} is {v!r}; it must be a finite number > 0")
    if kind == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ModelFileError(where, f"{key}: high_freq_factor must be above low_freq_factor")
    if kind in ("yarn", "longrope"):
        _long_context(where, key, s, out, context, original)
    return out


def _long_context(where, key, s, out, context, original):
    """YaRN's and LongRoPE's derived parameters, as transformers derives them: the original context (a top-level
    one first, else the table's, else the model's), the factor (the contexts' ratio), the cosines' and sines'
    attention factor (each kind's rule); YaRN's truncated ramp, LongRoPE's per-pair factors."""
    kind = out["rope_type"]
    orig = out["original_max_position_embeddings"] = float(original or out["original_max_position_embeddings"]
                                                           or context)
    if not orig:
        raise ModelFileError(where, f"{key}: rope scaling {kind!r} needs 'original_max_position_embeddings'")
    factor = out["factor"] = out["factor"] or context / orig
    if kind == "yarn":
        out["truncate"] = s.get("truncate", True)
        if not isinstance(out["truncate"], bool):
            raise ModelFileError(where, f"{key}.truncate is {out['truncate']!r}; true or false is needed")
        if not out["attention_factor"]:
            m = lambda scale, ms=1.0: 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0
            both = out["mscale"] and out["mscale_all_dim"]
            out["attention_factor"] = m(factor, out["mscale"]) / m(factor, out["mscale_all_dim"]) if both else m(factor)
        return
    if not out["attention_factor"]:
        out["attention_factor"] = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    for name in LONGROPE_FACTORS:
        v = s.get(name)
        if not isinstance(v, list) or not v or not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0
                                                       for x in v):
            raise ModelFileError(where, f"{key}.{name} must list numbers > 0, one per rotated pair")
        out[name] = np.asarray(v, np.float32)


def hf_rope(where, c):
    """(the key of rope theta, its value, the rope scaling) from a config.json: transformers 5 writes theta and the
    scaling into one rope_parameters table (Gemma 3's: one per layer type, the full layers' here), earlier versions
    rope_theta and rope_scaling at the top."""
    key = "rope_parameters" if "rope_parameters" in c else "rope_scaling"
    table = c.get(key) or {}
    if isinstance(table, dict) and "full_attention" in table:
        key, table = f"{key}.full_attention", table["full_attention"]
    context = number(where, "max_position_embeddings", c.get("max_position_embeddings", 0), int)
    original = number(where, "original_max_position_embeddings", c.get("original_max_position_embeddings", 0), int)
    scaling = rope_scaling(where, key, table, context, original)  # also refuses a table that is not one
    if key.startswith("rope_parameters"):
        theta_key, theta = f"{key}.rope_theta", table.get("rope_theta")
    else:
        theta_key, theta = "rope_theta", c.get("rope_theta")
    return theta_key, number(where, theta_key, 1e4 if theta is None else theta, float), scaling


def hf_rope_dim(where, c, head_dim):
    """The dimensions of each head the rope turns (0: all): partial_rotary_factor of them (Phi-3's, as Phi-4-mini
    has it; transformers turns a part of the head only there)."""
    table = c.get("rope_parameters") or c.get("rope_scaling") or {}
    partial = (table if isinstance(table, dict) else {}).get("partial_rotary_factor", c.get("partial_rotary_factor", 1))
    partial = number(where, "partial_rotary_factor", partial, float)
    if partial == 1:
        return 0
    if c["model_type"] != "phi3":
        raise ModelFileError(where, f"partial_rotary_factor is {partial!r}; a rope over part of a head is "
                                    "supported for phi3 only")
    return int(head_dim * partial)


def nope_layers(where, c, n_layer):
    """SmolLM3's layers without rope: no_rope_layers lists 1 for a layer with rope, 0 for one without."""
    flags = c.get("no_rope_layers")
    if flags is None:
        every = c.get("no_rope_layer_interval", NOPE_EVERY)
        return every_kth(n_layer, number(where, "no_rope_layer_interval", every, int))
    if not isinstance(flags, list) or len(flags) != n_layer or any(f not in (0, 1) for f in flags):
        raise ModelFileError(where, f"no_rope_layers must list {n_layer} of 0 or 1")
    return frozenset(i for i, f in enumerate(flags) if f == 0)


def hf_local_rope_base(where, c):
    """Gemma 3's sliding-window layers' rope base (unscaled): transformers 5's rope_parameters.sliding_attention, or
    rope_local_base_freq (None: not given)."""
    local = (c.get("rope_parameters") or {}).get("sliding_attention")
    if local is not None:
        if rope_scaling(where, "rope_parameters.sliding_attention", local):
            raise ModelFileError(where, "rope_parameters.sliding_attention: a scaled local rope is not supported")
        return number(where, "rope_parameters.sliding_attention.rope_theta", local.get("rope_theta", 1e4), float)
    base = c.get("rope_local_base_freq")
    return None if base is None else number(where, "rope_local_base_freq", base, float)


def sliding_window(where, c, n_layer):
    """(config.json's sliding window: the keys a token sees, itself included (0: none), the layers that see every
    key nonetheless): those its layer_types names "full_attention", else Qwen2's first max_window_layers (as
    transformers reads them), else none."""
    window = c.get("sliding_window")
    qwen = c["model_type"] in ("qwen2", "qwen2_moe")  # a window only where use_sliding_window says so
    if window is None or (qwen and not c.get("use_sliding_window")):
        return 0, frozenset()
    window = number(where, "sliding_window", window, int)
    if window < 1:
        raise ModelFileError(where, f"sliding_window is {window}; it must be at least 1")
    types = c.get("layer_types")
    if types is not None:
        kinds = ("full_attention", "sliding_attention")
        if not isinstance(types, list) or len(types) != n_layer or any(t not in kinds for t in types):
            raise ModelFileError(where, f"layer_types must list {n_layer} of {' or '.join(map(repr, kinds))}")
        return window, frozenset(i for i, t in enumerate(types) if t == "full_attention")
    if qwen:
        first = number(where, "max_window_layers", c.get("max_window_layers", 28), int)
        return window, frozenset(range(min(n_layer, first)))
    return window, frozenset()


def gemma(cfg, kind, attn_softcap, final_softcap, query_scalar=None, local_rope_base=None):
    """Gemma 2 / 3's features on a Config: scaled embeddings, GELU, sandwich norms, Gemma 3's per-head norms and
    local rope base, Gemma 2's caps (0: none)."""
    cfg.embed_scale = float(np.float32(math.sqrt(cfg.dim)))
    cfg.act, cfg.sandwich, cfg.qk_norm = "gelu_tanh", True, "head" if kind.startswith("gemma3") else ""
    cfg.attn_softcap, cfg.final_softcap = attn_softcap, final_softcap
    if query_scalar and query_scalar != cfg.head_dim:
        cfg.attn_scale = query_scalar ** -0.5
    if cfg.qk_norm:
        cfg.local_rope_base = local_rope_base or GEMMA_LOCAL_ROPE_BASE


def olmo(cfg):
    """OLMo 2 / 3's features on a Config: no norm before attention or the MLP, their outputs normed instead; the
    whole query and key normed."""
    cfg.pre_norm, cfg.sandwich, cfg.qk_norm = False, True, "whole"


def moe(cfg, experts, used, normalize, where, used_key):
    """A mixture of experts on a Config: `used` of `experts` per token."""
    if not 0 < used <= experts:
        raise ModelFileError(where, f"{used_key} is {used}; 1 to the {experts} experts are needed")
    cfg.experts, cfg.experts_used, cfg.experts_normalize = experts, used, normalize


def granite(cfg, embed, residual, attention, logits):
    """Granite's multipliers on a Config (attention 0: the scores' usual 1 / sqrt(head_dim))."""
    cfg.embed_scale, cfg.residual_scale, cfg.attn_scale, cfg.logit_scale = embed, residual, attention, logits


def experts_tensor(name):
    """Whether a (GGUF-named) tensor is a mixture's stack of its experts' matrices."""
    return name.endswith("_exps.weight")


def every_kth(n_layer, k):
    """The layers i with (i + 1) % k == 0: the last of each run of k."""
    return frozenset(i for i in range(n_layer) if (i + 1) % k == 0)


def gguf_features(cfg, arch, get, where):
    """What a GGUF file's architecture adds to the Llama block, on its Config; get(key, kind, default): the
    architecture's key, checked."""
    cfg.bias, cfg.qk_norm = arch in ("qwen2", "qwen2moe"), QK_NORMS.get(arch, "")
    experts = get("expert_count", int, 0)
    if experts:
        if arch not in MOE_GGUF:
            raise ModelFileError(where, f"{arch}.expert_count: a mixture of experts is not supported in {arch} files")
        cfg.ffn = get("expert_feed_forward_length", int, cfg.ffn)
        cfg.shared_ffn = get("expert_shared_feed_forward_length", int, 0) if arch == "qwen2moe" else 0
        moe(cfg, experts, get("expert_used_count", int), MOE_GGUF[arch], where, f"{arch}.expert_used_count")
    if arch.startswith("gemma") or arch in ("phi3", "olmo2"):  # windows where the file says so
        cfg.sliding_window = get("attention.sliding_window", int, 0)
    if arch == "olmo2":  # OLMo 3's files too: the window on three layers in four
        olmo(cfg)
        if cfg.sliding_window:
            cfg.full_layers = every_kth(cfg.n_layer, OLMO3_FULL_EVERY)
            if cfg.rope_scaling:  # llama.cpp's reading of which layers it scales: not known here
                raise ModelFileError(where, "olmo2: a scaled rope with sliding windows (OLMo 3's long context) is "
                                            "not supported in GGUF files")
    if arch.startswith("gemma"):
        # llama.cpp scales the scores of its 27B Gemmas by the embedding per head, not the head size
        big = (arch, cfg.n_layer) in (("gemma2", 46), ("gemma3", 62))
        gemma(cfg, arch, *(get(key, float, 0.0) for key in GEMMA_CAPS), cfg.dim / cfg.n_head if big else None,
              get("rope.freq_base_swa", float, 0.0) or None)  # newer converters write the local base
        cfg.full_layers = every_kth(cfg.n_layer, GEMMA_FULL_EVERY[arch])
    if arch == "smollm3":
        cfg.nope_layers = every_kth(cfg.n_layer, NOPE_EVERY)
    if arch in GRANITES:
        granite(cfg, *(get(key, float, default) for key, default in GRANITE_GGUF))


def hf_features(cfg, c, get, where):
    """What a config.json's model_type adds to the Llama block, on its Config; get(key, kind, default): c[key],
    checked."""
    kind = c["model_type"]
    cfg.bias = kind == "qwen2" or kind == "qwen2_moe" and bool(c.get("qkv_bias", True))
    cfg.qk_norm = QK_NORMS.get(kind, "")
    if kind in MOE_HF or kind in MOE_HF_STACKED:
        if kind in MOE_FFN_HF:  # its experts' width; dense layers among sparse ones are not computed
            experts_ffn, shared_ffn = MOE_FFN_HF[kind]
            cfg.ffn = get(experts_ffn, int)
            cfg.shared_ffn = get(shared_ffn, int) if shared_ffn else 0
            if get("decoder_sparse_step", int, 1) != 1 or c.get("mlp_only_layers"):
                raise ModelFileError(where, "decoder_sparse_step / mlp_only_layers: dense MLP layers among the "
                                            "experts' are not supported")
        if c.get("clip_qkv"):
            raise ModelFileError(where, f"clip_qkv is {c['clip_qkv']!r}; clipped q/k/v are not supported")
        # Mixtral's and Granite's weights: a softmax over the chosen experts' logits
        normalize = kind in ("mixtral", "granitemoe") or bool(c.get("norm_topk_prob", False))
        count = next((key for key in MOE_COUNT if c.get(key) is not None), MOE_COUNT[0])
        moe(cfg, get(count, int), get("num_experts_per_tok", int), normalize, where, "num_experts_per_tok")
    cfg.rope_dim = hf_rope_dim(where, c, cfg.head_dim)
    cfg.sliding_window, cfg.full_layers = sliding_window(where, c, cfg.n_layer)
    if kind in ("olmo2", "olmo3"):
        olmo(cfg)
        if cfg.sliding_window and cfg.rope_scaling:  # OLMo 3: its full layers' rope scaled, its windowed ones' not
            cfg.local_rope_base = hf_local_rope_base(where, c) or cfg.rope_base
    if kind == "smollm3":
        cfg.nope_layers = nope_layers(where, c, cfg.n_layer)
    if kind in GRANITES:
        granite(cfg, *(get(key, float, default) for key, default in GRANITE_HF))
    if kind.startswith("gemma"):
        gemma(cfg, kind, *(get(key, float, 0.0) for key in GEMMA_CAPS),
              get("query_pre_attn_scalar", float, cfg.head_dim), hf_local_rope_base(where, c))
        if c.get("layer_types") is None:  # older files: one layer in sliding_window_pattern sees every key
            cfg.full_layers = every_kth(cfg.n_layer, get("sliding_window_pattern", int, GEMMA_FULL_EVERY[kind]))


def llama3_scaling(inv, s):
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    mid = (wavelen <= old / lo) & (wavelen >= old / hi)
    return np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


def yarn_scaling(inv, s, rot, base):
    """YaRN's frequencies: those that turn fewer than beta_slow times over the original context divided by the
    factor, those that turn more than beta_fast times kept, a linear ramp between (in pairs)."""
    def pair(turns):
        return rot * math.log(s["original_max_position_embeddings"] / (turns * 2 * math.pi)) / (2 * math.log(base))
    low, high = pair(s["beta_fast"]), pair(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot - 1)
    kept = 1 - np.clip((np.arange(len(inv), dtype=np.float32) - low) / (high - low if high != low else 0.001), 0, 1)
    return inv / s["factor"] * (1 - kept) + inv * kept
