"""Next-token choice from one row of logits: greedy, or temperature with top-k / top-p, seeded."""
import math
import numbers

import numpy as np

from .errors import JitllmError, check_whole


def check_options(max_tokens=0, temperature=0.0, top_k=0, top_p=1.0, seed=None):
    """Refuse sampling options that mean nothing, naming the option (before any model is loaded, from the CLI)."""
    check_whole("max_tokens", max_tokens, 0)
    check_whole("top_k", top_k or 0, 0)
    if seed is not None:
        check_whole("seed", seed, 0)
    if not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) or temperature < 0:
        raise JitllmError(f"temperature must be a finite number >= 0 (0 = greedy), not {temperature!r}")
    if not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise JitllmError(f"top_p must be in (0, 1] (1 = off), not {top_p!r}")


class Sampler:
    def __init__(self, temperature=0.0, top_k=0, top_p=1.0, seed=None):
        check_options(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k or 0), float(top_p)
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.temperature <= 0:
            return int(np.argmax(logits))  # first maximum: deterministic on ties
        z = logits.astype(np.float64) / self.temperature
        idx = np.argsort(-z, kind="stable")
        if self.top_k > 0:
            idx = idx[:self.top_k]
        p = np.exp(z[idx] - z[idx[0]])
        p /= p.sum()
        if self.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
            idx, p = idx[:keep], p[:keep] / p[:keep].sum()
        return int(idx[self.rng.choice(len(idx), p=p)])
