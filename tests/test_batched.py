"""ibp_embed.lookup_many's kept jobs: the TBE layout and lists that need no conversion
against each table's own lookup, bit for bit; bad arguments refused as the checked
path refuses them; the kept jobs never outliving their tables; libibp's own check
that a job's offsets end at its ids' count."""
from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ibp_embed
from ibp_embed import batched, packed_jobs
from ibp_embed._native import ffi, lib
from ibp_embed.store import UpdatableTable

from helpers import assert_bits_equal, structured

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def make_tables(seed: int, n: int):
    rng = np.random.default_rng(seed)
    return [ibp_embed.compress(structured(int(rng.integers(1, 80)), int(rng.choice([1, 4, 8, 33])), DTYPES[k % 3],
                                          seed=seed + k), progress=False) for k in range(n)]


def tbe_batch(rng, tables, n_bags: int, weighted: bool):
    """Every table's ids and offsets in a TBE's layout (table after table), with empty
    bags and repeated ids."""
    sizes = rng.integers(0, 6, len(tables) * n_bags)
    sizes[::3] = 0
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    ids = np.concatenate([rng.integers(0, t.shape[0], int(sizes[k * n_bags:(k + 1) * n_bags].sum()))
                          for k, t in enumerate(tables)] + [np.zeros(0)]).astype(np.int64)
    weights = rng.standard_normal(ids.size).astype(np.float32) if weighted else None
    return ids, offsets, weights


def per_table(tables, ids, offsets, weights, n_bags: int):
    """The TBE layout split per table: ids, bag offsets from 0, weights."""
    out = []
    for k in range(len(tables)):
        lo, hi = int(offsets[k * n_bags]), int(offsets[(k + 1) * n_bags])
        out.append((ids[lo:hi], offsets[k * n_bags:(k + 1) * n_bags + 1] - lo,
                    None if weights is None else weights[lo:hi]))
    return out


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n_tables=st.integers(1, 4), n_bags=st.integers(1, 7),
       weighted=st.booleans(), copies=st.booleans(), as_torch=st.booleans())
def test_kept_jobs_match_each_tables_lookup(seed, n_tables, n_bags, weighted, copies, as_torch):
    rng = np.random.default_rng(seed)
    tables = make_tables(seed, n_tables)
    modes = ["mean" if rng.random() < 0.3 else "sum" for _ in tables]
    ids, offsets, weights = tbe_batch(rng, tables, n_bags, weighted)
    parts = per_table(tables, ids, offsets, weights, n_bags)
    want = torch.cat([t.lookup(i, o, w, mode=m) for t, (i, o, w), m in zip(tables, parts, modes)], dim=1)
    conv = torch.from_numpy if as_torch else np.asarray
    with pytest.MonkeyPatch.context() as m:  # small tables' decoded copies always / never
        m.setattr(packed_jobs, "COPY_IDS_PER_ROW", 10**9 if copies else 0)
        tbe = ibp_embed.lookup_many(tables, conv(ids), conv(offsets), None if weights is None else conv(weights),
                                    modes)
        lists = ibp_embed.lookup_many(tables, [conv(i) for i, _, _ in parts], [conv(o) for _, o, _ in parts],
                                      None if weights is None else [conv(w) for _, _, w in parts], modes)
    assert_bits_equal(tbe, want)
    assert_bits_equal(lists, want)


