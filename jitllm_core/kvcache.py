"""KV pages: each layer has its own pool on its device; a sequence holds, per layer, the list of its pages (None
for a page a sliding window has passed: freed back to the pool)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ContextLimitError


SEQUENCES = 4  # sequences alive at once whose sliding windows a windowed layer's pool holds, by default


def window_pages(window, T, page):
    """The most pages one sequence's sliding window of `window` keys needs at once: a step of T tokens reads from
    its first query's window to its last token, window - 1 + T positions."""
    return (window + T - 2) // page + 2


def first_live_page(pos, window, page):
    """The first page a step from position pos reads in a sliding window (those before it are dead)."""
    return max(0, pos - window + 1) // page


class PagePool:
    def __init__(self, n_pages, full_note=""):
        self.n_pages, self.full_note = n_pages, full_note
        self.free_pages = list(range(n_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    def alloc(self):
        if not self.free_pages:
            raise ContextLimitError(f"KV cache full: all {self.n_pages} pages are in use{self.full_note}")
        return self.free_pages.pop()

    def free(self, pages):
        self.free_pages.extend(reversed(pages))

    @property
    def used(self):
        return self.n_pages - len(self.free_pages)


@dataclass
class Sequence:
    id: int
    n: int = 0                                  # positions already in the cache
    pages: dict = field(default_factory=dict)   # unit -> [page index in that unit's pool]


@dataclass
class Parked:
    """A finished generation's sequence, kept for a later prompt that starts with its tokens (the prompt cache)."""
    seq: Sequence
    tokens: list   # the tokens whose KV it holds (seq.n of them)
    exact: int     # its first positions computed in whole steps from a step boundary: as a fresh prompt's are

    def reusable(self, ids, step):
        """Positions of its KV a prompt `ids` can start from: the common prefix within the exact part, one token
        left to feed, in whole steps -- so that the prompt's steps are those a fresh run takes, and its logits the
        same bit for bit."""
        n = min(self.exact, len(ids) - 1)
        common = next((i for i, (a, b) in enumerate(zip(self.tokens[:n], ids[:n])) if a != b), n)
        return common // step * step
