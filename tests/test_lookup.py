"""Pooled lookups: against torch's embedding_bag and the reference, the row cache, exact
deduplication, every kernel set, lookup_many, and bad arguments."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ibp_embed
from ibp_embed import CompressedTable
from ibp_embed.dtypes import as_rows

from helpers import LOOKUP_DTYPES, assert_bits_equal, every_isa, magnitude_clusters, random_bits, structured


# ---------------------------------------------------------------- pooled lookup

def make_bags(n_rows: int, n_bags: int, seed: int, max_bag: int = 6):
    """TorchRec-style (indices, offsets[B + 1]) with empty bags and duplicates."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, max_bag + 1, n_bags)
    sizes[::5] = 0  # empty bags
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    indices = rng.integers(0, n_rows, int(offsets[-1])).astype(np.int64)
    return torch.from_numpy(indices), torch.from_numpy(offsets)


def _atol(dec, indices, offsets, weights, mode) -> float:
    """Rounding error bound of a pooled sum in another order: a few ulps of sum |w x|."""
    mag = reference_bag(dec.float().abs(), indices, offsets,
                        None if weights is None else weights.abs(), mode)
    return 1e-6 * float(mag.max()) + 1e-30 if mag.numel() else 1e-30


def reference_bag(dec: torch.Tensor, indices, offsets, weights, mode):
    weight = dec.float()
    if weights is None or mode == "sum":
        return F.embedding_bag(indices, weight, offsets[:-1], mode=mode, per_sample_weights=weights)
    # torch has no weighted mean: the weighted sum divided by the bag size.
    s = F.embedding_bag(indices, weight, offsets[:-1], mode="sum", per_sample_weights=weights)
    sizes = (offsets[1:] - offsets[:-1]).clamp(min=1).float()
    return s / sizes[:, None]


def offsets_of(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """Offsets of bags of these lengths over n ids (cut at n; the last bag takes the rest)."""
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0).clamp(max=n)])
    off[-1] = n
    return off


@contextlib.contextmanager
def native_threads(n: int):
    from ibp_embed._native import lib

    before = lib.ibp_get_num_threads()
    lib.ibp_set_num_threads(n)
    try:
        yield
    finally:
        lib.ibp_set_num_threads(before)


def assert_pools_exactly(t, w, idx, off, psw, every: int):
    """Sums bit for bit embedding_bag's; weighted MEAN (fused multiply-adds) bit for bit
    the same bags' looked up one at a time (the cached path: a few ids), every n-th bag."""
    assert torch.equal(t.lookup(idx, off), F.embedding_bag(idx, w, off[:-1], mode="sum"))
    got = t.lookup(idx, off, psw, mode="mean")
    for b in range(0, len(off) - 1, every):
        lo, hi = int(off[b]), int(off[b + 1])
        assert torch.equal(got[b], t.lookup(idx[lo:hi], torch.tensor([0, hi - lo]), psw[lo:hi], mode="mean")[0])


@pytest.mark.parametrize("dtype", LOOKUP_DTYPES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("clusters", [1, 4, "raw"])
def test_lookup_matches_embedding_bag(dtype, mode, weighted, clusters):
    """Encoded tables (1 or 4 clusters) and a raw table (what compress stores for so few rows)."""
    w = magnitude_clusters(120, 12, seed=3, scales=(1e-3, 1e-1, 1e1, 1e3)).to(dtype)
    t = ibp_embed.compress(w) if clusters == "raw" else ibp_embed.compress(w, clusters=clusters, allow_raw=False)
    assert t.is_raw == (clusters == "raw")
    dec = t.decompress()
    assert_bits_equal(dec, w)
    indices, offsets = make_bags(120, 40, seed=4)  # 40 bags: the parallel path
    g = torch.Generator().manual_seed(5)
    weights = torch.rand(indices.numel(), generator=g) * 2 - 0.5 if weighted else None
    got = t.lookup(indices, offsets, per_sample_weights=weights, mode=mode)
    want = reference_bag(dec, indices, offsets, weights, mode)
    assert got.dtype == torch.float32 and got.shape == (40, 12)
    empty = (offsets[1:] == offsets[:-1])
    assert empty.any() and (got[empty] == 0).all()
    if dtype == torch.float32 and mode == "sum" and not weighted:
        assert torch.equal(got, want)  # same additions in the same order
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=_atol(dec, indices, offsets, weights, mode))


