"""A sliding-window layer's KV pool holds a few windows of pages, not the whole context: the pages a window has
passed are freed and reused as the sequence grows (`Engine._ensure_pages`), which neither the logits (against
transformers) nor live migration may notice."""
import os

import numpy as np
import pytest

import jitllm_core as jl
from conftest import backend_device
from jitllm_core.errors import ContextLimitError
from jitllm_core.kvcache import window_pages
from test_safetensors_model import PROMPTS, _build

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WINDOW = 21  # the test variants' (their SHAPE: 512 positions, pages of 16)


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model):
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(default_model),
                                                           gguf_file=os.path.basename(default_model))
    root = tmp_path_factory.mktemp("window_kv")
    # Gemma 3: a full layer among windowed ones; Mistral: every layer windowed
    return {v: (str(root / v), _build(root / v, v, tokenizer)) for v in ("gemma3-f32", "mistral-window")}


def long_ids(eng, n=300):
    return (eng.tokenizer.encode(" ".join(PROMPTS)) * 8)[:n]


@pytest.mark.parametrize("variant, device", [("gemma3-f32", "cpu"), ("mistral-window", "cpu"),
                                             ("gemma3-f32", "vulkan:0"), ("gemma3-f32", "cuda:0")])
def test_window_pages_are_freed_and_reused(models, variant, device):
    """On the CPU, and on each accelerator (lavapipe, the CUDA emulation where no GPU is) whose wide attention
    reads the pages from the window's first position."""
    backend_device(device)
    folder, model = models[variant]
    with jl.Engine(folder, devices=[device], kv_dtype="f32", max_sequences=1) as eng:
        per_window = window_pages(WINDOW, eng.model.T, 16)
        windowed = [u for u in range(eng.config.n_layer) if eng.config.window(u)]
        assert windowed and all(eng.units[u].pool.n_pages == per_window < eng.model.n_pages for u in windowed)
        assert all(eng.units[u].pool.n_pages == eng.model.n_pages for u in range(eng.config.n_layer)
                   if u not in windowed)
        ids = long_ids(eng)  # 19 pages: the windowed pools (11) are reused
        with eng.session() as s:
            got = [s.feed(ids[:250])] + [s.feed([t]) for t in ids[250:]]  # two prompt steps, then decode steps
            assert all(eng.units[u].pool.used <= per_window for u in windowed)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert want.std() > 0.05 and np.abs(np.concatenate(got) - want).max() <= 1e-3


def test_more_sequences_than_the_windows_held_is_a_clear_error(cpu, models):
    folder, _ = models["mistral-window"]
    with jl.Engine(folder, devices=["cpu"], kv_dtype="f32", max_sequences=1) as eng:
        ids = long_ids(eng, 200)
        with eng.session() as a, eng.session() as b:
            first = a.feed(ids[:128])  # a step of 128 tokens: 8 of the 11 pages held until the next step
            with pytest.raises(ContextLimitError, match=r"sliding-window layer's pool holds 1 sequences' windows: "
                                                        r"Engine\(max_sequences=\)"):
                b.feed(ids[:64])
            a.feed(ids[128:])  # the first sequence goes on, nothing lost
        with eng.session() as s:  # the pages came back
            assert np.array_equal(s.feed(ids[:128]), first)


def test_migration_moves_only_the_live_window(models):
    """Moves between two CPU devices mid-sequence, two sequences alive: every page a window has passed is left
    behind, the logits bit-identical to no moves."""
    backend_device("cpu:1")
    folder, _ = models["gemma3-f32"]
    with jl.Engine(folder, devices=["cpu:0", "cpu:1"], placement={"cpu:0": range(4)}, kv_dtype="f32") as eng:
        ids = long_ids(eng)
        cuts = [130, 131, 200, 260, 299]

        def run(moves):
            out, reports = [], []
            with eng.session() as s, eng.session() as other:
                other.feed(ids[:60])
                for i, (a, b) in enumerate(zip([0] + cuts, cuts + [len(ids)])):
                    out.append(s.feed(ids[a:b]))
                    if i < len(moves):
                        reports.append(eng.migrate(*moves[i]))
                        # every pool holds its layer's live pages and nothing else: no page a window passed came
                        # along, none copied for nothing stayed taken
                        for u in range(eng.config.n_layer):
                            live = sum(p is not None for q in (s, other) for p in q.seq.pages.get(u, []))
                            assert eng.units[u].pool.used == live, (moves[i], u)
                out.append(other.feed(ids[60:100]))
            return np.concatenate(out), reports
        base, _ = run([])
        got, reports = run([("0-3", "cpu:1"), ("embed,0-1", "cpu:0"), ("2-3,head", "cpu:0"), ("0-3", "cpu:1")])
    assert np.array_equal(got, base)
    assert all(r.ok and r.recomputed_tokens == 0 for r in reports), [str(r) for r in reports]
    # a windowed layer's pages: at most a window's for each sequence, all copied in the pause
    assert reports[0].bytes_in_pause > 0


def test_prompt_cache_with_windows(models):
    """A parked sequence whose windows still hold the pages a resumed step reads is resumed, else not; the one
    window a pool of max_sequences=1 holds is taken back for a new prompt. Tokens as a fresh run's."""
    folder, _ = models["gemma3-f32"]
    with jl.Engine(folder, devices=["cpu"], kv_dtype="f32", max_sequences=1) as eng, \
            jl.Engine(folder, devices=["cpu"], kv_dtype="f32", max_sequences=1, prompt_cache=False) as fresh:
        ids = long_ids(eng)
        eng.generate(ids, max_tokens=1)  # no decode step: the windows still hold position 256's pages
        again = eng.generate(ids, max_tokens=8, ignore_eos=True)
        assert again.timings["cached_tokens"] == 256
        assert again.token_ids == fresh.generate(ids, max_tokens=8, ignore_eos=True).token_ids
        # 7 decode steps on, the windows have passed position 256's pages: computed afresh
        assert eng.generate(ids, max_tokens=4).timings["cached_tokens"] == 0
        other = ids[::-1][:200]
        assert eng.generate(other, max_tokens=6, ignore_eos=True).token_ids == \
            fresh.generate(other, max_tokens=6, ignore_eos=True).token_ids
