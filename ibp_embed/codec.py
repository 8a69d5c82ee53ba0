"""ibp_embed.compress: build masks from bit statistics and encode every row.

Masks are chosen per word position: for each threshold t of a sweep, a bit set in
at least t of the rows (or at most 1 - t) is invariant; the native library counts
the exact bitstream bits each candidate costs at each word position and the
cheapest wins there. Costs are additive over words and every candidate costs the
same metadata, so this is the exact encoded-size minimum over the sweep (up to
per-row byte rounding), and never worse than any single global threshold.

With clusters > 1, Lloyd-style rounds alternate between assigning each sampled
row to the cluster that stores it smallest and rebuilding each cluster's masks
from its members. The result is kept only if it is smaller than one mask.
"""
from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from . import _native
from ._native import ffi, lib
from .dtypes import as_rows
from .table import CompressedTable

THRESHOLDS = (1.0, 0.99, 0.98, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55)
WORD_BITS = (16, 32, 64)
WORD_SIZE_SLACK = 0.01  # accept up to 1% more bytes for a wider, faster word
LLOYD_ROUNDS = 8
SAMPLE_ROWS = 1 << 18
CHUNK_ROWS = 1 << 20  # rows per native call while encoding (progress granularity)


def compress(weights, *, word_bits: int | None = None, clusters: int = 1,
             threshold: float | None = None, sample_rows: int = SAMPLE_ROWS, seed: int = 0,
             progress: bool | None = None) -> CompressedTable:
    """Compress a 2-D tensor or array (any 1/2/4/8-byte dtype) into a CompressedTable.

    word_bits: 16, 32 or 64; None picks the smallest encoding, preferring a wider
        word (faster to decode) when it costs at most 1% more.
    clusters: the most masks to use (1..256); fewer are kept when that is smaller.
    threshold: fix the invariance threshold (0.5 < t <= 1) instead of sweeping.
    sample_rows: rows sampled to build masks on large tables; every row is encoded exactly.
    progress: show progress bars (default: for tables over a million rows).
    """
    rows, dtype, dim = as_rows(weights)
    n_rows, row_bytes = rows.shape
    if word_bits is not None and (isinstance(word_bits, bool) or not isinstance(word_bits, (int, np.integer))
                                  or word_bits not in WORD_BITS):
        raise ValueError(f"word_bits must be one of {WORD_BITS} or None, not {word_bits!r}")
    if isinstance(clusters, bool) or not isinstance(clusters, (int, np.integer)) or not 1 <= clusters <= 256:
        raise ValueError(f"clusters must be an integer in 1..256, not {clusters!r}")
    if threshold is not None and not 0.5 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0.5, 1], not {threshold!r}")
    if isinstance(sample_rows, bool) or not isinstance(sample_rows, (int, np.integer)) or sample_rows < 1:
        raise ValueError(f"sample_rows must be a positive integer, not {sample_rows!r}")
    if lib.ibp_rel_bytes(row_bytes) == 0:
        raise ValueError(f"rows of {row_bytes} bytes are too large to index")
    if progress is None:
        progress = n_rows > CHUNK_ROWS
    thresholds = (threshold,) if threshold is not None else THRESHOLDS

    rng = np.random.default_rng(seed)
    sample = rows if n_rows <= sample_rows else rows[np.sort(rng.choice(n_rows, sample_rows, replace=False))]
    sample = np.ascontiguousarray(sample)
    # The word size is chosen with one mask (the comparison is what matters, and
    # clusters rarely change it); the clusters are then built for that size. Wider
    # words decode faster (fewer steps a row), so the widest within WORD_SIZE_SLACK
    # of the smallest encoding wins.
    sized = [(_estimate_nbytes(book, sample, n_rows), book)
             for book in (_single_codebook(sample, w, thresholds)
                          for w in ([word_bits] if word_bits else WORD_BITS))]
    smallest = min(size for size, _ in sized)
    book = max((b for size, b in sized if size <= smallest * (1 + WORD_SIZE_SLACK)),
               key=lambda b: b.word_bits)
    if clusters > 1:
        book = _lloyd(sample, book, int(clusters), thresholds)
    return _encode_table(rows, dtype, dim, book, progress)