@pytest.mark.parametrize("dtype", LOOKUP_DTYPES)
def test_lookup_small_batch_and_input_types(dtype):
    """Fewer bags than the parallel threshold; list / numpy / int32 inputs."""
    w = torch.randn(30, 8, generator=torch.Generator().manual_seed(6)).to(dtype)
    t = ibp_embed.compress(w)
    indices = [3, 3, 29, 0, 7]
    offsets = [0, 2, 2, 5]
    want = F.embedding_bag(torch.tensor(indices), t.decompress().float(), torch.tensor(offsets[:-1]),
                           mode="sum")
    for idx, off in [(indices, offsets), (np.array(indices), np.array(offsets)),
                     (torch.tensor(indices, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32))]:
        torch.testing.assert_close(t.lookup(idx, off), want, rtol=1e-6, atol=1e-30)
    # One bag, one row: the row itself, widened to fp32.
    assert torch.equal(t.lookup([7], [0, 1]), t.decompress()[7:8].float())
    # No bags at all.
    assert t.lookup(torch.empty(0, dtype=torch.int64), [0]).shape == (0, 8)
    # Only empty bags.
    assert torch.equal(t.lookup(np.empty(0, np.int64), [0, 0, 0], mode="mean"), torch.zeros(2, 8))


def test_lookup_special_values_propagate():
    w = torch.ones(4, 3)
    w[1, 0] = float("inf")
    w[2, 1] = float("nan")
    want = F.embedding_bag(torch.tensor([0, 1, 2, 3]), w, torch.tensor([0, 2]), mode="sum")
    for allow_raw in (False, True):
        got = ibp_embed.compress(w, allow_raw=allow_raw).lookup([0, 1, 2, 3], [0, 2, 4])
        torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("dtype", LOOKUP_DTYPES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(n_rows=st.integers(1, 60), n_bags=st.integers(0, 30), seed=st.integers(0, 10**6),
       weighted=st.booleans(), clusters=st.integers(1, 3), allow_raw=st.booleans())
def test_property_lookup(dtype, mode, n_rows, n_bags, seed, weighted, clusters, allow_raw):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n_rows, 6, generator=g) * 10 ** torch.randint(-3, 3, (n_rows, 1), generator=g)).to(dtype)
    t = ibp_embed.compress(w, clusters=clusters, allow_raw=allow_raw)
    indices, offsets = make_bags(n_rows, n_bags, seed)
    weights = torch.randn(indices.numel(), generator=g) if weighted else None
    got = t.lookup(indices, offsets, weights, mode)
    want = reference_bag(t.decompress(), indices, offsets, weights, mode)
    torch.testing.assert_close(got, want, rtol=1e-6,
                               atol=_atol(t.decompress(), indices, offsets, weights, mode))


# ---------------------------------------------------------------- bad lookups

@pytest.fixture(scope="module")
def table():
    return ibp_embed.compress(structured(50, 4, torch.float32, seed=20))


@pytest.mark.parametrize("indices", [[0, 50], [-1, 0], [0, 2**40], [-(2**63), 0]])
def test_lookup_out_of_range(table, indices):
    with pytest.raises(IndexError):
        table.lookup(indices, [0, 1, 2])
    with pytest.raises(IndexError):
        table.lookup(torch.tensor(indices), torch.tensor([0, 2]), mode="mean")


@pytest.mark.parametrize("offsets", [[1, 2, 3], [0, 2, 1, 3], [0, 1, 2], [0, 1, 4], [0, 3, 3, 2, 3],
                                     [], [[0, 3]], [-1, 3]])
def test_lookup_bad_offsets(table, offsets):
    with pytest.raises(ValueError):
        table.lookup([0, 1, 2], offsets)


def test_lookup_bad_arguments(table):
    with pytest.raises(TypeError):
        table.lookup(torch.tensor([0.0, 1.0]), [0, 2])
    with pytest.raises(TypeError):
        table.lookup(np.array([0.5]), [0, 1])
    with pytest.raises(TypeError):
        table.lookup([0, 1], torch.tensor([0.0, 2.0]))
    with pytest.raises(ValueError):
        table.lookup([0, 1], [0, 2], per_sample_weights=[1.0])
    with pytest.raises(ValueError):
        table.lookup([0, 1], [0, 2], per_sample_weights=torch.ones(3))
    with pytest.raises(ValueError):
        table.lookup([0, 1], [0, 2], mode="max")
    with pytest.raises(ValueError):
        table.lookup([[0, 1]], [0, 2])
    # weights of real numbers only: a complex weight's imaginary part was dropped with a warning
    for w in (torch.ones(2, dtype=torch.complex64), [1 + 2j, 1.0], np.array([True, False])):
        with pytest.raises(TypeError, match="per_sample_weights must be real numbers"):
            table.lookup([0, 1], [0, 2], per_sample_weights=w)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.float64, torch.uint8, torch.bool,
                                   torch.int32])