def test_the_kept_path_is_the_one_taken():
    """Lists that need no conversion and the TBE layout run the kept jobs; others are
    converted (and give the same sums)."""
    tables = make_tables(3, 3)
    rng = np.random.default_rng(3)
    ids, offsets, weights = tbe_batch(rng, tables, 5, True)
    parts = per_table(tables, ids, offsets, weights, 5)
    lists = ([torch.from_numpy(i) for i, _, _ in parts], [torch.from_numpy(o) for _, o, _ in parts],
             [torch.from_numpy(w) for _, _, w in parts])
    want = ibp_embed.lookup_many(tables, *lists)
    checked = []  # calls that took the checked path (converted arguments)
    with pytest.MonkeyPatch.context() as m:
        real = batched._lookup_many_checked
        m.setattr(batched, "_lookup_many_checked", lambda *a: checked.append(1) or real(*a))
        assert_bits_equal(ibp_embed.lookup_many(tables, *lists), want)
        assert_bits_equal(ibp_embed.lookup_many(tables, ids, offsets, weights), want)
        assert not checked
        strided = [torch.from_numpy(np.repeat(i, 2))[::2] for i, _, _ in parts]  # not contiguous
        as_int32 = [torch.from_numpy(o).int() for _, o, _ in parts]
        as_lists = [i.tolist() for i, _, _ in parts]
        for args in ((strided, lists[1], lists[2]), (lists[0], as_int32, lists[2]), (as_lists, lists[1], lists[2]),
                     (lists[0], lists[1], [w.double() for w in lists[2]])):
            assert_bits_equal(ibp_embed.lookup_many(tables, *args), want)
        assert len(checked) == 4


def test_tbe_layout_with_an_updatable_table_runs_table_by_table():
    tables = make_tables(5, 3)
    ids, offsets, weights = tbe_batch(np.random.default_rng(5), tables, 4, False)
    want = ibp_embed.lookup_many(tables, ids, offsets, weights)
    mixed = [tables[0], UpdatableTable(tables[1], repack_drift=None), tables[2]]
    assert_bits_equal(ibp_embed.lookup_many(mixed, torch.from_numpy(ids), torch.from_numpy(offsets)), want)


def test_bad_arguments_are_refused_on_every_path():
    tables = make_tables(7, 2)
    rng = np.random.default_rng(7)
    ids, offsets, _ = tbe_batch(rng, tables, 4, False)
    parts = per_table(tables, ids, offsets, None, 4)
    ids_l, off_l = [torch.from_numpy(i) for i, _, _ in parts], [torch.from_numpy(o) for _, o, _ in parts]
    n1 = tables[1].shape[0]
    # an id out of range, in the last table (and negative)
    for bad_id in (n1, -1):
        bad = ids.copy()
        bad[-1] = bad_id
        with pytest.raises(IndexError, match=f"table 1: .*{bad_id} out of range for a table of {n1} rows"):
            ibp_embed.lookup_many(tables, bad, offsets)
        bad_l = list(ids_l)
        bad_l[1] = torch.from_numpy(bad[int(offsets[4]):])
        with pytest.raises(IndexError, match=f"table 1: row index {bad_id} out of range"):
            ibp_embed.lookup_many(tables, bad_l, off_l)
    # offsets: decreasing, not ending at the ids' count, not starting at 0, a count not T x B + 1
    down = off_l[1].clone()
    down[1], down[2] = down[2] + 1, down[1]
    short = off_l[1].clone()
    short[-1] -= 1
    late = off_l[1] + 1
    ends = r"start at 0 and end at len\(indices\) = \d+, got"
    for bad_off, msg in ((down, "be non-decreasing"), (short, ends + " 0 "), (late, ends + " 1 ")):
        with pytest.raises(ValueError, match=f"table 1: offsets must ({msg})"):
            ibp_embed.lookup_many(tables, ids_l, [off_l[0], bad_off])
    with pytest.raises(ValueError, match=r"table 0: offsets must start at 0 and end at len\(indices\) = \d+, got 0 \.\. 0"):
        ibp_embed.lookup_many(tables, ids_l, [torch.zeros(1, dtype=torch.int64)] * 2)  # ids but no bags
    tbe_down = offsets.copy()
    tbe_down[5], tbe_down[6] = tbe_down[6] + 1, tbe_down[5]
    with pytest.raises(ValueError, match="table 1: offsets must be non-decreasing"):
        ibp_embed.lookup_many(tables, ids, tbe_down)
    mixed = [tables[0], UpdatableTable(tables[1], repack_drift=None)]  # table by table
    with pytest.raises(ValueError, match="table 1: offsets must"):
        ibp_embed.lookup_many(mixed, ids, tbe_down)
    with pytest.raises(ValueError, match="2 tables x B bags"):
        ibp_embed.lookup_many(tables, ids, offsets[:-1])
    with pytest.raises(ValueError, match="run from 0 to len"):
        ibp_embed.lookup_many(tables, ids[:-1], offsets)
    with pytest.raises(ValueError, match="per_sample_weights must be 1-D like indices"):
        ibp_embed.lookup_many(tables, ids, offsets, np.ones(ids.size + 1, np.float32))
    with pytest.raises(ValueError, match="table 0: per_sample_weights"):
        ibp_embed.lookup_many(tables, ids_l, off_l, [torch.ones(ids_l[0].numel() + 1), None])
    with pytest.raises(TypeError, match="indices must be integers"):
        ibp_embed.lookup_many(tables, ids.astype(np.float32), offsets)
    with pytest.raises(ValueError, match="table 1: mode"):
        ibp_embed.lookup_many(tables, ids, offsets, mode=["sum", "max"])
    with pytest.raises(TypeError, match="mode must be 'sum', 'mean' or one of those per table, not None"):
        ibp_embed.lookup_many(tables, ids, offsets, mode=None)
    with pytest.raises(ValueError, match="indices must be one 1-D tensor .* not a 2-D Tensor with 1-D offsets"):
        ibp_embed.lookup_many(tables[:1], torch.tensor([[1]]), torch.tensor([0, 1]))
    rows = torch.tensor([[1, 2], [3, 0]])  # a row of ids and a row of offsets a table: taken as lists
    assert torch.equal(ibp_embed.lookup_many(tables, rows, torch.tensor([[0, 2], [0, 2]])).view(torch.int32),
                       ibp_embed.lookup_many(tables, list(rows), [torch.tensor([0, 2])] * 2).view(torch.int32))
    with pytest.raises(TypeError, match="per_sample_weights must be real numbers, got complex"):
        ibp_embed.lookup_many(tables, ids, offsets, np.ones(ids.size, np.complex64))


