"""Tokenizer built on the `tokenizers` library, from GGUF `tokenizer.ggml.*` metadata or an HF tokenizer.json.

GGUF tokenizers are rebuilt to behave like llama.cpp's, which is what the file was written for:
byte-level BPE (`gpt2`) with the pre-tokenizer named by `tokenizer.ggml.pre`, and SentencePiece-BPE
(`llama`) where merges follow the token scores and a space is prefixed to every run of text.
"""

import os
import warnings

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from .errors import JitllmError, ModelFileError, is_whole
from .safetensors import read_json

# llama.cpp token types
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

_LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
                 r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# Mistral's Tekken and GPT-4o's o200k: words split at case changes ("HelloWorld": Hello, World), "/" kept with
# the punctuation before it; o200k keeps contractions on their word and cuts digits in threes, Tekken one by one
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CASED_WORDS = rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+@|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*@"  # @: a suffix
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TEKKEN_SPLIT = _CASED_WORDS.replace("@", "") + r"|\p{N}" + _TAIL
_O200K_SPLIT = _CASED_WORDS.replace("@", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?") + r"|\p{N}{1,3}" + _TAIL

# tokenizer.ggml.pre -> (regex split applied first, whether ByteLevel then applies the GPT-2 regex,
# ignore_merges: a word that is itself a token is not merged, add_bos where the file does not say); as in
# llama.cpp's llama-vocab.cpp, whose names for each family are listed.
_GPT2 = (None, True, False, False)
_PRE = {
    **dict.fromkeys(["gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4",
                     "gigachat", "a.x-4.0", "mellum", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de"], _GPT2),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
                    (_LLAMA3_SPLIT, False, True, True)),
    **dict.fromkeys(["dbrx", "smaug-bpe"], (_LLAMA3_SPLIT, False, False, False)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan", "grok-2"],
                    (_QWEN2_SPLIT, False, False, False)),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
                    (r"\p{N}", True, False, False)),
    "tekken": (_TEKKEN_SPLIT, False, True, True),
    **dict.fromkeys(["gpt-4o", "llama4"], (_O200K_SPLIT, False, False, False)),
}

# Token texts llama.cpp treats as end-of-generation in addition to the eos/eot/eom ids.
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
              "<EOT>", "<|end_of_text|>", "<end_of_utterance>"}