def test_lookup_needs_a_float_table(dtype):
    t = ibp_embed.compress(random_bits(10, 4, dtype))
    with pytest.raises(TypeError):
        t.lookup([0, 1], [0, 2])


@pytest.mark.parametrize("n_rows,dim,n", [(20000, 8, 60000), (20000, 128, 60000), (20000, 128, 1500),
                                          (3000, 100, 60000), (300, 40, 60000)])
def test_lookup_row_cache_collisions_and_repeats(n_rows, dim, n):
    """Lookups keep a per-thread cache of decoded rows (a slot per row for small
    tables, hashed slots otherwise; large calls into large tables deduplicate
    instead) and resolve ids in windows before pooling them: ids that evict each
    other (more distinct rows than slots: 1500 ids get 1024 slots), hot repeats,
    bags longer than a window, empty bags and row widths past the last whole vector
    must all pool exactly."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(n_rows, dim, generator=g) * 0.01
    t = ibp_embed.compress(w)
    hot = torch.randint(0, n_rows, (64,), generator=g)
    idx = torch.where(torch.rand(n, generator=g) < 0.5, hot[torch.randint(0, 64, (n,), generator=g)],
                      torch.randint(0, n_rows, (n,), generator=g))
    lengths = torch.randint(0, 60, (max(n // 30, 2),), generator=g)
    lengths[::97] = 0
    lengths[1] = 700  # longer than a window of ids
    off = offsets_of(lengths, n)
    want = torch.nn.functional.embedding_bag(idx, w, off[:-1], mode="sum")
    assert torch.equal(t.lookup(idx, off), want)


@pytest.mark.parametrize("threads", [1, 2])
def test_lookup_small_table_decoded_whole(threads):
    """A call with many more ids than a small table has rows decodes every row of the
    table once into its per-thread cache and pools straight from it (no tag check per
    id). The sums must be the cached path's, bit for bit (weighted, MEAN, empty bags);
    a bad id is reported; and a corrupt row the batch never names must not fail the
    call: the whole-table decode gives up and the call decodes only the rows it names."""
    g = torch.Generator().manual_seed(5)
    n_rows, dim, n = 200, 24, 6000
    w = (torch.randn(n_rows, dim, generator=g) * 0.05).to(torch.float16).float()
    t = ibp_embed.compress(w, word_bits=64)
    assert not t.is_raw
    idx = torch.randint(0, n_rows, (n,), generator=g)
    lengths = torch.randint(0, 40, (n // 20,), generator=g)
    lengths[::7] = 0
    off = offsets_of(lengths, n)
    with native_threads(threads):
        assert_pools_exactly(t, w, idx, off, torch.rand(n, generator=g), every=13)
        bad = idx.clone()
        bad[n // 3] = n_rows
        with pytest.raises(IndexError):
            t.lookup(bad, off)
        # corrupt the last row: flip a participation bit of its header, so its bits no
        # longer add up to its stored length
        starts = t._row_starts()
        assert starts[-1] - starts[-2] < t._row_bytes  # encoded, not stored raw
        t._payload[int(starts[-2])] ^= 1
        named = idx % (n_rows - 1)  # never the last row
        assert torch.equal(t.lookup(named, off), F.embedding_bag(named, w, off[:-1], mode="sum"))
        with pytest.raises(ibp_embed.FormatError):
            t.lookup(torch.full((n,), n_rows - 1), off)


@pytest.mark.parametrize("word_bits", [16, 32, 64])
def test_lookup_short_packed_rows_from_memory(word_bits):
    """Uniform ids into 60k fp16 d64 rows (128 bytes; 5% of the words of another
    exponent, so rows of two packed steps, a few stored raw) are pooled from windows
    that decode_packed_rows_cold decodes (its unrolled form for two steps, prefetching
    32 rows ahead). The sums must be embedding_bag's over the fp32 values, bit for bit."""
    from ibp_embed.datasets import uniform_ids

    g = torch.Generator().manual_seed(73)
    n_rows, n = 60_000, 8229
    w = (1 + 0.99 * torch.rand(n_rows, 64, generator=g)).half()
    w[torch.rand(w.shape, generator=g) < 0.05] *= 64
    raw_rows = torch.arange(n_rows) % 89 == 7
    w[raw_rows] = (torch.randn(int(raw_rows.sum()), 64, generator=g) * 1e3).half()
    t = ibp_embed.compress(w, word_bits=word_bits)
    assert t._row_bytes == 128 and not t.is_raw and np.all(t.row_lengths()[raw_rows.numpy()] == 128)
    idx = uniform_ids(n, n_rows, seed=5)
    assert raw_rows[idx].any()
    lengths = torch.randint(0, 2 * n // 300, (300,), generator=g)
    lengths[::53] = 0
    off = offsets_of(lengths, n)
    assert_pools_exactly(t, w.float(), idx, off, torch.rand(n, generator=g), every=97)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n_rows,dim,n,bags,alpha", [(6000, 512, 40000, 2000, 1.05), (12000, 256, 16000, 800, None),
                                                      (12000, 128, 16000, 800, None), (1_100_000, 4, 4096, 200, 1.2),
                                                      (200_000, 24, 8192, 300, None), (60_000, 128, 8229, 300, None),
                                                      (60_000, 64, 8229, 300, None)],
                         ids=["bitmap", "bitmap-mostly-once", "bitmap-uniform", "hash", "direct", "direct-long-rows",
                              "direct-256-byte-rows"])