def test_libibp_refuses_offsets_past_the_ids():
    """A job whose offsets end anywhere but at its ids' count is refused before a row
    is read (the offsets are not trusted to stay within the ids)."""
    t = make_tables(9, 1)[0]
    ids, off = np.zeros(4, np.int64), np.array([0, 2, 4], np.int64)
    out = np.zeros((2, t.shape[1]), np.float32)
    job = ffi.new("ibp_lookup_job *")
    job.table, job.dim = t._c, t.shape[1]
    job.dtype = getattr(lib, {torch.float32: "IBP_DTYPE_F32", torch.float16: "IBP_DTYPE_F16",
                              torch.bfloat16: "IBP_DTYPE_BF16"}[t.dtype])
    job.indices, job.offsets = ffi.cast("const int64_t *", ids.ctypes.data), ffi.cast("const int64_t *", off.ctypes.data)
    job.n_bags, job.mode = 2, lib.IBP_POOL_SUM
    job.out, job.out_stride = ffi.cast("float *", out.ctypes.data), t.shape[1]
    for n_indices, rc in ((4, lib.IBP_OK), (3, lib.IBP_E_ARG), (5, lib.IBP_E_ARG), (0, lib.IBP_E_ARG)):
        job.n_indices = n_indices
        assert lib.ibp_lookup_many(job, 1, ffi.NULL) == rc, n_indices


def test_kept_jobs_go_with_their_tables():
    """The jobs hold the tables' native handles, not the tables: a freed table takes its
    jobs out of the cache, and tables made later (even at a freed one's address) get
    jobs of their own."""
    ids, offsets = np.array([0, 1, 2, 0], np.int64), np.array([0, 2, 3, 4], np.int64)
    for seed in range(4):
        tables = make_tables(seed, 3)
        ids_ok = np.minimum(ids, min(t.shape[0] for t in tables) - 1)
        want = ibp_embed.lookup_many(tables, [ids_ok[0:2], ids_ok[2:3], ids_ok[3:4]],
                                     [np.array([0, 2]), np.array([0, 1]), np.array([0, 1])])
        got = ibp_embed.lookup_many(tables, ids_ok, np.array([0, 2, 3, 4], np.int64))
        assert_bits_equal(got, want)
        assert want.shape[0] == 1
        key = (*map(id, tables), "sum", "sum", "sum")
        assert key in batched._cache
        del tables
        gc.collect()
        assert key not in batched._cache
    assert len(batched._cache) <= batched._CACHED