class Tokenizer:
    """Use `from_gguf` or `from_hf_folder`; the constructor takes an already configured backend."""

    def __init__(self, backend, *, bos_id=None, eos_id=None, eos_ids=(), add_bos=False, add_eos=False,
                 chat_template=None, vocab_size=None):
        self._tk = backend
        self.bos_id, self.eos_id = bos_id, eos_id
        self.eos_ids = {i for i in (eos_id, *eos_ids) if i is not None}
        # GGUF files say whether to add BOS/EOS; tokenizer.json carries a post-processor instead.
        self._prefix = [bos_id] if add_bos and bos_id is not None else []
        self._suffix = [eos_id] if add_eos and eos_id is not None else []
        self.chat_template = chat_template
        self.vocab_size = vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self):
        return self._token_text(self.bos_id)

    @property
    def eos_token(self):
        return self._token_text(self.eos_id)

    def _token_text(self, token_id):
        return (self._tk.id_to_token(token_id) or "") if token_id is not None else ""

    def encode(self, text, add_special=True):
        """Token ids of text; special tokens written in the text are always recognized."""
        if not isinstance(text, str):
            raise JitllmError(f"encode takes a string, not {type(text).__name__}")
        ids = self._tk.encode(text, add_special_tokens=add_special).ids
        return self._prefix + ids + self._suffix if add_special else ids

    def decode(self, ids, skip_special=False):
        """Text of token ids; an id past the tokenizer's end (a model's padded vocabulary) has none."""
        ids = list(ids)
        bad = next((i for i in ids if not is_whole(i) or i < 0), None)
        if bad is not None:  # the backend would overflow or raise a TypeError of its own
            raise JitllmError(f"decode: {bad!r} is not a token id (a whole number >= 0)")
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_piece(self, token_id):
        """The text of one token as it would appear mid-text (partial UTF-8 shows as U+FFFD)."""
        text = self._tk.decode([token_id], skip_special_tokens=False)
        # SentencePiece decoders strip the leading space of the first token; a lone piece keeps it.
        if (self._tk.id_to_token(token_id) or "").startswith("\u2581") and not text.startswith(" "):
            text = " " + text
        return text

    @classmethod
    def from_gguf(cls, gguf):
        meta = gguf.metadata
        kind = gguf.get("tokenizer.ggml.model")
        tokens = gguf.get("tokenizer.ggml.tokens")
        n = len(tokens) if isinstance(tokens, list) else 0
        if not n or not all(isinstance(t, str) for t in tokens):
            raise ModelFileError(gguf.path, "tokenizer.ggml.tokens must be a non-empty list of strings")

        def token_id(key):
            i = meta.get(f"tokenizer.ggml.{key}")
            if i is not None and not (isinstance(i, int) and 0 <= i < n):
                raise ModelFileError(gguf.path, f"tokenizer.ggml.{key} = {i!r} is outside the vocabulary (0..{n - 1})")
            return i

        ids = {k: token_id(f"{k}_token_id") for k in ("bos", "eos", "unknown", "padding", "eot", "eom")}
        types = meta.get("tokenizer.ggml.token_type")
        if types is None:  # no types recorded: treat the named special ids as control tokens
            types = [_NORMAL] * n
            for i in ids.values():
                if i is not None:
                    types[i] = _CONTROL
        else:
            _check_per_token(gguf, "tokenizer.ggml.token_type", types, n, int)

        if kind == "gpt2":
            backend, add_bos_default = _byte_level_bpe(gguf, tokens, meta.get("tokenizer.ggml.pre", "gpt2"))
        elif kind == "llama":
            backend = _sentencepiece_bpe(gguf, tokens, ids["unknown"])
            add_bos_default = True
        else:
            raise ModelFileError(gguf.path, f"unsupported tokenizer model {kind!r} (supported: gpt2, llama)")
        _add_special_tokens(backend, tokens, types)

        eog = {ids["eot"], ids["eom"]} | {i for i, t in enumerate(tokens) if t in _EOG_TEXTS}
        return cls(backend, bos_id=ids["bos"], eos_id=ids["eos"], eos_ids=eog - {None},
                   add_bos=meta.get("tokenizer.ggml.add_bos_token", add_bos_default),
                   add_eos=meta.get("tokenizer.ggml.add_eos_token", False),
                   chat_template=_str_or_none(meta.get("tokenizer.chat_template")), vocab_size=n)

    @classmethod
    def from_hf_folder(cls, path):
        path = str(path)
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise ModelFileError(path, "missing tokenizer.json")
        try:
            backend = _Backend.from_file(tj)
        except Exception as e:  # the library reports bad files with its own exception types
            raise ModelFileError(tj, f"cannot load tokenizer: {e}") from e

        def optional_json(name):
            p = os.path.join(path, name)
            data = read_json(p) if os.path.isfile(p) else {}
            return data if isinstance(data, dict) else {}

        cfg = optional_json("tokenizer_config.json")

        def special_id(key):
            tok = cfg.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return backend.token_to_id(tok) if isinstance(tok, str) else None

        eos_ids = set()
        for extra in (optional_json("generation_config.json"), optional_json("config.json")):
            e = extra.get("eos_token_id")
            eos_ids.update(e if isinstance(e, list) else [e] if isinstance(e, int) else [])
        return cls(backend, bos_id=special_id("bos_token"), eos_id=special_id("eos_token"), eos_ids=eos_ids,
                   chat_template=_hf_chat_template(path, cfg))


