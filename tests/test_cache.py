"""RowCache (ibp_embed/cache.py) on the CPU: a CPU tensor stands for device memory."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ibp_embed
from ibp_embed.cache import RowCache

N, D = 600, 24


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The cache issues many small torch ops; on a shared, oversubscribed CPU the
    # intra-op thread pool's wake-ups cost more than the ops (milliseconds each).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _weights(dtype=torch.float32, n=N, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g) * 0.05).to(dtype)


@pytest.fixture(scope="module")
def table():
    return ibp_embed.compress(_weights())


class CountingTable:
    """A table wrapper that records the ids every gather asks for."""

    def __init__(self, table):
        self.table = table
        self.shape, self.dtype = table.shape, table.dtype
        self.calls = []

    def gather(self, ids):
        self.calls.append(torch.as_tensor(ids).clone())
        return self.table.gather(ids)


def _zipf(rng, n, n_rows=N, a=1.1):
    p = 1.0 / np.arange(1, n_rows + 1) ** a
    perm = np.random.default_rng(99).permutation(n_rows)
    return perm[rng.choice(n_rows, n, p=p / p.sum())]


def _bags(rng, n_idx, n_bags):
    off = np.sort(rng.integers(0, n_idx + 1, n_bags + 1))
    off[0], off[-1] = 0, n_idx
    return off


def _check_lookup(cache, table, idx, off, w, mode):
    got = cache.lookup(idx, off, w, mode)
    ref = table.lookup(idx, off, w, mode)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    if w is None:
        assert torch.equal(got, ref), float((got - ref).abs().max())  # same order of additions
    else:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_lookup_equals_uncached(dtype, policy):
    t = ibp_embed.compress(_weights(dtype))
    cache = RowCache(t, load_factor=0.2, policy=policy)
    rng = np.random.default_rng(1)
    for step in range(12):
        idx = _zipf(rng, 400)
        off = _bags(rng, 400, 37)
        w = rng.standard_normal(400).astype(np.float32)
        for mode in ("sum", "mean"):
            _check_lookup(cache, t, idx, off, None, mode)
            _check_lookup(cache, t, idx, off, w, mode)
    assert cache.hits > 0 and cache.misses > 0 and cache.evictions > 0
    assert len(cache.cached_rows()) == cache.capacity == int(0.2 * N)


def test_gather_is_bit_exact_through_the_cache(table):
    cache = RowCache(table, capacity=50)
    rng = np.random.default_rng(2)
    for _ in range(5):
        idx = rng.integers(0, N, (7, 30))
        got = cache.gather(torch.from_numpy(idx))
        assert got.shape == (7, 30, D)
        assert torch.equal(got, table.gather(idx))
    assert cache.gather([]).shape == (0, D)


def test_cache_tensor_holds_the_decoded_rows(table):
    cache = RowCache(table, capacity=100)
    cache.lookup(np.arange(0, 300, 3), [0, 100])
    rows = cache.slot_row >= 0
    assert torch.equal(cache.rows[rows], table.gather(cache.slot_row[rows]))
    assert torch.equal(cache.slot_of[cache.slot_row[rows]].long(), torch.nonzero(rows).flatten())
    assert int((cache.slot_of >= 0).sum()) == int(rows.sum())


def test_lru_eviction_order(table):
    cache = RowCache(table, capacity=3, policy="lru")
    seen = []
    for ids in ([0], [1], [2], [0], [3], [4], [2, 5]):
        cache.lookup(ids, [0, len(ids)])
        seen.append(cache.cached_rows().tolist())
    assert seen == [[0], [0, 1], [0, 1, 2],
                    [0, 1, 2],   # 0 hit: now the most recent
                    [0, 2, 3],   # 1 was least recently used
                    [0, 3, 4],   # then 2
                    [2, 4, 5]]   # 2 and 5 missed: 0, then 3 go (4 stays, the newest)
    assert (cache.hits, cache.misses, cache.evictions, cache.inserts) == (1, 7, 4, 7)


def test_lfu_eviction_order_and_admission(table):
    cache = RowCache(table, capacity=2, policy="lfu")

    def step(ids):
        cache.lookup(ids, [0, len(ids)])
        return cache.cached_rows().tolist()

    assert step([0, 0, 0]) == [0]          # count(0) = 3
    assert step([1]) == [0, 1]             # count(1) = 1, a free slot
    assert step([2]) == [0, 1]             # count(2) = 1 is not above count(1) = 1: not admitted
    assert step([2]) == [0, 2]             # count(2) = 2 > 1: evicts 1, the least frequent
    assert step([3, 3, 3, 3]) == [0, 3]    # count(3) = 4 evicts 2 (count 2), not 0 (count 3)
    assert step([1]) == [0, 3]             # count(1) = 2 < 3: stays out
    assert cache.evictions == 2 and cache.inserts == 4
    assert cache.freq[:4].tolist() == [3, 2, 2, 4]


def test_lfu_ties_go_to_the_least_recently_used(table):
    cache = RowCache(table, capacity=2, policy="lfu")
    for ids in ([5], [6], [5], [6], [7, 7, 7]):
        cache.lookup(ids, [0, len(ids)])
    # 5 and 6 both have count 2; 5 was used before 6, so 7 (count 3) evicts 5
    assert cache.cached_rows().tolist() == [6, 7]


def test_counters_count_distinct_ids_and_indices(table):
    cache = RowCache(table, capacity=10)
    cache.lookup([1, 1, 1, 2], [0, 2, 4])
    assert (cache.hits, cache.misses, cache.index_hits, cache.index_misses) == (0, 2, 0, 4)
    cache.lookup([2, 1, 1, 3], [0, 4])
    assert (cache.hits, cache.misses, cache.index_hits, cache.index_misses) == (2, 3, 3, 5)
    assert cache.requests == 8 and cache.lookups == 2
    assert cache.hit_rate == pytest.approx(2 / 5)
    s = cache.stats()
    assert s["hits"] == 2 and s["hit_rate"] == pytest.approx(0.4)
    cache.reset_stats()
    assert cache.hits == cache.misses == cache.requests == 0 and cache.hit_rate == 0.0


def test_duplicate_ids_are_fetched_once():
    t = ibp_embed.compress(_weights())
    src = CountingTable(t)
    cache = RowCache(src, capacity=100)
    idx = np.array([4, 9, 4, 4, 9, 11, 4])
    out = cache.lookup(idx, [0, 3, 7])
    assert torch.equal(out, t.lookup(idx, [0, 3, 7]))
    assert [c.tolist() for c in src.calls] == [[4, 9, 11]]
    cache.lookup(np.array([9, 4, 12, 12]), [0, 4])
    assert [c.tolist() for c in src.calls] == [[4, 9, 11], [12]]


def test_capacity_zero(table):
    src = CountingTable(table)
    cache = RowCache(src, capacity=0)
    assert cache.rows.shape == (0, D)
    rng = np.random.default_rng(3)
    for _ in range(3):
        idx = rng.integers(0, N, 200)
        off = _bags(rng, 200, 10)
        _check_lookup(cache, table, idx, off, None, "sum")
        cache.prefetch(idx)  # nothing to keep it in
    assert cache.hits == 0 and cache.misses > 0 and cache.evictions == 0 and cache.prefetched == 0
    assert len(src.calls) == 3
    assert RowCache(table, load_factor=0.0).capacity == 0


def test_capacity_at_least_all_rows(table):
    for cache in (RowCache(table, load_factor=1.0), RowCache(table, capacity=10 * N)):
        assert cache.capacity == N
        cache.lookup(np.arange(N), [0, N])
        rng = np.random.default_rng(4)
        cache.reset_stats()
        for _ in range(4):
            idx = rng.integers(0, N, 300)
            _check_lookup(cache, table, idx, _bags(rng, 300, 20), None, "mean")
        assert cache.misses == 0 and cache.hit_rate == 1.0 and cache.evictions == 0


def test_prefetch_raises_the_hit_rate(table):
    rng = np.random.default_rng(5)
    batches = [rng.integers(0, N, 100) for _ in range(10)]
    plain, ahead = RowCache(table, capacity=150), RowCache(table, capacity=150)
    for i, idx in enumerate(batches):
        plain.lookup(idx, [0, len(idx)])
        # the lookup of batch i is preceded by its prefetch
        ahead.prefetch(idx)
        hits = ahead.hits
        out = ahead.lookup(idx, [0, len(idx)])
        assert ahead.hits - hits == len(np.unique(idx))  # every row was brought in ahead
        assert torch.equal(out, table.lookup(idx, [0, len(idx)]))
    assert ahead.hit_rate == 1.0 > plain.hit_rate
    assert ahead.prefetched > 0 and plain.prefetched == 0


def test_prefetch_keeps_lfu_counts_and_protects_the_next_batch(table):
    cache = RowCache(table, capacity=4, policy="lfu")
    cache.lookup([0, 0, 1, 1, 2, 2, 3, 3], [0, 8])
    cache.prefetch([10, 10, 10, 1])  # 10 will have count 3 > 2: admitted over 0 (LRU tie-break)
    assert cache.freq[10] == 0 and cache.hits == 0  # prefetch counts nothing itself
    assert 10 in cache.cached_rows().tolist() and 1 in cache.cached_rows().tolist()
    cache.lookup([10, 10, 10, 1], [0, 4])
    assert cache.hits == 2 and cache.freq[10] == 3


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_zipf_traffic_hits_more_than_uniform(policy):
    n_rows = 4000
    t = ibp_embed.compress(_weights(n=n_rows, d=8))
    rng = np.random.default_rng(6)
    rates = {}
    for dist in ("zipf", "uniform"):
        cache = RowCache(t, load_factor=0.2, policy=policy)
        for _ in range(30):
            idx = _zipf(rng, 512, n_rows) if dist == "zipf" else rng.integers(0, n_rows, 512)
            cache.lookup(idx, np.arange(0, 513, 16))
        rates[dist] = cache.hit_rate
    assert rates["zipf"] > rates["uniform"] + 0.2, rates
    assert rates["uniform"] < 0.3, rates


def test_empty_batches_and_bags(table):
    cache = RowCache(table, capacity=20)
    out = cache.lookup(np.zeros(0, np.int64), [0, 0, 0])
    assert out.shape == (2, D) and not out.any()
    idx = [3, 4, 5]
    _check_lookup(cache, table, idx, [0, 0, 2, 2, 3, 3], None, "mean")
    _check_lookup(cache, table, idx, [0, 0, 2, 2, 3, 3], [0.5, -1.0, 2.0], "sum")


def test_errors(table):
    cache = RowCache(table, capacity=20)
    with pytest.raises(IndexError):
        cache.lookup([0, N], [0, 2])
    with pytest.raises(IndexError):
        cache.gather([-1])
    with pytest.raises(IndexError):
        cache.prefetch([N])
    with pytest.raises(ValueError, match="offsets"):
        cache.lookup([0, 1], [0, 1])
    with pytest.raises(ValueError, match="non-decreasing"):
        cache.lookup([0, 1, 2], [0, 2, 1, 3])
    with pytest.raises(ValueError, match="mode"):
        cache.lookup([0], [0, 1], mode="max")
    with pytest.raises(ValueError, match="per_sample_weights"):
        cache.lookup([0, 1], [0, 2], [1.0])
    with pytest.raises(TypeError):
        cache.lookup([0.5], [0, 1])
    for w in (torch.ones(2, dtype=torch.complex64), [1j, 1.0]):  # an imaginary part would be dropped
        with pytest.raises(TypeError, match="per_sample_weights must be real numbers"):
            cache.lookup([0, 1], [0, 2], w)
    with pytest.raises(ValueError, match="policy"):
        RowCache(table, policy="fifo")
    with pytest.raises(ValueError):
        RowCache(table, capacity=-1)
    ints = ibp_embed.compress(torch.randint(0, 5, (50, 6), dtype=torch.int16))
    icache = RowCache(ints, capacity=10)
    with pytest.raises(TypeError):
        icache.lookup([0], [0, 1])
    assert torch.equal(icache.gather([1, 2, 1]), ints.gather([1, 2, 1]))
    assert cache.hits == 0 and cache.lookups == 0  # failed calls change nothing


def test_device_memory_accounting(table):
    cache = RowCache(table, load_factor=0.2, policy="lfu", device="cpu")
    c = int(0.2 * N)
    assert cache.device == torch.device("cpu")
    assert cache.nbytes == c * D * 4 + N * 4 + c * 8 * 3 + N * 8
    assert "RowCache(capacity=120 of 600 rows" in repr(cache)