def test_small_tables_copy_once_and_report_it():
    t = ibp_embed.compress(structured(100, 8, torch.float32), progress=False)
    assert t.lookup_copy_nbytes == 0
    ids, off = torch.arange(6) % 100, torch.tensor([0, 3, 6])
    want = t.lookup(ids, off)
    assert torch.equal(ibp_embed.lookup_many([t], [ids], [off]), want)
    assert t.lookup_copy_nbytes == t.raw_nbytes
    copy = t._lookup_copy()
    assert copy.is_raw and torch.equal(copy.decompress(), t.decompress())
    assert torch.equal(ibp_embed.lookup_many([t, t], torch.cat([ids, ids]), torch.tensor([0, 3, 6, 9, 12])),
                       torch.cat([want, want], dim=1))
    assert t._lookup_copy() is copy  # made once


def test_a_table_freed_while_the_cache_is_being_written_does_not_hang():
    """A table's death removes its jobs from the cache without the cache's lock: a
    collection that frees it may run inside a thread's write to the cache (a real
    deadlock, found in review, with tables in reference cycles). In a subprocess,
    under a timeout: a hang must fail the test, not the suite."""
    code = textwrap.dedent("""
        import gc, torch, ibp_embed
        from ibp_embed import batched
        t = ibp_embed.compress(torch.arange(40.0).reshape(10, 4), allow_raw=False, progress=False)
        ibp_embed.lookup_many([t], [torch.tensor([1, 2])], [torch.tensor([0, 2])])
        key = next(iter(batched._cache))
        with batched._cache_lock:  # as _jobs_for holds it while it allocates
            del t
            gc.collect()
        assert key not in batched._cache
        print("done")
    """)
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr[-2000:]


def test_tensors_whose_memory_does_not_hold_their_values_are_converted():
    """A negated view (conj().imag of a complex tensor, the negative bit) is read
    through its values, not its memory."""
    t = ibp_embed.compress(torch.arange(1.0, 41.0).reshape(10, 4), allow_raw=False, progress=False)
    ids, off = torch.tensor([1]), torch.tensor([0, 1])
    w = torch.tensor([1 + 2j]).conj().imag  # one element: contiguous whatever its stride
    assert w.is_neg() and w.is_contiguous()
    assert_bits_equal(ibp_embed.lookup_many([t], [ids], [off], [w]), t.lookup(ids, off, w.clone()))
    with pytest.raises(IndexError, match="table 0: row index -1 out of range"):
        ibp_embed.lookup_many([t], [torch._neg_view(torch.tensor([1]))], [off])


def test_tbe_layout_arguments_that_belong_to_lists_are_refused_or_taken_as_lists():
    t = make_tables(13, 1)[0]
    ids, off = torch.tensor([0, 0, 0]), torch.tensor([0, 3])
    with pytest.raises(TypeError, match="per_sample_weights is one tensor like indices"):
        ibp_embed.lookup_many([t], ids, off, [None])
    with pytest.raises(ValueError, match="per_sample_weights must be 1-D like indices"):
        ibp_embed.lookup_many([t], ids, off, torch.ones(3, 1))
    per_table = np.empty(1, dtype=object)  # a NumPy array of each table's ids: lists, as before
    per_table[0] = ids.numpy()
    assert_bits_equal(ibp_embed.lookup_many([t], per_table, [off]), t.lookup(ids, off))


def test_the_checked_path_takes_no_copies_and_reads_contiguous_arrays_only():
    """_lookup_many_checked (the fallbacks', the tests' native paths) runs libibp's own
    paths, not a decoded copy; an array that is not contiguous never reaches libibp."""
    t = ibp_embed.compress(structured(100, 8, torch.float32), progress=False)
    ids, off = np.arange(6, dtype=np.int64), np.array([0, 3, 6], np.int64)
    assert_bits_equal(batched._lookup_many_checked([(t, ids, off, None, "sum")], 2), t.lookup(ids, off))
    assert t.lookup_copy_nbytes == 0
    with pytest.raises(ValueError, match="contiguous"):
        batched._lookup_many_checked([(t, np.arange(12, dtype=np.int64)[::2], off, None, "sum")], 2)
