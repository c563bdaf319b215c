"""KV pages: each layer has its own pool on its device; a sequence holds, per layer, the list of its pages."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ContextLimitError


class PagePool:
    def __init__(self, n_pages):
        self.n_pages = n_pages
        self.free_pages = list(range(n_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    def alloc(self):
        if not self.free_pages:
            raise ContextLimitError(f"KV cache full: all {self.n_pages} pages are in use")
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
