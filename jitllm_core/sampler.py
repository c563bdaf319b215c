"""Next-token choice from one row of logits: greedy, or temperature with top-k / top-p, seeded."""
import numpy as np


class Sampler:
    def __init__(self, temperature=0.0, top_k=0, top_p=1.0, seed=None):
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
