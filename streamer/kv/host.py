"""HostTier: KV pages in host memory under the radix tree (--host-kv-cache-gb).

The host pool holds pages in the device pool's page format, as raw bytes: a host page is
one row of bytes, the parts of `pool_parts` one after the other, each [layers, bytes of one
layer's page]: the bytes each (layer, page) of the device pool's stored K and V tensors keep
(pages.py: the outer two dims of every layout), so a float8 page stays float8 and a page
round-trips bit for bit. A pool without V storage (pages.py's shared_v: MLA's latent cache)
has K alone. A pool's companions (a speculative draft's KV and an EAGLE head's features,
under the same page ids) follow in the same row, so they leave and come back with the page.
On CUDA the host pool is pinned (copies are DMA, asynchronous); on CPU it is a second CPU
pool, so the tiering runs in CI exactly as on the GPU, with synchronous copies.

Which node's pages live where is the tree's business (radix.py); this module moves bytes
and counts them. Host pages have their own free list; their LRU order is the tree's.

CUDA streams and events (what may run when):
  - write-backs (device -> host) run on `d2h`, loads (host -> device) on `h2d`, so both
    copy engines work and neither copy blocks the model's stream; a load's scatter from its
    staging buffer into the pool's pages runs on `scatter`, overlapped with its next copy;
  - a device page written back is freed at once: the model's next step waits until the last
    write-back has gathered its pages into staging buffers (`pool.fence`, waited for by the
    runner before each step; the copies to the host go on behind it), and every later load
    waits for the whole write-back (h2d waits for `last_write`), so nothing overwrites a page
    before its copy has read it;
    a host page written back may be loaded back (or overwritten by another write-back, on
    the same stream) only after that write-back, for the same reason;
  - a load's device pages are not read before its event has completed (the scheduler
    admits the waiting request only then); its host pages stay held (the node is locked).
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch

from streamer.errors import ConfigError
from streamer.kv.pages import PagePool

STAGING_PAGES = 64
"""Device pages staged per copy on CUDA (the gather/scatter between the pool's strided
pages and a contiguous buffer the DMA moves at full speed)."""
LOAD_STAGE_BYTES = 64 << 20
"""Each of a load's two staging buffers holds at most this many bytes of pages."""
FENCE_STAGE_BYTES = 256 << 20
"""A write-back gathers up to this many bytes of pages into staging buffers before their
copies to the host start; the model's next step waits for the last group's gathers, not for
the copies (a larger write-back serializes its earlier groups' copies before that)."""


class HostPool:
    """num_pages host pages of `pool`'s format, a free list, nothing else."""

    def __init__(self, pool: PagePool, num_pages: int, pin: bool) -> None:
        self.num_pages = num_pages
        self.page_bytes = host_page_bytes(pool)
        self.data = torch.empty((num_pages, self.page_bytes), dtype=torch.uint8)
        if pin and num_pages:
            _pin(self.data)
        self._free: deque[int] = deque(range(num_pages))
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert not self._is_free[p], f"host page {p} freed twice"
            self._is_free[p] = True
            self._free.append(p)

    def check(self, held: list[int]) -> None:
        """Every host page is free or held (by exactly one node), never both."""
        assert len(set(self._free)) == len(self._free), "a host page is in the free list twice"
        assert len(set(held)) == len(held), "a host page is held twice"
        assert set(self._free) | set(held) == set(range(self.num_pages)), "a host page is lost"
        assert not set(self._free) & set(held), "a held host page is on the free list"


def pool_parts(pool: PagePool) -> list[torch.Tensor]:
    """The byte views [layers, pages, bytes] a host page holds: K and V, or K alone (a latent
    pool: V is in K), then the pool's companions."""
    own = [pool.k_bytes, pool.v_bytes] if pool.v_bytes.shape[2] else [pool.k_bytes]
    return own + list(pool.companions)


def host_page_bytes(pool: PagePool) -> int:
    return sum(part.shape[0] * part.shape[2] for part in pool_parts(pool))