def test_lookup_deduplicated_path_pools_exactly(threads, n_rows, dim, n, bags, alpha):
    """A large call into a table with more rows than the per-thread cache has slots
    (2048 of the 2 KB rows) takes the exact deduplication path: with a bitmap of the
    table's rows where it has few rows per id (the rows named more than once decoded
    once into a scratch; where rows are 1 KB or longer, those named once where they
    are pooled, up to 256 a window of ids: the uniform ids into 12k rows fill that;
    shorter rows, every distinct row to the scratch, even from mostly distinct ids),
    a hash table of the ids where it has many (over 256: the 1.1M-row table; every
    distinct row to the scratch); uniform ids, mostly distinct, are decoded one by
    one in windows instead (512-byte rows: with the prefetches for rows in memory,
    256-byte rows too where the decoders step them, 32 rows ahead; 8229 ids: a last
    window of 37). Its sums must be the cached path's, bit for bit, with weights, MEAN,
    empty bags, bags longer than a window and a bad id reported."""
    from ibp_embed.datasets import uniform_ids, zipf_ids

    g = torch.Generator().manual_seed(21)
    w = (torch.randn(n_rows, dim, generator=g) * 0.05).to(torch.bfloat16).float()
    t = ibp_embed.compress(w)
    idx = zipf_ids(n, n_rows, alpha, seed=3) if alpha else uniform_ids(n, n_rows, seed=3)
    counts = torch.bincount(idx[: n // threads], minlength=n_rows)  # a thread's share, the first
    assert (counts == 1).sum() > 30 and (counts > 1).sum() > 30  # both kinds of rows, in every case
    lengths = torch.randint(0, 2 * n // bags, (bags,), generator=g)
    lengths[::53] = 0
    lengths[1] = 300  # longer than a window of ids
    off = offsets_of(lengths, n)
    with native_threads(threads):
        assert_pools_exactly(t, w, idx, off, torch.rand(n, generator=g), every=97)
        for bad_id in (n_rows, -1):
            bad = idx.clone()
            bad[n // 2] = bad_id
            with pytest.raises(IndexError):
                t.lookup(bad, off)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [5, 17, 22, 47])
@pytest.mark.parametrize("alpha,stored", [(None, "packed"), (1.05, "packed"), (None, "raw")])
def test_lookup_pools_columns_past_whole_vectors_exactly(dtype, dim, alpha, stored):
    """The columns past the last whole vector (of 16 floats on AVX-512, 8 on AVX2: masked
    loads, the sums in a register; tails of 1 to 15 columns, odd and even) pool the bits
    the generic kernels give, plain and weighted, SUM and MEAN, for bags
    that go on across the lookup's windows of ids (300 ids a bag) and for short ones: ids
    mostly distinct (decoded as they come), repeating (deduplicated), and from a raw table
    (pooled from it with prefetches where libibp's pool_source finds it large enough: dims
    17, 22 and 47 on an Intel core with 2 MB of L2, 22 and 47 on AMD)."""
    g = torch.Generator().manual_seed(dim)
    n_rows = 50000
    w = (torch.randn(n_rows, dim, generator=g) * 0.1).to(dtype)
    t = ibp_embed.compress(w) if stored == "packed" else CompressedTable.raw(*as_rows(w))
    rng = np.random.default_rng(dim)
    n = 6000
    idx = torch.from_numpy(rng.integers(0, n_rows, n) if alpha is None else rng.zipf(1 + alpha, n) % n_rows)
    off = torch.tensor([0, 300, 301, 320, 3000, 3003, n])  # long bags, short ones, one of a single id
    psw = torch.rand(n, generator=g) * 3
    outs = [[t.lookup(idx, off, p, mode=m) for p in (None, psw) for m in ("sum", "mean")] for _ in every_isa()]
    for got in outs[1:]:
        for a, b in zip(got, outs[0]):
            assert_bits_equal(a, b)
    # and against torch, unweighted float32 sums in the same order: bit for bit
    if dtype == torch.float32:
        assert torch.equal(t.lookup(idx, off), F.embedding_bag(idx, w, off[:-1], mode="sum"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_lookup_is_identical_on_every_kernel_set(dtype, mode):
    """Pooling rounds the same whatever the ISA (weighted sums use one fused multiply-add
    per element everywhere), so results do not depend on the CPU."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(500, 24, generator=g) * 0.1).to(dtype)
    t = ibp_embed.compress(w)
    idx = torch.randint(0, 500, (300,), generator=g)
    off = torch.arange(0, 301, 10)
    psw = torch.rand(300, generator=g) * 3
    outs = [(t.lookup(idx, off, psw, mode=mode), t.lookup(idx, off, mode=mode)) for _ in every_isa()]
    for weighted, plain in outs[1:]:
        assert torch.equal(weighted, outs[0][0]) and torch.equal(plain, outs[0][1])


def test_lookup_many_fills_each_jobs_columns_as_lookup_does():
    """ibp_lookup_many runs several tables' lookups in one call, each writing its
    columns of one [B, sum of dims] output: every column block must equal that
    table's own lookup bit for bit (dtypes, dims, weights, MEAN, empty bags, tables
    small and large enough to deduplicate), and errors name the failing job."""
    from ibp_embed.batched import _lookup_many_checked as lookup_many

    from ibp_embed.datasets import zipf_ids

    g = torch.Generator().manual_seed(31)
    b = 1200
    specs = [(torch.float32, 50000, 24, "sum", True), (torch.float16, 40, 16, "mean", False),
             (torch.bfloat16, 3000, 40, "mean", True), (torch.float32, 7, 3, "sum", False)]
    jobs, want = [], []
    for dtype, n_rows, dim, mode, weighted in specs:
        t = ibp_embed.compress((torch.randn(n_rows, dim, generator=g) * 0.1).to(dtype))
        lengths = torch.randint(0, 100, (b,), generator=g)
        lengths[::41] = 0
        off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).numpy()
        ids = zipf_ids(int(off[-1]), n_rows, 1.05, seed=n_rows).numpy()  # skewed: the first one deduplicates
        w = torch.rand(ids.size, generator=g).numpy() if weighted else None
        jobs.append((t, ids, off, w, mode))
        want.append(t.lookup(ids, off, w, mode=mode))
    got = lookup_many(jobs, b)
    assert got.shape == (b, sum(x.shape[1] for x in want))
    assert torch.equal(got, torch.cat(want, dim=1))
    for (t, ids, off, w, mode), x in zip(jobs, want):  # and the lookups themselves are right
        dec, ids_t, off_t = t.decompress(), torch.from_numpy(ids), torch.from_numpy(off)
        w_t = None if w is None else torch.from_numpy(w)
        torch.testing.assert_close(x, reference_bag(dec, ids_t, off_t, w_t, mode), rtol=1e-6,
                                   atol=_atol(dec, ids_t, off_t, w_t, mode))
    assert lookup_many([], b).shape == (b, 0)
    t, ids, off, w, mode = jobs[2]
    bad = ids.copy()
    bad[3] = t.shape[0]
    with pytest.raises(IndexError, match="job 2"):
        lookup_many(jobs[:2] + [(t, bad, off, w, mode)] + jobs[3:], b, lambda k: f"job {k}")
    with pytest.raises(ValueError, match="bags"):
        lookup_many([(t, ids, off[:-1], w, mode)], b)
    with pytest.raises(ValueError, match="offsets end"):
        lookup_many([(t, ids[:-1], off, None, mode)], b)
    with pytest.raises(TypeError, match="int64"):
        lookup_many([(t, ids.astype(np.int32), off, w, mode)], b)


@pytest.mark.parametrize("threads", [1, 2])
def test_lookup_many_streams_large_outputs_exactly(threads):
    """An output larger than L2 (here over 64 MB, the most libibp assumes) gets each
    bag's finished sums (MEAN's scaled as they are finished) with streaming stores,
    where its rows are whole aligned lines (dims of 16 floats): every path (a slot a
    row, the deduplicated scratch, weights, MEAN, bags longer than a window) must
    give the same bits as the same bags looked up a few at a time (an output that
    fits any cache: plain stores), and unweighted sums embedding_bag's bits."""
    from ibp_embed.datasets import zipf_ids
    from ibp_embed.batched import _lookup_many_checked as lookup_many

    g = torch.Generator().manual_seed(35)
    b = 2100
    specs = [(torch.float32, 60, "sum", False), (torch.float16, 300, "sum", True),  # a slot a row; deduplicated
             (torch.bfloat16, 40, "mean", True), (torch.float32, 300, "sum", False)]
    lengths = torch.randint(0, 40, (b,), generator=g)
    lengths[::37], lengths[5] = 0, 3000  # empty bags, and one longer than a window
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).numpy()
    jobs = []
    for k, (dtype, n_rows, mode, weighted) in enumerate(specs):
        t = ibp_embed.compress((torch.randn(n_rows, 2048, generator=g) * 0.1).to(dtype))
        ids = zipf_ids(int(off[-1]), n_rows, 1.05, seed=k).numpy()
        jobs.append((t, ids, off, torch.rand(ids.size, generator=g).numpy() if weighted else None, mode))
    with native_threads(threads):
        for isa in every_isa():  # AVX-512 and AVX2 stream 64 and 32 bytes a store
            got = lookup_many(jobs, b)
            assert got.numel() * 4 > 64 << 20
            for b0 in range(0, b, 4):  # 4 bags a call: a 128 KB output
                lo, hi = off[b0], off[b0 + 4]
                part = [(t, ids[lo:hi], off[b0:b0 + 5] - lo, None if w is None else w[lo:hi], mode)
                        for t, ids, _, w, mode in jobs]
                assert torch.equal(got[b0:b0 + 4], lookup_many(part, 4)), (isa, b0)
    for k, (t, ids, _, w, mode) in enumerate(jobs):
        if w is None and mode == "sum":
            assert torch.equal(got[:, 2048 * k:2048 * (k + 1)],
                               F.embedding_bag(torch.from_numpy(ids), t.decompress().float(),
                                               torch.from_numpy(off[:-1]), mode="sum"))


@pytest.mark.parametrize("threads", [1, 2])
def test_lookup_many_gives_each_thread_whole_tables_when_they_balance(threads):
    """Where a call has enough tables to deduplicate to keep every thread busy with
    whole ones, each such table is one task (its distinct rows decoded once, not
    once per thread); alone, a table's bags are split among the threads. Both must
    give the one-table lookups' sums bit for bit, whatever rows the tasks share."""
    from ibp_embed.datasets import zipf_ids
    from ibp_embed.batched import _lookup_many_checked as lookup_many

    g = torch.Generator().manual_seed(33)
    b, pooling = 205, 20  # 4100 ids a table: enough to deduplicate on 2 threads
    off = np.arange(0, b * pooling + 1, pooling, dtype=np.int64)
    jobs = []
    for k in range(5):
        t = ibp_embed.compress((torch.randn(20000, 8, generator=g) * 0.1).to(torch.bfloat16).float())
        jobs.append((t, zipf_ids(b * pooling, 20000, 1.05, seed=k).numpy(), off, None, "sum"))
    with native_threads(threads):
        got = lookup_many(jobs, b)
        want = torch.cat([lookup_many([job], b) for job in jobs], dim=1)
    assert torch.equal(got, want)
    for k, (t, ids, _, _, _) in enumerate(jobs):
        assert torch.equal(got[:, 8 * k:8 * (k + 1)],
                           F.embedding_bag(torch.from_numpy(ids), t.decompress(), torch.from_numpy(off[:-1]),
                                           mode="sum"))


def test_public_lookup_many_matches_per_table_lookups():
    """ibp_embed.lookup_many: lookup()'s arguments per table, one [B, sum of dims] output
    (one native call for packed tables, table by table with an updatable one), errors
    naming the table."""
    from ibp_embed.store import UpdatableTable

    g = torch.Generator().manual_seed(41)
    b = 300
    tables = [ibp_embed.compress((torch.randn(n, d, generator=g) * 0.1).to(dt))
              for n, d, dt in ((5000, 16, torch.float32), (12, 8, torch.bfloat16), (800, 4, torch.float16))]
    ids = [torch.randint(0, t.shape[0], (b * 3,), generator=g) for t in tables]
    offs = [torch.arange(0, b * 3 + 1, 3)] * 3
    psw = [None, torch.rand(b * 3, generator=g), None]
    modes = ["sum", "mean", "mean"]
    want = torch.cat([t.lookup(i, o, w, mode=m) for t, i, o, w, m in zip(tables, ids, offs, psw, modes)], dim=1)
    assert torch.equal(ibp_embed.lookup_many(tables, ids, offs, psw, modes), want)
    mixed = [tables[0], UpdatableTable(tables[1], repack_drift=None), tables[2]]
    assert torch.equal(ibp_embed.lookup_many(mixed, ids, offs, psw, modes), want)
    assert torch.equal(ibp_embed.lookup_many(tables[:1], [ids[0].tolist()], [offs[0].numpy()]),
                       tables[0].lookup(ids[0], offs[0]))
    assert ibp_embed.lookup_many([], [], []).shape == (0, 0)
    bad = ids[2].clone()
    bad[7] = 800
    with pytest.raises(IndexError, match="table 2: row index 800"):
        ibp_embed.lookup_many(tables, ids[:2] + [bad], offs, psw, modes)
    with pytest.raises(ValueError, match="same number of bags"):
        ibp_embed.lookup_many(tables[:2], ids[:2], [offs[0], torch.arange(0, b * 3 + 1, 5)[:-1].tolist() + [b * 3]])
    with pytest.raises(ValueError, match="3 tables need 3"):
        ibp_embed.lookup_many(tables, ids[:2], offs)
    with pytest.raises(ValueError, match="table 1: mode"):
        ibp_embed.lookup_many(tables, ids, offs, mode=["sum", "max", "sum"])
    with pytest.raises(TypeError, match="table 0: a CompressedTable"):
        ibp_embed.lookup_many([torch.zeros(3, 3)], [[0]], [[0, 1]])


def test_decode_plans_kept_per_table_stay_right_across_many_tables():
    """A thread keeps a decode plan per codebook (IBP_PLAN_SLOTS of them, replaced in
    turn): lookups into more tables than that, again and again, and into new tables
    made where dropped ones were (their codebooks may reuse the same addresses), must
    each decode their own rows. Bags of one id: each output row is its row, exactly."""
    from ibp_embed.batched import _lookup_many_checked as lookup_many

    from helpers import every_isa

    rng = np.random.default_rng(4)
    b = 64

    def make(seed):
        dtype = (torch.float32, torch.float16, torch.bfloat16)[seed % 3]
        g = torch.Generator().manual_seed(seed)  # finite rows: a bag of one pools to its row's exact value
        w = torch.randn(int(rng.integers(20, 300)), int(rng.choice([8, 32, 64])), generator=g) * 10.0 ** (seed % 7 - 3)
        t = ibp_embed.compress(w.to(dtype), word_bits=(16, 32, 64)[seed % 3 if dtype == torch.float32 else 2],
                               progress=False)
        return t, rng.integers(0, t.shape[0], b).astype(np.int64)

    tables = [make(s) for s in range(40)]  # more than a thread's plan slots (32)
    off = np.arange(b + 1, dtype=np.int64)
    for isa in every_isa():
        for rnd in range(3):
            if rnd == 2:  # drop half the tables, make new ones in their place
                tables[::2] = [make(100 + s) for s in range(20)]
            got = lookup_many([(t, ids, off, None, "sum") for t, ids in tables], b)
            want = torch.cat([t.decompress()[torch.from_numpy(ids)].float() for t, ids in tables], dim=1)
            assert torch.equal(got, want), f"isa {isa}, round {rnd}"
    assert ibp_embed.release_thread_buffers() > 0
