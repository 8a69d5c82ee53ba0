"""ibp_embed.compress: build masks from bit statistics and encode every row.

Masks are chosen per word position: for each threshold t of a sweep, a bit set in
at least t of the rows (or at most 1 - t) is invariant; the native library counts
the exact bitstream bits each candidate costs at each word position and the
cheapest wins there. Costs are additive over words and every candidate costs the
same metadata, so this is the exact encoded-size minimum over the sweep (up to
per-row byte rounding), and never worse than any single global threshold.

With clusters > 1, clusters grow from one mask by greedy splits (_grow, _split:
a new mask is seeded from the rows the old one stores worst, or by magnitude;
small tables also try clusters seeded at magnitude quantiles), then Lloyd-style
rounds alternate between assigning each row to the cluster that stores it
smallest and refitting each cluster's masks to its members. The result is kept
only if it is smaller than one mask.

A table whose encoding (with its masks, offsets index and tail pad) would not be
smaller than its rows is stored raw instead (format version 2), so compressing
never makes a table larger.
"""
from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from . import _native, hostmem
from ._native import ffi, lib
from .dtypes import as_rows
from .table import CompressedTable

THRESHOLDS = (1.0, 0.99, 0.98, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55)
WORD_BITS = (16, 32, 64)
WORD_SIZE_SLACK = 0.01  # accept up to 1% more bytes for a wider, faster word
WIDE_WORD_MIN_WHOLE = 0.5  # ... not W = 64 with fewer rows whole or raw (_pick_word_size)
WHOLE_SHARE_CHUNK_BYTES = 1 << 26  # sample rows compared with the masks at a time
LLOYD_ROUNDS = 8  # refit-and-reassign rounds (they stop once no gain)
SPLIT_ROUNDS = 8  # 2-means rounds when splitting one cluster (they stop once no gain)
MIN_GAIN = 1e-4  # a split or refit round must shrink its rows by this fraction
GROW_PATIENCE = 2  # greedy splits stop after this many kept in a row without an exact gain
QUANTILE_MAX = 4  # small tables also try 2..4 clusters seeded at magnitude quantiles
QUANTILE_ROWS = 1 << 13  # tables this small (where masks weigh)
SPLIT_SEED_DIV = 32  # a split may seed its new mask from the 1/32 of rows stored worst
SAMPLE_ROWS = 1 << 18
SEARCH_ROWS = 1 << 14  # rows the cluster search runs on (masks need few rows)
CHUNK_ROWS = 1 << 20  # rows per native call while encoding (progress granularity)


def compress(weights, *, word_bits: int | None = None, clusters: int = 1,
             threshold: float | None = None, sample_rows: int = SAMPLE_ROWS, seed: int = 0,
             progress: bool | None = None, allow_raw: bool = True) -> CompressedTable:
    """Compress a 2-D tensor or array (any 1/2/4/8-byte dtype) into a CompressedTable.

    word_bits: 16, 32 or 64; None picks the smallest encoding, preferring a wider
        word (faster to decode) when it costs at most 1% more; W = 64 gives way to a
        narrower word that encodes no larger when under half its rows are stored whole
        (every word keeping its invariant bits) or raw.
    clusters: the most masks to use (1..256); fewer are kept when that is smaller.
    threshold: fix the invariance threshold (0.5 < t <= 1) instead of sweeping.
    sample_rows: rows sampled to build masks on large tables; every row is encoded exactly.
    progress: show progress bars (default: for tables over a million rows).
    allow_raw: store the table raw (CompressedTable.is_raw) when encoding it would not
        make it smaller, so that it never grows; False always encodes.
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
    # clusters rarely change it); the clusters are then built for that size.
    book = _pick_word_size([_single_codebook(sample, w, thresholds)
                            for w in ([word_bits] if word_bits else WORD_BITS)], sample, n_rows)
    if clusters > 1:
        book = _lloyd(sample, book, int(clusters), thresholds, rng, n_rows)
    return _encode_table(rows, dtype, dim, book, progress, allow_raw)


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

    def table_nbytes(self, payload_bytes: float, n_rows: int) -> float:
        """nbytes of an encoded table of n_rows with this codebook (docs/format.md "Size"):
        payload, tail pad, offsets index and masks."""
        return (payload_bytes + lib.ibp_tail_pad(self.row_bytes, self.word_bits)
                + index_nbytes(n_rows, self.row_bytes) + self.metadata_bytes())


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


def _as_words(rows: np.ndarray, word_bits: int) -> np.ndarray:
    """The rows' M words each (little-endian, zero-padded past the row, as the format's
    "Table and words")."""
    b = word_bits // 8
    padded = rows
    if rows.shape[1] % b:
        padded = np.zeros((rows.shape[0], _n_words(rows.shape[1], word_bits) * b), np.uint8)
        padded[:, : rows.shape[1]] = rows
    return padded.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[b])


def _row_signature(rows: np.ndarray, word_bits: int) -> np.ndarray:
    """A per-row magnitude proxy used to seed clusters: the mean of the 8 bits below
    each word's top bit (a float's exponent, an integer's high bits)."""
    words = _as_words(rows, word_bits)
    return ((words >> (word_bits - 9)) & 0xFF).astype(np.float64).mean(axis=1)