def gather_pages(parts: list[torch.Tensor], pages: torch.Tensor) -> torch.Tensor:
    """The device pages `pages` of every part as host-page rows: [len(pages), host page bytes]."""
    return torch.cat([part[:, pages].transpose(0, 1).reshape(len(pages), -1) for part in parts], dim=1)


def scatter_pages(parts: list[torch.Tensor], pages: torch.Tensor, rows: torch.Tensor) -> None:
    """The inverse of gather_pages: host-page rows [len(pages), bytes] into the device pages."""
    off = 0
    for part in parts:
        layers, _, nbytes = part.shape
        part[:, pages] = rows[:, off : off + layers * nbytes].reshape(len(pages), layers, nbytes).transpose(0, 1)
        off += layers * nbytes


def _pin(t: torch.Tensor) -> None:
    """Page-lock t in place (cudaHostRegister): copies from and to it are DMA, asynchronous.
    (torch's pin_memory=True goes through its caching host allocator, which rounds a size up
    to a power of two: a 96 GiB tier would take 128.)"""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise ConfigError(f"could not pin {t.numel() * t.element_size() >> 20} MiB of host memory for "
                          f"host_kv_cache_gb (cudaHostRegister error {int(err)})")
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())


def _indices(ids: list[int], device: torch.device) -> torch.Tensor:
    """ids on the device, without a blocking copy (a pageable one would wait for the stream)."""
    return torch.tensor(ids, dtype=torch.int64).pin_memory().to(device, non_blocking=True)


def _runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """(index into pages, first page, count) of each run of consecutive page ids."""
    out: list[tuple[int, int, int]] = []
    for i, p in enumerate(pages):
        if out and out[-1][1] + out[-1][2] == p:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, p, 1))
    return out


