"""RowCache: a fixed-capacity cache of hot decoded rows in front of a compressed table.

The embedding cache service of the GPU path: decoded rows live in a tensor on
the cache's device (HBM on a GPU; any device works, and the tests use a CPU
tensor standing for device memory), in front of a table that can gather rows:
a :class:`~ibp_embed.table.CompressedTable` (host decoder) or a
:class:`~ibp_embed.cuda.CudaTable` (rows decoded on the GPU from pinned host
memory). A lookup deduplicates its ids, serves the cached ones from the cache
tensor, gathers the missing ones from the table once each, admits them
(evicting by policy) and pools, all with vectorised torch ops.

Capacity is a fraction of the table's rows, like FBGEMM's ``cache_load_factor``
(default 0.2), or a number of rows. Policies:

- ``"lru"``: evict the rows least recently used (batch granularity; ties by
  slot). Every missed row of a batch is admitted (at most ``capacity``).
- ``"lfu"``: every row's access count is kept (over all lookups, cached or
  not, as FBGEMM's LFU does); evict the cached rows with the smallest counts
  (ties: least recently used), and admit a missed row only when its count is
  larger than that of the row it would evict.

Counters: ``hits``/``misses`` count distinct ids per batch (a row named k times
in one batch is one hit or one miss: it is fetched at most once), and
``index_hits``/``index_misses`` count every index. :meth:`prefetch` fetches
the next batch's missing rows ahead of its lookup (on a CUDA device it runs on
a side stream, and the next lookup waits for it).

Memory: besides the cached rows, a row -> slot map (4 bytes a table row), per
slot its row and last use (16 bytes a slot), and for LFU the access counts
(8 bytes a table row). Not thread-safe.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .dtypes import LOOKUP_DTYPES
from .table import _as_float_array, check_real_weights

POLICIES = ("lru", "lfu")
_MODES = ("sum", "mean")


class RowCache:
    """Hot decoded rows of `table` in a tensor on `device` (see the module docstring)."""

    def __init__(self, table, *, load_factor: float = 0.2, capacity: int | None = None,
                 policy: str = "lru", device=None):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
        from .store import UpdatableTable

        if isinstance(table, UpdatableTable):  # its rows change under the cache
            raise TypeError("RowCache needs an immutable table; an UpdatableTable's rows change "
                            "and the cache would serve stale rows")
        n_rows, dim = (int(s) for s in table.shape)
        if capacity is None:
            if not 0.0 <= load_factor:
                raise ValueError(f"load_factor must be >= 0, not {load_factor!r}")
            capacity = int(load_factor * n_rows)
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, not {capacity}")
        capacity = min(int(capacity), n_rows)
        self.table = table
        self.policy = policy
        self.capacity = capacity
        self._n_rows, self._dim = n_rows, dim
        self._dtype = table.dtype
        self.device = torch.device(device) if device is not None else \
            torch.device(getattr(table, "device", "cpu"))
        self._source_device = torch.device(getattr(table, "device", "cpu"))
        dev = self.device
        self.rows = torch.zeros((capacity, dim), dtype=self._dtype, device=dev)
        self.slot_of = torch.full((n_rows,), -1, dtype=torch.int32, device=dev)
        self.slot_row = torch.full((capacity,), -1, dtype=torch.int64, device=dev)
        self.last_used = torch.full((capacity,), -1, dtype=torch.int64, device=dev)
        self.freq = torch.zeros(n_rows if policy == "lfu" else 0, dtype=torch.int64, device=dev)
        self._slots = torch.arange(capacity, dtype=torch.int64, device=dev)
        self.tick = 0
        self._side_stream = None
        self._prefetch_event = None
        self.reset_stats()

    # ---- description ----
    @property
    def shape(self) -> tuple[int, int]:
        return (self._n_rows, self._dim)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def nbytes(self) -> int:
        """Device bytes of the cache: rows, slot map, slot state, LFU counts."""
        return sum(t.numel() * t.element_size() for t in
                   (self.rows, self.slot_of, self.slot_row, self.last_used, self.freq, self._slots))

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses) over distinct ids per batch (0.0 before any lookup)."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def stats(self) -> dict:
        return {k: getattr(self, k) for k in
                ("lookups", "requests", "hits", "misses", "index_hits", "index_misses",
                 "inserts", "evictions", "prefetched")} | {"hit_rate": self.hit_rate}

    def reset_stats(self) -> None:
        self.lookups = self.requests = 0
        self.hits = self.misses = self.index_hits = self.index_misses = 0
        self.inserts = self.evictions = self.prefetched = 0

    def cached_rows(self) -> torch.Tensor:
        """Table rows now in the cache, ascending."""
        rows = self.slot_row[self.slot_row >= 0]
        return torch.sort(rows).values

    def __repr__(self) -> str:
        return (f"RowCache(capacity={self.capacity} of {self._n_rows} rows, policy={self.policy!r}, "
                f"device={self.device}, hit_rate={self.hit_rate:.3f})")

    # ---- reads ----
    def gather(self, indices) -> torch.Tensor:
        """Rows at `indices` (any shape), bit-exact, through the cache: on the cache's device."""
        idx = self._indices(indices)
        flat = idx.reshape(-1)
        self._check_range(flat)
        self._wait_prefetch()
        if not flat.numel():
            return torch.empty((*idx.shape, self._dim), dtype=self._dtype, device=self.device)
        uniq, inv, counts = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
        rows = self._serve(uniq, counts, flat.numel())
        return rows[inv].reshape(*idx.shape, self._dim)

    def lookup(self, indices, offsets, per_sample_weights=None, mode: str = "sum") -> torch.Tensor:
        """Pooled lookup through the cache, as CompressedTable.lookup: [B, D] float32 on the device."""
        if self._dtype not in LOOKUP_DTYPES:
            raise TypeError(f"pooled lookup needs a float32, float16 or bfloat16 table, not {self._dtype}")
        if mode not in _MODES:
            raise ValueError(f"mode must be 'sum' or 'mean', not {mode!r}")
        idx = self._indices(indices)
        if idx.dim() != 1:
            raise ValueError("indices must be 1-D")
        off = self._indices(offsets, "offsets")
        if off.dim() != 1 or off.numel() < 1:
            raise ValueError("offsets must be 1-D with B + 1 entries")
        first, last = int(off[0]), int(off[-1])
        if first != 0 or last != idx.numel():
            raise ValueError(f"offsets must start at 0 and end at len(indices) = {idx.numel()}, "
                             f"got {first} .. {last}")
        if off.numel() > 1 and bool((off[1:] < off[:-1]).any()):
            raise ValueError("offsets must be non-decreasing")
        self._check_range(idx)
        w = None
        if per_sample_weights is not None:
            w = per_sample_weights
            if isinstance(w, torch.Tensor):
                check_real_weights(w)
            else:
                w = torch.from_numpy(_as_float_array(w))
            w = w.to(self.device, torch.float32).reshape(-1)
            if w.numel() != idx.numel():
                raise ValueError(f"per_sample_weights has {w.numel()} entries, indices {idx.numel()}")
        self._wait_prefetch()
        n_bags = off.numel() - 1
        if not idx.numel():
            return torch.zeros((n_bags, self._dim), dtype=torch.float32, device=self.device)
        uniq, inv, counts = torch.unique(idx, sorted=True, return_inverse=True, return_counts=True)
        rows = self._serve(uniq, counts, idx.numel())
        return _pool(rows, inv, off, w, mode)

    __call__ = lookup

    def prefetch(self, next_indices) -> None:
        """Bring the rows of a coming batch into the cache ahead of its lookup.

        Counts nothing as a hit or miss and no access for LFU (the lookup will);
        admission uses the counts the rows will have after that batch. On a CUDA
        device the work is queued on a side stream, which the next lookup or
        gather waits for.
        """
        idx = self._indices(next_indices).reshape(-1)
        self._check_range(idx)
        if not idx.numel() or not self.capacity:
            return
        if self.device.type == "cuda":
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(self.device)
            main = torch.cuda.current_stream(self.device)
            self._side_stream.wait_stream(main)  # the cache state as the main stream left it
            with torch.cuda.stream(self._side_stream):
                self._prefetch(idx)
                self._prefetch_event = torch.cuda.Event()
                self._prefetch_event.record(self._side_stream)
        else:
            self._prefetch(idx)

    # ---- internals ----
    def _indices(self, x, name: str = "indices") -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            a = np.asarray(x)
            if a.size and a.dtype.kind not in "iu":
                raise TypeError(f"{name} must be integers, got {a.dtype}")
            x = torch.as_tensor(a.astype(np.int64, copy=False))
        elif x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must be integers, got {x.dtype}")
        return x.to(self.device, torch.int64)

    def _check_range(self, idx: torch.Tensor) -> None:
        if idx.numel():
            bad = (idx < 0) | (idx >= self._n_rows)
            if bool(bad.any()):
                raise IndexError(f"row index {int(idx[bad][0])} out of range for a table of "
                                 f"{self._n_rows} rows")

    def _wait_prefetch(self) -> None:
        if self._prefetch_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._prefetch_event)
            self._prefetch_event = None

    def _fetch(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (distinct, on the cache's device) gathered from the table."""
        src = ids if ids.device == self._source_device else ids.to(self._source_device)
        rows = self.table.gather(src)
        return rows.to(self.device, non_blocking=True)

    def _serve(self, uniq: torch.Tensor, counts: torch.Tensor, n_indices: int) -> torch.Tensor:
        """Rows of the distinct ids `uniq`: hits from the cache, misses fetched and admitted."""
        self.tick += 1
        tick = self.tick
        self.lookups += 1
        self.requests += n_indices
        if self.policy == "lfu":
            self.freq[uniq] += counts  # uniq is distinct: no repeated index in the update
        if self.capacity:
            slots = self.slot_of[uniq].to(torch.int64)
        else:
            slots = torch.full_like(uniq, -1)
        hit = slots >= 0
        n_hit = int(hit.sum())
        n_idx_hit = int(counts[hit].sum()) if n_hit else 0
        self.hits += n_hit
        self.misses += uniq.numel() - n_hit
        self.index_hits += n_idx_hit
        self.index_misses += n_indices - n_idx_hit
        rows = torch.empty((uniq.numel(), self._dim), dtype=self._dtype, device=self.device)
        if n_hit:
            hs = slots[hit]
            rows[hit] = self.rows[hs]
            self.last_used[hs] = tick  # used by this batch: evicted last
        if n_hit < uniq.numel():
            miss = ~hit
            ids = uniq[miss]
            fetched = self._fetch(ids)
            rows[miss] = fetched
            self._admit(ids, fetched, tick, self.freq[ids] if self.policy == "lfu" else None)
        return rows

    def _prefetch(self, idx: torch.Tensor) -> None:
        uniq, counts = torch.unique(idx, sorted=True, return_counts=True)
        slots = self.slot_of[uniq].to(torch.int64)
        hit = slots >= 0
        self.last_used[slots[hit]] = self.tick + 1  # needed by the next batch: keep them
        miss = ~hit
        if not bool(miss.any()):
            return
        ids = uniq[miss]
        prio = self.freq[ids] + counts[miss] if self.policy == "lfu" else None
        fetched = self._fetch(ids)
        self.prefetched += self._admit(ids, fetched, self.tick + 1, prio)

    def _victims(self, k: int) -> torch.Tensor:
        """The k slots to fill next, in eviction order: empty ones first, then by policy."""
        lru_key = self.last_used * self.capacity + self._slots  # empty slots: negative, first
        if self.policy == "lru":
            return torch.topk(lru_key, k, largest=False, sorted=True).indices
        occupied = self.slot_row >= 0
        f = torch.where(occupied, self.freq[self.slot_row.clamp(min=0)], torch.full_like(self.slot_row, -1))
        order = torch.argsort(lru_key)
        order = order[torch.argsort(f[order], stable=True)]
        return order[:k]

    def _admit(self, ids: torch.Tensor, rows: torch.Tensor, tick: int, prio) -> int:
        """Insert rows `ids` (distinct, not cached), evicting by policy; returns how many went in."""
        if not self.capacity or not ids.numel():
            return 0
        if prio is not None:  # LFU: the most frequent candidates first
            order = torch.argsort(prio, descending=True, stable=True)
            ids, rows, prio = ids[order], rows[order], prio[order]
        k = min(ids.numel(), self.capacity)
        ids, rows = ids[:k], rows[:k]
        victims = self._victims(k)
        old = self.slot_row[victims]
        if prio is not None:  # admit only over a less frequent row (or into an empty slot)
            old_f = torch.where(old >= 0, self.freq[old.clamp(min=0)], torch.full_like(old, -1))
            ok = prio[:k] > old_f
            ids, rows, victims, old = ids[ok], rows[ok], victims[ok], old[ok]
        evicted = old >= 0
        self.slot_of[old[evicted]] = -1
        self.evictions += int(evicted.sum())
        self.slot_of[ids] = victims.to(torch.int32)
        self.slot_row[victims] = ids
        self.rows[victims] = rows
        self.last_used[victims] = tick
        self.inserts += int(ids.numel())
        return int(ids.numel())


def _pool(rows: torch.Tensor, inv: torch.Tensor, offsets: torch.Tensor, weights, mode: str) -> torch.Tensor:
    """Bag b pools rows[inv[p]] for p in offsets[b]..offsets[b+1], as libibp does: sums in fp32,
    weighted by per-sample weights, MEAN scaled by 1/bag size, empty bags zero."""
    out = F.embedding_bag(inv, rows.float(), offsets, mode="sum", per_sample_weights=weights,
                          include_last_offset=True)
    if mode == "mean":
        sizes = (offsets[1:] - offsets[:-1]).clamp(min=1).to(torch.float32)
        out = out * (1.0 / sizes)[:, None]
    return out