def _single_codebook(sample: np.ndarray, word_bits: int, thresholds) -> _Codebook:
    mask, bitval = _best_masks(sample, None, word_bits, thresholds)
    return _Codebook(sample.shape[1], word_bits, mask[None], bitval[None])


def _fit(sample: np.ndarray, ids: np.ndarray, k: int, word_bits: int, thresholds) -> _Codebook:
    """Masks of every non-empty cluster 0..k-1 from its members (empty ones dropped)."""
    fits = [_best_masks(sample, m, word_bits, thresholds)
            for m in (np.flatnonzero(ids == c) for c in range(k)) if m.size]
    masks, bitvals = zip(*fits)
    return _Codebook(sample.shape[1], word_bits, np.stack(masks), np.stack(bitvals))


def _size(book: _Codebook, rows: np.ndarray, meta_weight: float | None = None):
    """(size of `rows` under `book`, their clusters, their stored lengths).

    With meta_weight, the exact size: the rows' bytes plus meta_weight times the
    masks' (rows / table rows: the table pays for its masks once). Without, the size
    that splits and refits are judged by: only the bits masks change, leaving out the
    cluster-id byte of every non-raw row and the masks, which no single split of a
    small table may pay for (four populations may need two splits before one pays)."""
    ids, lengths = book.assign(rows)
    size = int(lengths.sum(dtype=np.uint64))
    if meta_weight is not None:
        return size + meta_weight * book.metadata_bytes(), ids, lengths
    if book.clusters > 1:
        size -= int(np.count_nonzero(lengths < rows.shape[1]))
    return size, ids, lengths


def _split(rows: np.ndarray, book: _Codebook, c: int, lengths: np.ndarray, sig: np.ndarray,
           thresholds) -> _Codebook | None:
    """Cluster c of `book` as two masks fitted to `rows` (its members, stored `lengths`
    long), or None.

    The new mask is seeded from the rows stored worst (a minority the old mask fails;
    halves cut at a median tend to get the same masks and collapse back into one),
    and separately from the rows above the median magnitude signature (populations
    of different magnitudes). The old mask and the seed then compete for the rows,
    2-means on stored sizes; the smallest pair over both seeds wins."""
    cut = np.quantile(lengths, 1 - 1 / SPLIT_SEED_DIV)
    worst = np.flatnonzero(lengths > cut)
    if worst.size == 0:  # lengths are whole bytes: many rows tie
        worst = np.flatnonzero(lengths >= cut)
    best, best_size = None, None
    for seed in (worst, np.flatnonzero(sig > np.median(sig))):
        if seed.size == 0:
            continue
        seed_m, seed_v = _best_masks(rows, seed, book.word_bits, thresholds)
        two = _Codebook(rows.shape[1], book.word_bits, np.stack([book.masks[c], seed_m]),
                        np.stack([book.bitvals[c], seed_v]))
        last = None
        for _ in range(SPLIT_ROUNDS):
            if two.clusters < 2:  # one side emptied
                break
            size, ids, _ = _size(two, rows)
            if best is None or size < best_size:
                best, best_size = two, size
            if last is not None and size > last * (1 - MIN_GAIN):
                break  # converged: later rounds creep by bytes on small clusters
            last = size
            two = _fit(rows, ids, 2, book.word_bits, thresholds)
    return best