class HostTier:
    """The host pool, the copies to and from it, and their totals."""

    def __init__(self, pool: PagePool, num_bytes: int) -> None:
        self.pool = pool
        self.cuda = pool.k.device.type == "cuda"
        self.host = HostPool(pool, max(num_bytes // host_page_bytes(pool), 0), pin=self.cuda)
        self.d2h: Any = torch.cuda.Stream(pool.k.device) if self.cuda else None
        self.h2d: Any = torch.cuda.Stream(pool.k.device) if self.cuda else None
        self.scatter: Any = torch.cuda.Stream(pool.k.device) if self.cuda else None
        """Loads scatter staged pages into the pool here while h2d copies the next chunk."""
        self._staging: list[torch.Tensor] = []
        self._staging_free: list[Any] = [None, None]
        """Per staging buffer, the event after the last scatter that read it."""
        self._next_slot = 0
        self.last_write: Any = None
        """The event after the newest write-back's copies to the host (CUDA); pool.fence is
        the one after its gathers."""
        self.write_backs = 0
        """Pages written back (device -> host)."""
        self.load_backs = 0
        """Pages loaded back (host -> device)."""
        self.bytes_written = 0
        self.bytes_loaded = 0
        self.hit_tokens = 0
        """Prompt tokens whose KV came back from the host (over admitted requests)."""

    @classmethod
    def of_size(cls, pool: PagePool, gb: float) -> HostTier | None:
        """The tier of --host-kv-cache-gb over pool (None: 0, off)."""
        if not gb:
            return None
        tier = cls(pool, int(gb * (1 << 30)))
        if tier.host.num_pages == 0:
            raise ConfigError(f"host_kv_cache_gb={gb:g} holds no KV page ({tier.host.page_bytes} bytes each)")
        return tier

    def write(self, gpu: list[int], host: list[int]) -> None:
        """Copy device pages `gpu` into host pages `host` (asynchronous on CUDA)."""
        assert len(gpu) == len(host)
        self._log(True, gpu, host)
        parts, data = pool_parts(self.pool), self.host.data
        k = parts[0]
        if not self.cuda:
            data[torch.tensor(host)] = gather_pages(parts, torch.tensor(gpu))
        else:
            read = None
            group = max(1, FENCE_STAGE_BYTES // self.host.page_bytes)
            with torch.cuda.stream(self.d2h):
                for s0 in range(0, len(gpu), group):
                    # the gathers of a group first, then its copies to the host: the next step
                    # waits for the gathers only (its kernels may then overwrite the freed
                    # pages), while the slower copies over PCIe overlap with it
                    staged = []
                    for s in range(s0, min(s0 + group, len(gpu)), STAGING_PAGES):
                        g = _indices(gpu[s : min(s + STAGING_PAGES, s0 + group)], k.device)
                        staged.append((s, gather_pages(parts, g)))
                    read = torch.cuda.Event()
                    read.record(self.d2h)
                    for s, buf in staged:
                        for i, p, n in _runs(host[s : s + buf.shape[0]]):
                            data[p : p + n].copy_(buf[i : i + n], non_blocking=True)
                self.last_write = torch.cuda.Event()
                self.last_write.record(self.d2h)
            self.pool.fence = read
        self.write_backs += len(gpu)
        self.bytes_written += len(gpu) * self.host.page_bytes

    def load(self, host: list[int], gpu: list[int]) -> Any:
        """Copy host pages `host` into device pages `gpu`. Returns the event to wait for on
        CUDA (None: done, on CPU)."""
        assert len(gpu) == len(host)
        self._log(False, gpu, host)
        event = self._load(host, gpu)
        if self.pool.tier_log is not None:
            self.pool.tier_loads.append(event)
        return event

    def _load(self, host: list[int], gpu: list[int]) -> Any:
        parts, data = pool_parts(self.pool), self.host.data
        k = parts[0]
        self.load_backs += len(gpu)
        self.bytes_loaded += len(gpu) * self.host.page_bytes
        if not self.cuda:
            scatter_pages(parts, torch.tensor(gpu), data[torch.tensor(host)])
            return None
        per = self._ring(k.device)
        with torch.cuda.stream(self.h2d):
            if self.last_write is not None:
                self.h2d.wait_event(self.last_write)
            for s in range(0, len(gpu), per):
                # double buffering: the copy of the next chunk (h2d) runs while this one is scattered
                # into its pages (on `scatter`); a buffer is refilled only after its last scatter
                slot = self._next_slot
                self._next_slot ^= 1
                buf = self._staging[slot]
                if self._staging_free[slot] is not None:
                    self.h2d.wait_event(self._staging_free[slot])
                chunk = host[s : s + per]
                for i, p, n in _runs(chunk):
                    buf[i : i + n].copy_(data[p : p + n], non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.h2d)
                self.scatter.wait_event(copied)
                with torch.cuda.stream(self.scatter):
                    scatter_pages(parts, _indices(gpu[s : s + per], k.device), buf[: len(chunk)])
                    freed = torch.cuda.Event()
                    freed.record(self.scatter)
                    self._staging_free[slot] = freed
        return self.marker()

    def _log(self, write_back: bool, gpu: list[int], host: list[int]) -> None:
        """Under tensor parallelism (pool.tier_log, rank 0): the other ranks make the same copy."""
        if self.pool.tier_log is not None:
            from streamer.frames import TierCopy

            self.pool.tier_log.append(TierCopy(write_back, list(gpu), list(host)))

    def _ring(self, device: torch.device) -> int:
        """The two staging buffers of loads, allocated at the first (pages per buffer)."""
        if not self._staging:
            per = max(1, min(STAGING_PAGES, LOAD_STAGE_BYTES // self.host.page_bytes))
            shape = (per, *self.host.data.shape[1:])
            self._staging = [torch.empty(shape, dtype=torch.uint8, device=device) for _ in range(2)]
        return int(self._staging[0].shape[0])

    def marker(self) -> Any:
        """An event after every load issued so far (None on CPU: all done). A load's last work
        is its scatter, and every scatter waits for its copy, so `scatter` orders them all."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.scatter)
        return ev

    @staticmethod
    def done(event: Any) -> bool:
        return event is None or bool(event.query())
