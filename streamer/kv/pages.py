"""PagePool: the KV memory of one model, cut into fixed-size pages.

K and V are tensors [layers, pages, page_size, kv_heads, head_dim]. A float8 pool
stores them otherwise and shows them through permuted views of that shape:
- V is token-major, stored as [layers, pages, kv_heads, head_dim, page_size], so a
  page's 16 tokens of one dimension are adjacent bytes. Attention multiplies P by V
  along the tokens, and the tensor-core operands want neighbouring tokens packed
  together: one-byte values in the usual layout are gathered byte by byte, which bound
  the float8 decode kernel (389 against 470 us at batch 480, benchmarks/RESULTS.md).
- K is head-major, stored as [layers, pages, kv_heads, page_size, head_dim], so one KV
  head's keys of a page are 2 KB of adjacent bytes rather than 16 rows 1 KB apart (the
  decode kernel reads them per KV head): 438 -> 426 us at batch 512 x 1,500 tokens, run
  at the H200's power cap (`profile_gpu.py power`).
16-bit pages keep the usual layout (transposing loads serve them).

shared_v > 0 (MLA's latent cache, model/deepseek.py): there is no V storage. K is one
"head" of head_dim values per token (the compressed kv and the rope key) and V is the view
of K's first shared_v dims; v_bytes is empty ([layers, pages, 0]), so the host tier copies
K alone. A float8 latent pool keeps this plain layout (the latent kernels read it, the
values rounded to e4m3 and saturated at +-448 as they are stored: kernels/mla.py). A request
holds a page table (its pages, in order); the radix tree holds pages of cached
prefixes. Ownership is counted per page:

  refcount[p] == (1 if the tree holds p) + (number of requests holding p)
  p is in the free list  <=>  refcount[p] == 0

Page 0 is reserved as a scratch page (padding of CUDA-graph batches writes
there), so it is never handed out.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from streamer.errors import ConfigError

if TYPE_CHECKING:
    from streamer.frames import TierCopy


class PagePool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        shared_v: int = 0,
    ) -> None:
        if num_pages < 2:
            raise ConfigError(f"the KV pool needs at least 2 pages, got {num_pages}")
        if shared_v and (kv_heads != 1 or not 0 < shared_v <= head_dim):
            raise ConfigError(f"a latent KV pool (shared_v {shared_v}) is one head of at least {shared_v} "
                              f"dims: not {kv_heads} x {head_dim}")
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
        if shared_v:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = self.k[..., :shared_v]
        elif dtype == torch.float8_e4m3fn:
            k_stored = (num_layers, num_pages, kv_heads, page_size, head_dim)
            self.k = torch.zeros(k_stored, dtype=dtype, device=device).permute(0, 1, 3, 2, 4)
            v_stored = (num_layers, num_pages, kv_heads, head_dim, page_size)
            self.v = torch.zeros(v_stored, dtype=dtype, device=device).permute(0, 1, 4, 2, 3)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        # the raw bytes of each (layer, page) of K and V, whatever the stored layout (the host
        # tier copies pages through them, kv/host.py)
        self.k_bytes = _page_bytes(self.k, num_layers, num_pages)
        self.v_bytes = torch.empty((num_layers, num_pages, 0), dtype=torch.uint8, device=device) if shared_v \
            else _page_bytes(self.v, num_layers, num_pages)
        self.companions: list[torch.Tensor] = []
        """Byte views [layers, num_pages, bytes] of other tensors indexed by these page ids (a
        speculative draft's KV and an EAGLE head's features: model/draft.py): a host tier moves
        them with the page."""
        self.fence: Any = None
        """A CUDA event the next step waits for before its kernels touch the pool (the host
        tier's last write-back: a page it freed may be reused by that step). None: none."""
        self.tier_log: deque[TierCopy] | None = None
        """Under tensor parallelism, on rank 0: the host tier's copies since the last step was
        sent, which the other ranks repeat on their shards before it (distributed/runner.py)."""
        self.tier_loads: deque[Any] = deque()
        """With tier_log: the events of the tier's loads (host -> device) not yet seen complete,
        in their order (None: done)."""
        self.refcount = [0] * num_pages
        self.refcount[0] = 1  # scratch page, never free
        self._free: deque[int] = deque(range(1, num_pages))

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                       shared_v: int = 0) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return (1 if shared_v else 2) * num_layers * page_size * kv_heads * head_dim * itemsize

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return (num_tokens + self.page_size - 1) // self.page_size

    def alloc(self, n: int) -> list[int] | None:
        """n fresh pages with refcount 1, or None (nothing taken) if too few are free."""
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcount[p] > 0, f"incref of free page {p}"
            self.refcount[p] += 1

    def decref(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcount[p] > 0, f"decref of free page {p}"
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

    def check(self) -> None:
        """The free list is exactly the set of pages with refcount 0."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is in the free list twice"
        zero = {p for p, c in enumerate(self.refcount) if c == 0}
        assert free == zero, f"free list {sorted(free)[:8]} != refcount-0 pages {sorted(zero)[:8]}"


def _page_bytes(t: torch.Tensor, num_layers: int, num_pages: int) -> torch.Tensor:
    """[layers, pages, bytes] uint8 view of a pool tensor's storage (t may be a permuted view
    of it: the stored tensor is contiguous, layers and pages its outer two dims)."""
    stored = t
    if not t.is_contiguous():
        order = sorted(range(t.dim()), key=lambda d: -int(t.stride()[d]))
        stored = t.permute(*order)
    assert stored.is_contiguous() and stored.shape[:2] == (num_layers, num_pages)
    return stored.view(torch.uint8).view(num_layers, num_pages, -1)