def _lloyd(sample: np.ndarray, single: _Codebook, clusters: int, thresholds, rng, n_rows: int) -> _Codebook:
    """Up to `clusters` masks, searched on at most SEARCH_ROWS rows of the sample;
    `single` unless that is smaller on the sample.

    Candidates, each refined by Lloyd rounds: greedy splits (_grow: finds a minority
    that pays for a mask of its own, and K masks only add to what fewer found), and
    in small tables, for q = 2..min(K, QUANTILE_MAX), q clusters seeded at magnitude
    quantiles (as before: finds populations whose masks pay only all together). A
    larger K tries what a smaller one does and more (the same greedy path, further),
    so it seldom ends up larger."""
    k = min(clusters, sample.shape[0])
    if k <= 1:
        return single
    n = sample.shape[0]
    rows = sample if n <= SEARCH_ROWS else sample[np.sort(rng.choice(n, SEARCH_ROWS, replace=False))]
    sig = _row_signature(rows, single.word_bits)
    found = [_grow(rows, single, k, sig, thresholds, rows.shape[0] / n_rows)]
    rank = np.empty(rows.shape[0], dtype=np.int64)
    rank[np.argsort(sig, kind="stable")] = np.arange(rows.shape[0])
    found += [_fit(rows, rank * q // rows.shape[0], q, single.word_bits, thresholds)
              for q in range(2, min(k, QUANTILE_MAX) + 1) if n_rows <= QUANTILE_ROWS]
    found = [_refine(rows, b, thresholds) for b in found if b is not single]
    best = min([single, *found], key=lambda b: _size(b, rows, rows.shape[0] / n_rows)[0])  # ties: one mask
    if rows is sample or best is single:
        return best
    # Searched on a subsample: keep it only if it is smaller on the whole sample too.
    return best if _size(best, sample, n / n_rows)[0] < _size(single, sample, n / n_rows)[0] else single


def _grow(rows: np.ndarray, single: _Codebook, k: int, sig: np.ndarray, thresholds,
          meta_weight: float) -> _Codebook:
    """Greedy splits from one mask; returns the exactly smallest book on the way.

    Splits the cluster storing the most bytes (else the next) and keeps the split when
    the rows shrink (by MIN_GAIN, _size without ids and masks): K masks only add to
    what fewer found. (Seeding K clusters at once at magnitude quantiles, as before,
    often collapsed back into one mask at small K: K=4 found nothing on a trained
    table where K=16 saved 2%.) The halves of a kept split may split again; a cluster
    that failed is not retried (the other masks do not change here), and the search
    stops after GROW_PATIENCE kept splits without an exact gain."""
    book = single
    size, ids, lengths = _size(single, rows)
    best, best_exact, stale = single, _size(single, rows, meta_weight)[0], 0
    done = np.zeros(1, bool)
    while book.clusters < k and not done.all() and stale < GROW_PATIENCE:
        stored = np.bincount(ids, weights=lengths, minlength=book.clusters)
        c = int(np.argmax(np.where(done, -1.0, stored)))
        members = np.flatnonzero(ids == c)
        two = _split(rows[members], book, c, lengths[members], sig[members], thresholds) \
            if members.size > 1 else None
        if two is not None:
            keep = np.arange(book.clusters) != c
            new = _Codebook(rows.shape[1], book.word_bits, np.concatenate([book.masks[keep], two.masks]),
                            np.concatenate([book.bitvals[keep], two.bitvals]))
            new_size, new_ids, new_lengths = _size(new, rows)
            if new_size < size * (1 - MIN_GAIN):
                book, size, ids, lengths = new, new_size, new_ids, new_lengths
                done = np.concatenate([done[keep], [False, False]])
                exact = int(lengths.sum(dtype=np.uint64)) + meta_weight * book.metadata_bytes()
                best, best_exact, stale = (book, exact, 0) if exact < best_exact else \
                    (best, best_exact, stale + 1)
                continue
        done[c] = True
    return best


def _refine(rows: np.ndarray, book: _Codebook, thresholds) -> _Codebook:
    """Lloyd rounds: reassign every row to its smallest cluster and refit every
    cluster to its members, while the rows shrink."""
    size, ids, _ = _size(book, rows)
    for _ in range(LLOYD_ROUNDS if book.clusters > 1 else 0):
        new = _fit(rows, ids, book.clusters, book.word_bits, thresholds)
        new_size, new_ids, _ = _size(new, rows)
        if new_size < size:
            book = new
        if new_size > size * (1 - MIN_GAIN):
            break
        size, ids = new_size, new_ids
    return book


def _estimate_nbytes(book: _Codebook, lengths: np.ndarray, n_rows: int) -> float:
    """Encoded size of the whole table, extrapolated from the stored lengths of a
    sample of its rows (book.assign; exact when the sample is the table), with its
    masks, offsets index and tail pad."""
    payload = lengths.sum(dtype=np.uint64) * (n_rows / max(lengths.size, 1))
    return book.table_nbytes(float(payload), n_rows)


def _whole_share(book: _Codebook, sample: np.ndarray, lengths: np.ndarray) -> float:
    """The share of the sample's rows that a single-mask book stores whole (every word
    keeps its invariant bits) or raw (a copy to decode), as opposed to rows with some
    word stored raw; lengths: their stored lengths (book.assign). Counted by the words,
    not the lengths (a word out may fit in the last byte's spare bits), a chunk of
    rows at a time (the sample may be hundreds of MB)."""
    assert book.clusters == 1
    if not lengths.size:
        return 1.0
    mask, bitval = book.masks[0], book.bitvals[0]
    step = max(1, WHOLE_SHARE_CHUNK_BYTES // sample.shape[1])
    fast = 0
    for lo in range(0, sample.shape[0], step):
        words = _as_words(sample[lo:lo + step], book.word_bits)
        whole = ((words & mask.astype(words.dtype)) == bitval.astype(words.dtype)).all(axis=1)
        fast += int(np.count_nonzero(whole | (lengths[lo:lo + step] == book.row_bytes)))
    return fast / lengths.size


def _pick_word_size(books: list[_Codebook], sample: np.ndarray, n_rows: int) -> _Codebook:
    """The single-mask codebook to build on: the widest word within WORD_SIZE_SLACK of
    the smallest encoding, as wider words decode faster (fewer steps a row). But W = 64
    is fast only on rows stored whole (or raw): a row with a word stored raw takes the
    general step for each such word (the x86-64-v3 decoders take every W = 16 and 32
    word a lane of its own, whole or not). So where a narrower word within the slack
    encodes no larger and under WIDE_WORD_MIN_WHOLE of W = 64's rows are whole or raw
    (_whole_share, the single mask's, before any clusters are fitted), W = 64 gives way
    to the widest narrower word within the slack: fp16 d64 rows of the quick set's
    22k-row table (under 1% whole at W = 64, W = 32 0.7% smaller) decoded in 35.8 ns
    a row at W = 32 against 48.6 at W = 64, and B4096 x P20 lookups took 0.81-0.85x
    the time (x86-64-v3 kernels, Zen 3)."""
    sized = [(_estimate_nbytes(b, lengths, n_rows), b, lengths)
             for b, lengths in ((b, b.assign(sample)[1]) for b in books)]
    smallest = min(size for size, _, _ in sized)
    near = [(size, b, lengths) for size, b, lengths in sized if size <= smallest * (1 + WORD_SIZE_SLACK)]

    def gives_way(size, b, lengths) -> bool:
        return (b.word_bits == 64 and any(s <= size for s, other, _ in near if other.word_bits < 64)
                and _whole_share(b, sample, lengths) < WIDE_WORD_MIN_WHOLE)

    return max((b for size, b, lengths in near if not gives_way(size, b, lengths)), key=lambda b: b.word_bits)


def _encode_table(rows: np.ndarray, dtype: torch.dtype, dim: int, book: _Codebook,
                  progress: bool, allow_raw: bool) -> CompressedTable:
    """Every row sized, then encoded; or, with allow_raw, the raw table when the encoded
    one (masks, index and tail pad included) would not be smaller (decided before
    encoding: nothing is encoded in vain)."""
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
    if allow_raw and book.table_nbytes(payload_bytes, n_rows) >= n_rows * row_bytes:  # masks, index and pad outweigh the savings
        return CompressedTable.raw(rows, dtype, dim, book.word_bits)
    payload = hostmem.zeros(payload_bytes + lib.ibp_tail_pad(row_bytes, book.word_bits))
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
    """Absolute row offsets [N + 1] -> (block_base [N // 64 + 1], rel [N + 1]); rel, which
    a lookup reads at each row, on huge pages where large (hostmem)."""
    block_base = np.ascontiguousarray(offsets[::64])
    rel_dtype = np.dtype(np.uint16 if lib.ibp_rel_bytes(row_bytes) == 2 else np.uint32)
    rel = hostmem.zeros(offsets.size * rel_dtype.itemsize).view(rel_dtype)
    rel[:] = offsets - np.repeat(block_base, 64)[: offsets.size]  # each fits: the format's bound
    return block_base, rel
