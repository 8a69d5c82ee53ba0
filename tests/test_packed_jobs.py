"""PackedJobs (a fixed list of tables' native lookup jobs, written once) against each
table's own lookup, bit for bit, and the modules' JobCache over it: rebuilt when the
tables or the keys change, safe to copy, pickle and call from several threads."""
from __future__ import annotations

import copy
import pickle
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ibp_embed
from ibp_embed import packed_jobs
from ibp_embed.packed_jobs import PackedJobs
from ibp_embed._native import ffi, lib

from helpers import assert_bits_equal, structured


class Jobs:
    """PackedJobs as the modules' JobCache drives them: the tables kept alive here.
    copy_nbytes: the decoded copies these jobs took (the tables keep theirs)."""

    def __init__(self, tables, modes, key_index):
        self.tables = list(tables)
        self.packed = PackedJobs(self.tables, modes, key_index)

    def __call__(self, values, offsets, weights, n_bags, what):
        return self.packed(values, offsets, weights, n_bags, what, self.tables.__getitem__)

    @property
    def copy_nbytes(self):
        return sum(c.nbytes for c in {id(c): c for c in self.packed._copies if c is not None}.values())


def kjt_layout(rng, n_keys: int, n_bags: int, n_rows: int, max_bag: int = 5):
    """values and offsets [n_keys * n_bags + 1] as a KeyedJaggedTensor lays them out
    (key after key), with empty bags and duplicate ids."""
    sizes = rng.integers(0, max_bag + 1, n_keys * n_bags)
    sizes[::4] = 0
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    values = rng.integers(0, n_rows, int(offsets[-1])).astype(np.int64)
    return values, offsets


def expected(tables, modes, key_index, values, offsets, weights, n_bags):
    """Each job through its table's own lookup, side by side."""
    outs = []
    for t, m, k in zip(tables, modes, key_index):
        lo, hi = int(offsets[k * n_bags]), int(offsets[(k + 1) * n_bags])
        off = offsets[k * n_bags:(k + 1) * n_bags + 1] - lo
        w = None if weights is None else torch.from_numpy(weights[lo:hi])
        outs.append(t.lookup(torch.from_numpy(values[lo:hi]), torch.from_numpy(off), per_sample_weights=w, mode=m))
    return torch.cat(outs, dim=1) if outs else torch.empty((n_bags, 0))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n_keys=st.integers(1, 4), n_jobs=st.integers(0, 5),
       n_bags=st.integers(1, 9), weighted=st.booleans())
def test_packed_jobs_match_each_tables_lookup(seed, n_keys, n_jobs, n_bags, weighted):
    rng = np.random.default_rng(seed)
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    tables, modes = [], []
    for j in range(n_jobs):
        n_rows, dim = int(rng.integers(1, 60)), int(rng.choice([1, 3, 8, 16, 33]))
        tables.append(ibp_embed.compress(structured(n_rows, dim, dtypes[j % 3], seed=seed + j), progress=False))
        modes.append("mean" if rng.random() < 0.3 else "sum")
    n_rows = min([t.shape[0] for t in tables], default=1)
    values, offsets = kjt_layout(rng, n_keys, n_bags, n_rows)
    weights = rng.standard_normal(values.size).astype(np.float32) if weighted else None
    key_index = rng.integers(0, n_keys, n_jobs)  # any order, keys read twice or not at all
    want = expected(tables, modes, key_index, values, offsets, weights, n_bags)
    for ids_per_row in (0, 10**9):  # small tables' decoded copies never / always
        with pytest.MonkeyPatch.context() as m:
            m.setattr(packed_jobs, "COPY_IDS_PER_ROW", ids_per_row)
            jobs = Jobs(tables, modes, key_index)
            got = jobs(values, offsets, weights, n_bags, lambda k: f"job {k}")
            again = jobs(values, offsets, weights, n_bags, lambda k: f"job {k}")  # from the copies the first made
        assert got.shape == (n_bags, sum(t.shape[1] for t in tables))
        assert_bits_equal(got, want)
        assert_bits_equal(again, want)
        if n_jobs:  # the jobs the second call ran: with the copies the first made
            keyed = jobs.packed._keyed[1]
            assert all((keyed[k].copy != ffi.NULL) == (c is not None) for k, c in enumerate(jobs.packed._copies))
        named = [offsets[(k + 1) * n_bags] > offsets[k * n_bags] and not t.is_raw for t, k in zip(tables, key_index)]
        assert (jobs.copy_nbytes > 0) == (ids_per_row > 0 and any(named))


