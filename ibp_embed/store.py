"""UpdatableTable: a compressed table whose rows can be rewritten (training).

The rows live in libibp's store (``ibp_store_*`` in native/ibp.h): blocks of up to
64 rows, each packed with a little headroom; a block whose rows outgrow it moves
to the end of the arena, and the arena is compacted in place once the space left
behind is worth reclaiming. Headroom, abandoned space and spare capacity are each
bounded by 1/64 of the encoded rows, so the table holds a few percent more than
its packed form (``nbytes`` against ``packed_nbytes``).

``repack()`` rebuilds the masks from the current rows; it runs by itself once the
encoded rows have grown by ``repack_drift`` since the last (re)pack, as training
moves values away from the masks' statistics.

Thread safety: reads (gather, lookup, decompress) may run from any thread while
another thread writes (update, apply_gradients, compact, repack): the store's
reader/writer lock lets a read see every row either before or after a write,
never half rewritten, and never memory a write freed. Writes are serialized.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from . import _native, hostmem
from ._native import ffi, lib
from .codec import _Codebook, compress, split_offsets
from .dtypes import LOOKUP_DTYPES, as_rows
from .optim import SparseOptimizer
from .table import (_MODES, CompressedTable, TableReads, _as_float_array, _as_index_array, _check_range,
                    check_offset_ends)


class UpdatableTable(TableReads):
    """A CompressedTable that accepts row updates; reads behave as on CompressedTable
    and see every update at once."""

    def __init__(self, table: CompressedTable, *, repack_drift: float | None = 0.05,
                 codec_options: dict | None = None):
        """repack_drift: rebuild the masks automatically once the encoded rows have
        grown by this fraction since the last (re)pack (a raw table, whose rows cannot
        grow: once as many rows as it has were written); None disables it.
        codec_options: ibp_embed.compress options for repacks (default: word size
        chosen afresh, up to as many clusters as `table` has)."""
        if not isinstance(table, CompressedTable):
            raise TypeError(f"expected a CompressedTable, got {type(table).__name__}")
        self._repack_drift = repack_drift
        self._write_lock = threading.Lock()
        self._shape, self._dtype, self._row_bytes = table.shape, table.dtype, table._row_bytes
        self._codec_options = dict(codec_options if codec_options is not None else {"clusters": max(1, table.clusters)})
        self._codec_options.pop("progress", None)
        out = ffi.new("ibp_store **")
        _native.check(lib.ibp_store_create(table._c, out), "UpdatableTable")
        self._store = ffi.gc(out[0], lib.ibp_store_destroy)
        self._adopt_codebook(table)

    def _adopt_codebook(self, table: CompressedTable) -> None:
        self._book = _Codebook(self._row_bytes, table.word_bits, table.masks, table.bitvals)
        self._packed_live = max(self.info()["live_bytes"], 1)
        self._written = 0  # rows written since, for a raw table

    # ---- description ----
    def info(self) -> dict:
        """The store's figures (bytes unless named otherwise): live (encoded rows),
        slack (headroom inside blocks), dead (space of moved blocks), free (past the
        last block), arena (= the four), index, meta (masks), block_rows, moves,
        compactions."""
        i = ffi.new("ibp_store_info *")
        _native.check(lib.ibp_store_info_get(self._store, i), "info")
        return {k: int(getattr(i, k)) for k in (
            "live_bytes", "slack_bytes", "dead_bytes", "free_bytes", "arena_bytes", "index_bytes",
            "meta_bytes", "block_rows", "moves", "compactions")}

    @property
    def word_bits(self) -> int:
        return self._book.word_bits

    @property
    def clusters(self) -> int:
        return self._book.clusters

    @property
    def masks(self) -> np.ndarray:
        return self._book.masks

    @property
    def bitvals(self) -> np.ndarray:
        return self._book.bitvals

    @property
    def live_bytes(self) -> int:
        """Bytes of the rows as encoded now."""
        return self.info()["live_bytes"]

    @property
    def dead_bytes(self) -> int:
        """Arena bytes left behind by moved blocks (reclaimed by compaction)."""
        return self.info()["dead_bytes"]

    @property
    def nbytes(self) -> int:
        """Host memory held: the arena (rows, headroom, dead and free space), the
        index and the masks."""
        i = self.info()
        return i["arena_bytes"] + i["index_bytes"] + i["meta_bytes"]

    @property
    def packed_nbytes(self) -> int:
        """nbytes of the CompressedTable that to_table() would build, without building it."""
        if self._book.clusters == 0:
            return self.raw_nbytes
        return min(self.raw_nbytes, int(self._book.table_nbytes(self.live_bytes, self._shape[0])))

    def __repr__(self) -> str:
        i = self.info()
        return (f"UpdatableTable(shape={self._shape}, dtype={self._dtype}, word_bits={self.word_bits}, "
                f"clusters={self.clusters}, live={i['live_bytes']}, dead={i['dead_bytes']}, "
                f"ratio={self.ratio:.3f})")

    # ---- reads ----
    def _native_decode(self, idx, n: int, out) -> int:
        return lib.ibp_store_decode(self._store, idx, n, out)

    def _native_lookup(self, dtype: int, idx, off, n_bags: int, weights, mode: int, out) -> int:
        return lib.ibp_store_lookup(self._store, dtype, self._shape[1], idx, off, n_bags, weights, mode, out)

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
        if not np.all(idx[1:] > idx[:-1]):
            order = np.argsort(idx, kind="stable")
            idx = idx[order]
            if np.any(idx[1:] == idx[:-1]):
                raise ValueError("ids must be distinct (aggregate the updates of a row first)")
            raw = np.ascontiguousarray(raw[order])
        with self._write_lock:
            _native.check(lib.ibp_store_update(self._store, _native.ptr(idx, "const int64_t *"), idx.size,
                                               _native.ptr(raw, "const uint8_t *")), "update")
            self._maybe_repack(idx.size)

    def apply_gradients(self, optimizer: SparseOptimizer, state: dict, indices: np.ndarray,
                        offsets: np.ndarray, batch: int, grad: torch.Tensor, grad_cols,
                        weights: np.ndarray | None = None, mode: str = "sum") -> None:
        """Backward of pooled lookups into this table (float32, or float16 / bfloat16
        updated in float32 and rounded to nearest even) fused with `optimizer`'s step,
        as FBGEMM's TBE does it: feature f (of len(grad_cols)) pooled bags
        offsets[f * batch + b .. + 1] of `indices` (int64, offsets start at 0), and
        its output gradient sits at columns grad_cols[f]: of grad [batch, *] (fp32).
        `state` is optimizer.init_state's tensors for this table, updated in place."""
        if self._dtype not in LOOKUP_DTYPES:
            raise TypeError(f"training needs a float32, float16 or bfloat16 table, not {self._dtype}")
        if mode not in _MODES:
            raise ValueError(f"mode must be 'sum' or 'mean', not {mode!r}")
        grad = grad.detach().to("cpu", torch.float32).contiguous()
        if grad.dim() != 2 or grad.shape[0] != batch:
            raise ValueError(f"grad must be [{batch}, columns], got {tuple(grad.shape)}")
        cols = _as_index_array(grad_cols, "grad_cols").reshape(-1)
        if cols.size and int(cols.min()) < 0:
            raise ValueError(f"grad_cols must be columns of grad, got {int(cols.min())}")
        if cols.size and int(cols.max()) + self._shape[1] > grad.shape[1]:
            raise ValueError(f"grad has {grad.shape[1]} columns; a feature starts at column {int(cols.max())}")
        cols = cols.astype(np.uint64)
        idx = _as_index_array(indices, "indices")
        off = _as_index_array(offsets, "offsets")
        if idx.ndim != 1 or off.shape != (cols.size * batch + 1,):
            raise ValueError(f"indices must be 1-D and offsets have {cols.size} features x {batch} bags + 1 "
                             f"entries, got {idx.shape} and {off.shape}")
        check_offset_ends(off, idx.size)
        w = None if weights is None else _as_float_array(weights)
        if w is not None and w.shape != idx.shape:
            raise ValueError(f"{w.size} weights for {idx.size} ids")
        optimizer.check_state(state, *self._shape)
        opt = optimizer.c_struct(state)
        with self._write_lock:
            _native.check(lib.ibp_store_backward(
                self._store, opt, LOOKUP_DTYPES[self._dtype], cols.size, batch,
                _native.ptr(idx, "const int64_t *") if idx.size else ffi.NULL,
                _native.ptr(off, "const int64_t *"),
                ffi.NULL if w is None else _native.ptr(w, "const float *"), _MODES[mode],
                ffi.cast("const float *", grad.data_ptr()), grad.shape[1],
                _native.ptr(cols, "const uint64_t *") if cols.size else ffi.NULL), "backward")
            self._maybe_repack(idx.size)

    def apply_row_gradients(self, optimizer: SparseOptimizer, state: dict, ids: np.ndarray,
                            row_grads: torch.Tensor) -> None:
        """`optimizer`'s step on rows `ids` whose gradients were already reduced (row_grads
        [len(ids), dim] float32, e.g. on a GPU): each row is a bag of one, so the step is
        apply_gradients' own (an id given twice gets the sum of its two gradients)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not ids.size:
            return
        self.apply_gradients(optimizer, state, ids, np.arange(ids.size + 1, dtype=np.int64), ids.size,
                             row_grads, [0])

    def compact(self) -> None:
        """Move the blocks back to back: dead space becomes free, headroom is trimmed."""
        with self._write_lock:
            _native.check(lib.ibp_store_compact(self._store), "compact")

    def _maybe_repack(self, written: int) -> None:
        """written: ids just written (an upper bound on the rows)."""
        if self._repack_drift is None:
            return
        if self._book.clusters == 0:  # raw rows cannot grow: try encoding again after a table's worth
            self._written += written
            if self._written >= self._shape[0]:
                self._repack()
        elif self.live_bytes > self._packed_live * (1 + self._repack_drift):
            self._repack()

    def repack(self) -> None:
        """Rebuild the masks from the current rows and re-encode the whole table."""
        with self._write_lock:
            self._repack()

    def _repack(self) -> None:
        table = compress(self.decompress(), **self._codec_options)
        _native.check(lib.ibp_store_reset(self._store, table._c), "repack")
        self._adopt_codebook(table)

    def to_table(self) -> CompressedTable:
        """A packed, immutable CompressedTable of the current rows (for saving)."""
        n = self._shape[0]
        with self._write_lock:
            pad = int(lib.ibp_tail_pad(self._row_bytes, self.word_bits))
            offsets = np.zeros(n + 1, dtype=np.uint64)
            payload = hostmem.zeros(self.live_bytes + pad)
            _native.check(lib.ibp_store_export(self._store, _native.ptr(offsets, "uint64_t *"),
                                               _native.ptr(payload, "uint8_t *"), payload.size), "export")
            book = self._book
        if book.clusters == 0:  # every row raw, back to back
            return CompressedTable.raw(payload[: n * self._row_bytes].reshape(n, self._row_bytes),
                                       self._dtype, self._shape[1], book.word_bits)
        block_base, rel = split_offsets(offsets, self._row_bytes)
        table = CompressedTable(shape=self._shape, dtype=self._dtype, word_bits=book.word_bits,
                                masks=book.masks, bitvals=book.bitvals, block_base=block_base, rel=rel,
                                payload=payload, payload_bytes=int(offsets[-1]), validate=False)
        if table.nbytes >= table.raw_nbytes:  # rows that training moved off the masks
            return CompressedTable.raw(as_rows(table.decompress())[0], self._dtype, self._shape[1],
                                       book.word_bits)
        return table

    def save(self, path) -> None:
        self.to_table().save(path)


def memory_stats(tables) -> dict:
    """Host memory of tables (CompressedTable or UpdatableTable), in bytes:

    raw_bytes: uncompressed; compressed_bytes: held now (nbytes); packed_bytes: as
    CompressedTables (what a checkpoint holds, what to_table() builds);
    of UpdatableTables: live_bytes (encoded rows), slack_bytes (headroom in blocks),
    dead_bytes (left by moved blocks), free_bytes (allocated past the last block) and
    index_bytes (2 bytes a row + 16 a block)."""
    out = dict.fromkeys(("raw_bytes", "compressed_bytes", "packed_bytes", "live_bytes", "slack_bytes",
                         "dead_bytes", "free_bytes", "index_bytes"), 0)
    for t in tables:
        out["raw_bytes"] += t.raw_nbytes
        out["compressed_bytes"] += t.nbytes
        if isinstance(t, UpdatableTable):
            i = t.info()
            for k in ("live_bytes", "slack_bytes", "dead_bytes", "free_bytes", "index_bytes"):
                out[k] += i[k]
            out["packed_bytes"] += t.packed_nbytes
        else:
            out["packed_bytes"] += t.nbytes
    return out