class StreamDecoder:
    """Incremental decode: push() returns only newly completed text, holding back partial UTF-8 sequences.

    Decodes a short window of recent tokens and emits the growth of its text, so that decoder rules
    that depend on context (SentencePiece's leading-space strip, byte fallback) give exactly decode()'s
    result when the pieces are concatenated.
    """

    def __init__(self, tokenizer, skip_special=False):
        self._tok, self._skip = tokenizer, skip_special
        self._ids, self._read = [], 0  # window of ids; ids[:read] were already emitted

    def _text(self, ids):
        return self._tok.decode(ids, skip_special=self._skip)

    def push(self, token_id):
        self._ids.append(token_id)
        emitted = self._text(self._ids[:self._read])
        text = self._text(self._ids)
        if len(text) <= len(emitted) or text.endswith("\ufffd"):
            return ""
        # slide the window: keep the last emitted run as context for the next decode
        self._ids, self._read = self._ids[self._read:], len(self._ids) - self._read
        return text[len(emitted):]

    def flush(self):
        """Whatever is still held back (e.g. an incomplete byte sequence), as decode() would show it."""
        rest = self._text(self._ids)[len(self._text(self._ids[:self._read])):]
        self._ids, self._read = [], 0
        return rest


def _byte_level_bpe(gguf, tokens, pre):
    """(the backend, whether BOS is added where the file does not say)."""
    if pre not in _PRE:
        warnings.warn(f"{gguf.path}: unknown tokenizer.ggml.pre {pre!r}; using the GPT-2 pre-tokenizer")
    split, gpt2_regex, ignore_merges, add_bos = _PRE.get(pre, _GPT2)
    merges = []
    for m in gguf.get("tokenizer.ggml.merges"):
        pos = m.find(" ", 1) if isinstance(m, str) else -1  # as llama.cpp: a left part may start with a space
        if pos < 0:
            raise ModelFileError(gguf.path, f"malformed merge {m!r} in tokenizer.ggml.merges")
        merges.append((m[:pos], m[pos + 1:]))
    backend = _Backend(models.BPE(_vocab(tokens), merges, ignore_merges=ignore_merges))
    steps = [pre_tokenizers.Split(Regex(split), behavior="isolated")] if split else []
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_regex))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend, add_bos


def _sentencepiece_bpe(gguf, tokens, unk_id):
    """llama.cpp's SPM tokenizer: repeatedly merge the adjacent pair whose union is the best-scoring token."""
    scores = gguf.get("tokenizer.ggml.scores", None) or [0.0] * len(tokens)
    _check_per_token(gguf, "tokenizer.ggml.scores", scores, len(tokens), (int, float))
    vocab = _vocab(tokens)
    # Every split of a token into two tokens is a merge ranked by the token's score (then longer left
    # part first), which is how transformers orders merges recovered from a SentencePiece vocabulary.
    ranked = []
    for tok, score in zip(tokens, scores):
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in vocab and right in vocab:
                ranked.append((-score, -len(left), -len(right), left, right))
    ranked.sort(key=lambda r: r[:3])
    unk = tokens[unk_id] if unk_id is not None else None
    backend = _Backend(models.BPE(vocab, [(r[3], r[4]) for r in ranked], unk_token=unk,
                                  fuse_unk=True, byte_fallback=True))
    # llama.cpp puts a space before every run of text (at the start and after each special token), so
    # the prefix is a normalizer, which runs per segment between special tokens.
    add_space = gguf.get("tokenizer.ggml.add_space_prefix", True)
    escape = normalizers.Replace(" ", "\u2581")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), escape]) if add_space else escape
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if add_space else steps)
    return backend


def _check_per_token(gguf, key, values, n, kind):
    if not isinstance(values, list) or len(values) != n or not all(isinstance(v, kind) for v in values):
        raise ModelFileError(gguf.path, f"{key} must be a list of {n} numbers, one per token")


def _vocab(tokens):
    return {t: i for i, t in enumerate(tokens)}  # a repeated text maps to its last id, as in llama.cpp


def _add_special_tokens(backend, tokens, types):
    """Control (and unknown) tokens are special; user-defined ones are plain added tokens. Both are
    matched whole in the text before any other processing, as llama.cpp does."""
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty in (_CONTROL, _UNKNOWN) and t]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t]
    backend.add_special_tokens(special)
    backend.add_tokens(user)


def _str_or_none(value):
    return value if isinstance(value, str) else None


def _hf_chat_template(path, cfg):
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8", errors="replace") as f:
            return f.read()
    return None