def test_small_tables_are_copied_once_where_calls_name_few_ids_a_row():
    small = ibp_embed.compress(structured(100, 8, torch.float32), progress=False)
    big = ibp_embed.compress(structured(packed_jobs.COPY_MAX_BYTES // 32 + 1, 8, torch.float32), progress=False)
    raw = ibp_embed.CompressedTable.raw(np.zeros((50, 32), np.uint8), torch.float32, 8)
    assert not small.is_raw and not big.is_raw and raw.is_raw
    jobs = Jobs([small, big, small, raw], ["sum"] * 4, [0, 1, 2, 3])
    values, offsets = np.arange(12, dtype=np.int64) % 50, np.arange(13, dtype=np.int64)  # 4 keys, 3 bags of 1
    got = jobs(values, offsets, None, 3, str)
    assert jobs.copy_nbytes == small.raw_nbytes  # one copy for both of its jobs; none of big or raw
    copies = jobs.packed._copies
    assert copies[0] is copies[2] and copies[1] is None and copies[3] is None
    assert copies[0]._payload.ctypes.data % 64 == 0 and copies[0].is_raw  # raw tables start on a cache line
    assert torch.equal(copies[0].decompress(), small.decompress())
    assert_bits_equal(got, expected([small, big, small, raw], ["sum"] * 4, range(4), values, offsets, None, 3))
    with pytest.raises(IndexError, match=r"^job 2: id 100 out of range for a table of 100 rows$"):
        jobs(np.where(np.arange(12) == 7, 100, values), offsets, None, 3, lambda k: f"job {k}")
    before = lib.ibp_get_num_threads()
    try:
        for threads in (1, 2):  # COPY_IDS_PER_ROW ids a row a thread: the native path; one fewer: the copy
            lib.ibp_set_num_threads(threads)
            for n_ids, copied in ((packed_jobs.COPY_IDS_PER_ROW * threads * 100, False),
                                  (packed_jobs.COPY_IDS_PER_ROW * threads * 100 - 1, True)):
                jobs = Jobs([small], ["sum"], [0])
                ids, off = np.arange(n_ids, dtype=np.int64) % 100, np.array([0, 500, n_ids], np.int64)
                assert_bits_equal(jobs(ids, off, None, 2, str), expected([small], ["sum"], [0], ids, off, None, 2))
                assert (jobs.copy_nbytes > 0) == copied
    finally:
        lib.ibp_set_num_threads(before)


def keyed_call(jobs, values, offsets, n_keys, n_bags, width):
    """libibp's ibp_lookup_keyed: (return code, failed job, copies wanted, output)."""
    out = torch.full((n_bags, width), float("nan"))
    res = ffi.new("uint64_t[2]")
    rc = lib.ibp_lookup_keyed(jobs, len(jobs), ffi.cast("const int64_t *", values.ctypes.data), values.size,
                              ffi.cast("const int64_t *", offsets.ctypes.data), n_keys, n_bags, ffi.NULL,
                              ffi.cast("float *", out.data_ptr()), res, res + 1)
    return rc, int(res[0]), int(res[1]), out


def test_keyed_lookup_pools_from_copies_below_their_limit_and_refuses_bad_batches():
    """ibp_lookup_keyed's own contract: a job pools from its copy where it has fewer ids
    than copy_below (and some), counts the copies it lacks, and names what it refuses.
    The "copy" here is another table, so that the rows tell which one was read."""
    t = ibp_embed.compress(structured(20, 8, torch.float32, seed=1), progress=False)
    other = ibp_embed.CompressedTable.raw(structured(20, 8, torch.float32, seed=2).numpy().view(np.uint8),
                                          torch.float32, 8)
    values, offsets = np.array([3, 4, 5, 6, 7], np.int64), np.array([0, 2, 2, 2, 5], np.int64)  # key 1: 3 ids
    jobs = ffi.new("ibp_keyed_job[]", 2)
    for j, copy in zip(jobs, (other._c, ffi.NULL)):
        j.table, j.copy, j.key, j.dtype, j.dim, j.mode = t._c, copy, 1, lib.IBP_DTYPE_F32, 8, lib.IBP_POOL_SUM
    ids, off = torch.from_numpy(values[2:]), torch.tensor([0, 0, 3])
    for below, source, wanted in ((3, t, 0), (4, other, 1)):  # fewer than copy_below ids: the copy (job 1 has none)
        jobs[0].copy_below = jobs[1].copy_below = below
        rc, _, got_wanted, out = keyed_call(jobs, values, offsets, 2, 2, 16)
        assert rc == lib.IBP_OK and got_wanted == wanted
        assert_bits_equal(out[:, :8], source.lookup(ids, off))
        assert_bits_equal(out[:, 8:], t.lookup(ids, off))
    jobs[0].copy_below = jobs[1].copy_below = 0
    jobs[1].key = 2
    assert keyed_call(jobs, values, offsets, 2, 2, 16)[:2] == (lib.IBP_E_ARG, 1)  # a key the batch lacks
    jobs[1].key = 0
    for bad in (np.array([0, 2, 1, 2, 5]), np.array([1, 2, 2, 2, 5]), np.array([0, 2, 2, 2, 4])):  # down, not 0 .. len
        assert keyed_call(jobs, values, bad.astype(np.int64), 2, 2, 16)[:2] == (lib.IBP_E_ARG, 2)
    values[1] = 20
    assert keyed_call(jobs, values, offsets, 2, 2, 16)[:2] == (lib.IBP_E_INDEX, 1)  # key 0's id 20 of 20 rows


def test_lists_lookup_pools_each_jobs_arrays_and_refuses_bad_ones():
    """ibp_lookup_lists: job j's own ids, offsets and weights; its copy below copy_below."""
    t = ibp_embed.compress(structured(20, 8, torch.float32, seed=1), progress=False)
    other = ibp_embed.CompressedTable.raw(structured(20, 8, torch.float32, seed=2).numpy().view(np.uint8),
                                          torch.float32, 8)
    ids = [np.array([3, 4, 5], np.int64), np.array([6], np.int64)]
    offs = [np.array([0, 1, 3], np.int64), np.array([0, 0, 1], np.int64)]
    w = np.array([0.5, -2.0, 4.0], np.float32)
    jobs = ffi.new("ibp_keyed_job[]", 2)
    for j in jobs:
        j.table, j.copy, j.copy_below, j.dtype, j.dim, j.mode = t._c, other._c, 2, lib.IBP_DTYPE_F32, 8, 0
    keep = [ffi.cast("const int64_t *", a.ctypes.data) for a in ids + offs] + [ffi.cast("const float *", w.ctypes.data)]
    indices, offsets = ffi.new("const int64_t *[]", keep[:2]), ffi.new("const int64_t *[]", keep[2:4])
    weights, counts = ffi.new("const float *[]", [keep[4], ffi.NULL]), ffi.new("uint64_t[]", [3, 1])
    out, res = torch.full((2, 16), float("nan")), ffi.new("uint64_t[2]")

    def call():
        return lib.ibp_lookup_lists(jobs, 2, indices, counts, offsets, weights, 2,
                                    ffi.cast("float *", out.data_ptr()), res, res + 1)
    assert call() == lib.IBP_OK and res[1] == 0  # job 1 (1 id, below 2) from the copy: it has one
    assert_bits_equal(out[:, :8], t.lookup(torch.from_numpy(ids[0]), torch.from_numpy(offs[0]),
                                           per_sample_weights=torch.from_numpy(w)))
    assert_bits_equal(out[:, 8:], other.lookup(torch.from_numpy(ids[1]), torch.from_numpy(offs[1])))
    jobs[1].copy = ffi.NULL
    assert call() == lib.IBP_OK and res[1] == 1  # wanted, pooled from the table
    assert_bits_equal(out[:, 8:], t.lookup(torch.from_numpy(ids[1]), torch.from_numpy(offs[1])))
    offs[1][1] = 2  # decreasing
    assert (call(), res[0]) == (lib.IBP_E_ARG, 1)
    offs[1][1], ids[0][2] = 0, 20
    assert (call(), res[0]) == (lib.IBP_E_INDEX, 0)


def test_an_allocation_failure_is_a_memory_error(monkeypatch):
    """libibp's IBP_E_NOMEM with no failed job (its own buffers) is no offsets error."""
    t = ibp_embed.compress(structured(10, 4, torch.float32), progress=False)

    class NoMemory:
        def __getattr__(self, name):
            if name not in ("ibp_lookup_keyed", "ibp_lookup_lists"):
                return getattr(lib, name)

            def refuse(jobs, n_jobs, *args):
                args[-2][0] = n_jobs
                return lib.IBP_E_NOMEM
            return refuse

    monkeypatch.setattr(packed_jobs, "lib", NoMemory())
    with pytest.raises(MemoryError):
        Jobs([t], ["sum"], [0])(np.array([1, 2], np.int64), np.array([0, 1, 2], np.int64), None, 2, str)
    with pytest.raises(MemoryError):
        ibp_embed.lookup_many([t], [np.array([1, 2], np.int64)], [np.array([0, 1, 2], np.int64)])


def test_a_table_whose_copy_fails_is_looked_up_as_before():
    """A corrupt row (a table built without validation): no copy, and only the calls
    that name the row fail."""
    from helpers import magnitude_clusters

    t = ibp_embed.compress(magnitude_clusters(), clusters=4, progress=False)
    payload = np.array(t._payload)
    payload[int(t._row_starts()[7])] = 200  # row 7's cluster byte names no cluster
    bad = ibp_embed.CompressedTable(shape=t.shape, dtype=t.dtype, word_bits=t.word_bits, masks=t._masks,
                                    bitvals=t._bitvals, block_base=t._block_base, rel=t._rel, payload=payload,
                                    payload_bytes=t._payload_bytes, validate=False)
    jobs = Jobs([bad], ["sum"], [0])
    values, offsets = np.array([1, 2, 3], np.int64), np.array([0, 2, 3], np.int64)
    assert_bits_equal(jobs(values, offsets, None, 2, str), expected([t], ["sum"], [0], values, offsets, None, 2))
    assert jobs.copy_nbytes == 0
    with pytest.raises(ibp_embed.FormatError):
        jobs(np.array([1, 7, 3], np.int64), offsets, None, 2, str)


def test_packed_jobs_refuse_bad_input():
    t = ibp_embed.compress(structured(10, 4, torch.float32), progress=False)
    jobs = Jobs([t, t], ["sum", "sum"], [0, 1])
    values, offsets = np.array([1, 2, 10, 3], np.int64), np.array([0, 1, 2, 3, 4], np.int64)
    with pytest.raises(IndexError, match=r"^job 1: id 10 out of range for a table of 10 rows$"):
        jobs(values, offsets, None, 2, lambda k: f"job {k}")
    with pytest.raises(ValueError, match="do not hold"):  # 3 bags do not divide 4 offsets' bags
        jobs(values, offsets, None, 3, lambda k: f"job {k}")
    with pytest.raises(ValueError, match="do not hold"):  # key 1 of a batch with one key
        jobs(values[:2], offsets[:3], None, 2, lambda k: f"job {k}")
    with pytest.raises(TypeError, match="CompressedTable"):
        Jobs([t.decompress()], ["sum"], [0])
    with pytest.raises(ValueError, match="as many"):
        Jobs([t], ["sum", "sum"], [0])
    with pytest.raises(ValueError, match="negative"):
        Jobs([t], ["sum"], [-1])
    with pytest.raises(ValueError, match="as many key indices"):
        Jobs([t, t], ["sum", "sum"], [0])
    with pytest.raises(ValueError, match="without key indices"):
        Jobs([t], ["sum"], [])(values, offsets, None, 2, str)
    with pytest.raises(ValueError, match=r"\[4, 1\] words"):
        PackedJobs([t], ["sum"]).run_arrays(np.zeros((4, 2), np.uint64), 1, [t].__getitem__)
    # a decrease to INT64_MIN: refused before any offset is taken from another (no overflow)
    low = np.array([0, 1, 2, np.iinfo(np.int64).min, 4], np.int64)
    with pytest.raises(ValueError, match="job 1: offsets must be non-decreasing"):
        jobs(values, low, None, 2, lambda k: f"job {k}")
    assert Jobs([], [], [])(values, offsets, None, 2, str).shape == (2, 0)
    assert Jobs([t], ["sum"], [0])(values[:0], offsets[:1], None, 0, str).shape == (0, 4)


# ---------------------------------------------------------------- the modules' cache

def collection(tables_rows, dim=8, seed=0):
    from torchrec import EmbeddingBagConfig

    from ibp_embed.torchrec import IBPEmbeddingBagCollection

    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{i}"])
               for i, n in enumerate(tables_rows)]
    tables = {f"t{i}": ibp_embed.compress(structured(n, dim, torch.float32, seed=seed + i), progress=False)
              for i, n in enumerate(tables_rows)}
    return IBPEmbeddingBagCollection(configs, _tables=tables)


def kjt(keys, n_bags, n_rows, seed):
    from torchrec import KeyedJaggedTensor

    values, offsets = kjt_layout(np.random.default_rng(seed), len(keys), n_bags, n_rows)
    return KeyedJaggedTensor(keys=list(keys), values=torch.from_numpy(values), offsets=torch.from_numpy(offsets))


def reference_values(ebc, features):
    """The module's output through per-feature lookups (its traced path's ops)."""
    d = features.to_dict()
    return torch.cat([bag.table.lookup(d[f].values(), d[f].offsets())
                      for i, bag in enumerate(ebc.embedding_bags.values()) for f in ebc._feature_names[i]], dim=1)


def test_module_cache_follows_keys_and_tables():
    ebc = collection([30, 40, 50])
    for keys in (["f0", "f1", "f2"], ["f2", "f0", "f1"], ["f1", "x", "f2", "f0"]):  # reordered, an extra key
        features = kjt(keys, 7, 30, seed=len(keys))
        assert_bits_equal(ebc(features).values(), reference_values(ebc, features))
    entry = ebc._job_cache._entry
    features = kjt(["f1", "x", "f2", "f0"], 5, 30, seed=9)
    ebc(features)
    assert ebc._job_cache._entry is entry  # same keys and tables: reused
    # new weights: new tables, new jobs
    state = {k: v * 2 for k, v in ebc.state_dict().items()}
    ebc.load_state_dict(state)
    got = ebc(features).values()
    assert ebc._job_cache._entry is not entry
    assert_bits_equal(got, reference_values(ebc, features))
    with pytest.raises(IndexError, match=r"feature 'f2' of table 't2': id 30 out of range for a table of 30 rows"):
        ebc2 = collection([40, 40, 30])
        bad = kjt(["f0", "f1", "f2"], 3, 40, seed=1)
        bad.values()[-1] = 30
        bad.values()[:-1] = 0
        ebc2(bad)


def test_module_reports_its_lookup_copies():
    ebc = collection([30, 40])
    stats = ebc.memory_stats()
    assert stats["lookup_copy_bytes"] == 0 and stats["total_bytes"] == stats["compressed_bytes"]
    ebc(kjt(["f0", "f1"], 2, 30, seed=4))  # a few ids a row: both tables copied
    stats = ebc.memory_stats()
    assert stats["lookup_copy_bytes"] == ebc.raw_nbytes
    assert stats["total_bytes"] == stats["compressed_bytes"] + stats["lookup_copy_bytes"]


def test_module_cache_does_not_keep_dropped_tables():
    import gc
    import weakref

    ebc = collection([30, 40])
    features = kjt(["f0", "f1"], 3, 30, seed=2)
    ebc(features)
    old = weakref.ref(ebc.embedding_bags["t0"].table)
    ebc.load_state_dict({k: v + 1 for k, v in ebc.state_dict().items()})
    gc.collect()
    assert old() is None  # freed before any call rebuilds the jobs
    assert_bits_equal(ebc(features).values(), reference_values(ebc, features))


def test_module_cache_never_runs_jobs_of_freed_tables():
    """A module made trainable (its tables replaced and freed), then moved to meta (no
    tables): an eager call must say the module has no weights, not run the jobs built
    for the freed tables."""
    from ibp_embed.optim import SGD

    ebc = collection([300, 400])
    features = kjt(["f0", "f1"], 3, 300, seed=2)
    with torch.no_grad():
        ebc(features)
    ebc.set_optimizer(SGD(lr=0.1))
    ebc.to("meta")
    with torch.no_grad(), pytest.raises(RuntimeError, match="meta device"):
        ebc(features)


def test_module_copies_outlive_a_change_of_keys():
    ebc = collection([30, 40])
    tables = [b.table for b in ebc.embedding_bags.values()]
    with torch.no_grad():
        ebc(kjt(["f0", "f1"], 2, 30, seed=1))
        copies = [t._lookup_copy() for t in tables]
        ebc(kjt(["f1", "f0"], 2, 30, seed=1))  # new jobs, the same copies
    assert all(c is not None and t._lookup_copy() is c for t, c in zip(tables, copies))
    assert ebc.memory_stats()["lookup_copy_bytes"] == ebc.raw_nbytes


def test_module_cache_survives_copies_and_pickles():
    ebc = collection([20, 25])
    features = kjt(["f0", "f1"], 6, 20, seed=3)
    want = ebc(features).values()
    for other in (copy.deepcopy(ebc), pickle.loads(pickle.dumps(ebc))):
        assert other._job_cache._entry is None
        assert_bits_equal(other(features).values(), want)
    meta = kjt(["f0", "f1"], 6, 20, seed=3).to(torch.device("meta"))
    assert ebc(meta).values().is_meta


def test_module_cache_from_several_threads():
    ebc = collection([64, 64, 64])
    batches = [kjt(["f0", "f1", "f2"], 16, 64, seed=s) for s in range(6)]
    want = [reference_values(ebc, b) for b in batches]
    errors = []

    def run(k):
        try:
            for r in range(20):
                i = (k + r) % len(batches)
                if not torch.equal(ebc(batches[i]).values(), want[i]):
                    errors.append((k, r))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