class _Codebook:
    """Masks of one word size plus the C struct that points at them."""

    def __init__(self, row_bytes: int, word_bits: int, masks: np.ndarray, bitvals: np.ndarray):
        self.row_bytes, self.word_bits = row_bytes, word_bits
        self.masks = np.ascontiguousarray(masks, dtype=np.uint64)
        self.bitvals = np.ascontiguousarray(bitvals, dtype=np.uint64)
        self.vbits = (word_bits - np.bitwise_count(self.masks)).astype(np.uint8)
        c = ffi.new("ibp_codebook *")
        c.row_bytes, c.word_bits = row_bytes, word_bits
        c.n_words, c.n_clusters = self.masks.shape[1], self.masks.shape[0]
        c.masks = _native.ptr(self.masks, "const uint64_t *")
        c.bitvals = _native.ptr(self.bitvals, "const uint64_t *")
        c.vbits = _native.ptr(self.vbits, "const uint8_t *")
        self.c = c

    @property
    def clusters(self) -> int:
        return self.masks.shape[0]

    def assign(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(best cluster, stored length) of every row."""
        ids = np.empty(rows.shape[0], dtype=np.uint8)
        lengths = np.empty(rows.shape[0], dtype=np.uint32)
        if rows.shape[0]:
            _native.check(lib.ibp_assign(self.c, _native.ptr(rows, "const uint8_t *"), rows.shape[0],
                                         _native.ptr(ids, "uint8_t *"), _native.ptr(lengths, "uint32_t *")),
                          "assign")
        return ids, lengths

    def metadata_bytes(self) -> int:
        return 2 * self.masks.size * (self.word_bits // 8)


def _n_words(row_bytes: int, word_bits: int) -> int:
    return -(-row_bytes // (word_bits // 8))


def _best_masks(rows: np.ndarray, sel: np.ndarray | None, word_bits: int,
                thresholds) -> tuple[np.ndarray, np.ndarray]:
    """Per word position, the cheapest (mask, bitval) over the threshold sweep."""
    n_rows, row_bytes = rows.shape
    m = _n_words(row_bytes, word_bits)
    n = n_rows if sel is None else sel.size
    rows_p = _native.ptr(rows, "const uint8_t *")
    sel_p = ffi.NULL if sel is None else _native.ptr(sel, "const int64_t *")
    counts = np.zeros((m, word_bits), dtype=np.uint64)
    if n == 0:
        return np.zeros(m, np.uint64), np.zeros(m, np.uint64)
    _native.check(lib.ibp_bit_counts(rows_p, n_rows, row_bytes, word_bits, sel_p, n,
                                      _native.ptr(counts, "uint64_t *")), "bit counts")
    weights = np.uint64(1) << np.arange(word_bits, dtype=np.uint64)
    cand_m = [np.zeros(m, np.uint64)]  # the empty mask: every word stored whole
    cand_v = [np.zeros(m, np.uint64)]
    for t in thresholds:
        ones = counts >= np.ceil(t * n - 1e-9)
        zeros = counts <= np.floor((1 - t) * n + 1e-9)
        cand_m.append(((ones | zeros) * weights).sum(axis=1, dtype=np.uint64))
        cand_v.append((ones * weights).sum(axis=1, dtype=np.uint64))
    cand_m, cand_v = np.stack(cand_m), np.stack(cand_v)
    costs = np.empty(cand_m.shape, dtype=np.uint64)
    _native.check(lib.ibp_word_costs(rows_p, n_rows, row_bytes, word_bits, sel_p, n,
                                      _native.ptr(cand_m, "const uint64_t *"),
                                      _native.ptr(cand_v, "const uint64_t *"), cand_m.shape[0],
                                      _native.ptr(costs, "uint64_t *")), "word costs")
    pick = costs.argmin(axis=0)
    cols = np.arange(m)
    return cand_m[pick, cols], cand_v[pick, cols]


def _row_signature(rows: np.ndarray, word_bits: int) -> np.ndarray:
    """A per-row magnitude proxy used to seed clusters: the mean of the 8 bits below
    each word's top bit (a float's exponent, an integer's high bits)."""
    b = word_bits // 8
    padded = rows
    if rows.shape[1] % b:
        padded = np.zeros((rows.shape[0], _n_words(rows.shape[1], word_bits) * b), np.uint8)
        padded[:, : rows.shape[1]] = rows
    words = padded.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[b])
    return ((words >> (word_bits - 9)) & 0xFF).astype(np.float64).mean(axis=1)


def _single_codebook(sample: np.ndarray, word_bits: int, thresholds) -> _Codebook:
    mask, bitval = _best_masks(sample, None, word_bits, thresholds)
    return _Codebook(sample.shape[1], word_bits, mask[None], bitval[None])


