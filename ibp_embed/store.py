"""UpdatableTable: a compressed table whose rows can be rewritten (training).

Rows live in a log-structured arena: a rewritten row that still fits its slot is
re-encoded in place; one that grew is appended at the arena's end and its old slot
becomes dead space. Dead and slack bytes are accounted; `compact()` rewrites the
live rows back to back, and `repack()` rebuilds the masks from the current rows
(worth it when training has moved the values away from the masks' statistics).
"""
from __future__ import annotations

import numpy as np

from . import _native
from ._native import ffi, lib
from .codec import _Codebook, compress, index_nbytes, split_offsets
from .dtypes import as_rows
from .table import CompressedTable, TableReads, _as_index_array, _check_range

GROWTH = 1.125        # arena headroom when it is (re)allocated: memory vs copies
COMPACT_DEAD = 0.5    # compact instead of growing when over half the arena is dead


class UpdatableTable(TableReads):
    """A CompressedTable that accepts row updates; reads (gather, lookup,
    decompress) behave as on CompressedTable and see every update at once.

    Not thread-safe against concurrent updates: update from one thread at a time.
    """

    def __init__(self, table: CompressedTable, *, repack_drift: float | None = 0.05):
        """repack_drift: rebuild the masks automatically once the stored payload has
        grown by this fraction since the last (re)pack; None disables it."""
        self._repack_drift = repack_drift
        self._load(table)

    def _load(self, table: CompressedTable) -> None:
        self._shape, self._dtype = table.shape, table.dtype
        self._row_bytes = table._row_bytes
        self._codec_options = {"word_bits": table.word_bits, "clusters": table.clusters}
        self._book = _Codebook(self._row_bytes, table.word_bits, table._masks, table._bitvals)
        starts = table._row_starts()
        self._start = np.ascontiguousarray(starts[:-1], dtype=np.uint64)
        self._len = np.diff(starts).astype(np.uint32)
        self._slot = self._len.copy()  # bytes a row may grow to in place
        self._end = int(starts[-1])    # end of the log
        self._pad = int(lib.ibp_tail_pad(self._row_bytes, table.word_bits))
        self._arena = np.zeros(int(self._end * GROWTH) + self._pad + 64, dtype=np.uint8)
        self._arena[: self._end] = table._payload[: self._end]
        self._packed_bytes = max(self._end, 1)
        self._bind()

    def _bind(self) -> None:
        """(Re)build the C view after the arena or the index arrays were replaced."""
        c = ffi.new("ibp_table *")
        b = self._book
        c.cb = b.c[0]
        c.n_rows = self._shape[0]
        c.rel_bytes = lib.ibp_rel_bytes(self._row_bytes)
        c.payload = _native.ptr(self._arena, "const uint8_t *")
        c.payload_bytes = self._end
        c.row_start = _native.ptr(self._start, "const uint64_t *")
        c.row_len = _native.ptr(self._len, "const uint32_t *")
        c.block_base = c.row_start  # unused in arena mode; never NULL for validation
        c.rel = c.row_start
        self._c = c

    # ---- description ----
    @property
    def word_bits(self) -> int:
        return self._book.word_bits

    @property
    def clusters(self) -> int:
        return self._book.clusters

    @property
    def live_bytes(self) -> int:
        """Bytes of the rows as currently encoded."""
        return int(self._len.sum(dtype=np.uint64))

    @property
    def packed_nbytes(self) -> int:
        """nbytes of the CompressedTable that to_table() would build, without building it."""
        return int(self.live_bytes + self._pad + index_nbytes(self._shape[0], self._row_bytes)
                   + self._book.metadata_bytes())

    @property
    def dead_bytes(self) -> int:
        """Arena bytes below the log's end holding no live row (abandoned slots and slack)."""
        return self._end - self.live_bytes

    @property
    def nbytes(self) -> int:
        """Host memory held: the whole arena allocation, the row index and the masks."""
        return int(self._arena.nbytes + self._start.nbytes + self._len.nbytes + self._slot.nbytes
                   + self._book.metadata_bytes())

    def __repr__(self) -> str:
        return (f"UpdatableTable(shape={self._shape}, dtype={self._dtype}, word_bits={self.word_bits}, "
                f"clusters={self.clusters}, live={self.live_bytes}, dead={self.dead_bytes}, "
                f"ratio={self.ratio:.3f})")

    # ---- writes ----
    def update(self, ids, rows) -> None:
        """Replace rows `ids` (distinct) with `rows` ([len(ids), D], the table's dtype)."""
        idx = _as_index_array(ids, "ids").reshape(-1)
        _check_range(idx, self._shape[0])
        raw, dtype, dim = as_rows(rows, "rows")
        if dtype != self._dtype or dim != self._shape[1] or raw.shape[0] != idx.size:
            raise ValueError(f"rows must be [{idx.size}, {self._shape[1]}] of {self._dtype}, "
                             f"got [{raw.shape[0]}, {dim}] of {dtype}")
        if idx.size == 0:
            return
        # optimizers pass sorted distinct ids: one linear pass proves it, else sort
        if not np.all(idx[1:] > idx[:-1]) and np.unique(idx).size != idx.size:
            raise ValueError("ids must be distinct (aggregate the updates of a row first)")
        clusters, lengths = self._book.assign(raw)
        movers, need = self._plan(idx, lengths)
        if self._end + need + self._pad > self._arena.size:
            if self.dead_bytes > COMPACT_DEAD * self._end:
                self.compact()
                # compaction shrinks every slot to its row: re-plan who fits in place
                movers, need = self._plan(idx, lengths)
            if self._end + need + self._pad > self._arena.size:
                self._grow(need)
        starts = self._start[idx].copy()
        if movers.size:
            grown = np.cumsum(lengths[movers], dtype=np.uint64)
            starts[movers] = self._end + grown - lengths[movers]
            self._end += need
            self._slot[idx[movers]] = lengths[movers]
        _native.check(lib.ibp_encode_at(
            self._book.c, _native.ptr(raw, "const uint8_t *"), idx.size,
            _native.ptr(clusters, "const uint8_t *"), _native.ptr(starts, "const uint64_t *"),
            _native.ptr(lengths, "const uint32_t *"), _native.ptr(self._arena, "uint8_t *")), "update")
        self._start[idx] = starts
        self._len[idx] = lengths
        self._c.payload_bytes = self._end
        if self._repack_drift is not None and self.live_bytes > self._packed_bytes * (1 + self._repack_drift):
            self.repack()

    def _plan(self, idx: np.ndarray, lengths: np.ndarray):
        """(positions in idx of the rows that must move, bytes they need at the log's end)."""
        movers = np.flatnonzero(lengths > self._slot[idx])
        return movers, int(lengths[movers].sum(dtype=np.uint64))

    def _grow(self, need: int) -> None:
        size = int((self._end + need) * GROWTH) + self._pad + 64
        arena = np.zeros(size, dtype=np.uint8)
        arena[: self._end] = self._arena[: self._end]
        self._arena = arena
        self._bind()

    def compact(self) -> None:
        """Rewrite the live rows back to back in row order; dead space becomes free."""
        n = self._shape[0]
        new_start = np.zeros(n, dtype=np.uint64)
        np.cumsum(self._len[:-1], dtype=np.uint64, out=new_start[1:])
        end = self.live_bytes
        arena = np.zeros(max(int(end * GROWTH), end) + self._pad + 64, dtype=np.uint8)
        _native.check(lib.ibp_move_rows(
            _native.ptr(self._arena, "const uint8_t *"), _native.ptr(self._start, "const uint64_t *"),
            _native.ptr(self._len, "const uint32_t *"), n, _native.ptr(arena, "uint8_t *"),
            _native.ptr(new_start, "const uint64_t *")), "compact")
        self._arena, self._start, self._end = arena, new_start, end
        self._slot = self._len.copy()
        self._bind()

    def repack(self) -> None:
        """Rebuild the masks from the current rows and re-encode the whole table."""
        self._load(compress(self.decompress(), **self._codec_options))

    def to_table(self) -> CompressedTable:
        """A packed, immutable CompressedTable of the current rows (for saving)."""
        self.compact()
        offsets = np.zeros(self._shape[0] + 1, dtype=np.uint64)
        offsets[1:] = np.cumsum(self._len, dtype=np.uint64)
        block_base, rel = split_offsets(offsets, self._row_bytes)
        payload = np.zeros(self._end + self._pad, dtype=np.uint8)
        payload[: self._end] = self._arena[: self._end]
        return CompressedTable(shape=self._shape, dtype=self._dtype, word_bits=self.word_bits,
                               masks=self._book.masks, bitvals=self._book.bitvals,
                               block_base=block_base, rel=rel, payload=payload,
                               payload_bytes=self._end, validate=False)

    def save(self, path) -> None:
        self.to_table().save(path)