def _lloyd(sample: np.ndarray, single: _Codebook, clusters: int, thresholds) -> _Codebook:
    """Up to `clusters` masks by Lloyd rounds; `single` unless that is smaller."""
    row_bytes, word_bits = sample.shape[1], single.word_bits
    k = min(clusters, sample.shape[0])
    if k <= 1:
        return single
    # Seed: quantiles of the magnitude signature; then Lloyd rounds on exact sizes.
    order = np.argsort(_row_signature(sample, word_bits), kind="stable")
    ids = np.empty(sample.shape[0], dtype=np.uint8)
    ids[order] = (np.arange(sample.shape[0]) * k // sample.shape[0]).astype(np.uint8)
    best, best_size = single, _sample_bytes(single, sample)
    for _ in range(LLOYD_ROUNDS):
        masks, bitvals = [], []
        for c in range(k):
            members = np.flatnonzero(ids == c)
            if members.size:
                mm, vv = _best_masks(sample, members, word_bits, thresholds)
                masks.append(mm)
                bitvals.append(vv)
        book = _Codebook(row_bytes, word_bits, np.stack(masks), np.stack(bitvals))
        ids, lengths = book.assign(sample)
        size = int(lengths.sum(dtype=np.uint64)) + book.metadata_bytes()
        if size >= best_size:
            break
        best, best_size = book, size
        k = book.clusters
    return best


def _sample_bytes(book: _Codebook, sample: np.ndarray) -> int:
    return int(book.assign(sample)[1].sum(dtype=np.uint64)) + book.metadata_bytes()


def _estimate_nbytes(book: _Codebook, sample: np.ndarray, n_rows: int) -> float:
    """Encoded size of the whole table, extrapolated from the sample (exact when the
    sample is the table), with its masks, offsets index and tail pad."""
    payload = book.assign(sample)[1].sum(dtype=np.uint64) * (n_rows / max(sample.shape[0], 1))
    return float(payload) + index_nbytes(n_rows, book.row_bytes) + book.metadata_bytes() + lib.ibp_tail_pad(book.row_bytes, book.word_bits)


def _encode_table(rows: np.ndarray, dtype: torch.dtype, dim: int, book: _Codebook,
                  progress: bool) -> CompressedTable:
    n_rows, row_bytes = rows.shape
    ids = np.empty(n_rows, dtype=np.uint8)
    offsets = np.zeros(n_rows + 1, dtype=np.uint64)
    chunks = range(0, n_rows, CHUNK_ROWS)
    for lo in tqdm(chunks, desc="sizing rows", unit="Mrow", disable=not progress):
        hi = min(lo + CHUNK_ROWS, n_rows)
        ids[lo:hi], lengths = book.assign(rows[lo:hi])
        offsets[lo + 1: hi + 1] = lengths
    np.cumsum(offsets, out=offsets)
    payload_bytes = int(offsets[-1])
    payload = np.zeros(payload_bytes + lib.ibp_tail_pad(row_bytes, book.word_bits), dtype=np.uint8)
    payload_p = _native.ptr(payload, "uint8_t *")
    for lo in tqdm(chunks, desc="encoding rows", unit="Mrow", disable=not progress):
        hi = min(lo + CHUNK_ROWS, n_rows)
        _native.check(lib.ibp_encode(book.c, _native.ptr(rows[lo:hi], "const uint8_t *"), hi - lo,
                                     _native.ptr(ids[lo:hi], "const uint8_t *"),
                                     _native.ptr(offsets[lo:hi + 1], "const uint64_t *"), payload_p),
                      "encode")
    block_base, rel = split_offsets(offsets, row_bytes)
    return CompressedTable(shape=(n_rows, dim), dtype=dtype, word_bits=book.word_bits,
                           masks=book.masks, bitvals=book.bitvals, block_base=block_base, rel=rel,
                           payload=payload, payload_bytes=payload_bytes, validate=False)


def index_nbytes(n_rows: int, row_bytes: int) -> int:
    """Bytes of a packed table's offsets index: block_base (u64 per 64 rows) and rel."""
    return 8 * (n_rows // 64 + 1) + int(lib.ibp_rel_bytes(row_bytes)) * (n_rows + 1)


def split_offsets(offsets: np.ndarray, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Absolute row offsets [N + 1] -> (block_base [N // 64 + 1], rel [N + 1])."""
    block_base = np.ascontiguousarray(offsets[::64])
    rel_dtype = np.uint16 if lib.ibp_rel_bytes(row_bytes) == 2 else np.uint32
    rel = (offsets - np.repeat(block_base, 64)[: offsets.size]).astype(rel_dtype)
    return block_base, rel
