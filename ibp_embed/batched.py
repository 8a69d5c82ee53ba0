"""lookup_many: pooled lookups of several tables over one batch, as FBGEMM's TBE forward.

A TBE forward takes its tables' ids and offsets as tensors and hands them to one
native kernel. lookup_many did the same through lookup()'s argument checks (NumPy
conversions) and a cffi job filled field by field for every table: into the 26
Criteo Kaggle tables (scale 0.01, fp32 d64, P20 Zipf ids, 1 thread, a Zen 4 EPYC)
it took 165 us at B1 against the TBE's 84 us, 0.51-0.61x its speed up to B128
(an ad-hoc timing). Calls whose arrays need no conversion now only read each
array's address and length; the jobs of the last few sets of tables are kept
(PackedJobs, with the small tables' decoded copies) and libibp checks what it
reads: the offsets (from 0 to the ids' count, never decreasing) and every id.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np
import torch

from ._native import lib
from .packed_jobs import PackedJobs, array_address
from .table import (_MODES, CompressedTable, TableReads, _as_float_array, _as_index_array, _check_lookup_rc,
                    _ndim, check_real_weights)

# the jobs of the last _CACHED sets of (tables, modes) built: a program usually calls with one
_CACHED = 8
_cache: dict = {}  # (id of each table, modes) -> (weak refs to the tables, PackedJobs, token)
_cache_lock = threading.Lock()  # for inserting; a table's death removes its entries without it


def _address(x, tdtype: torch.dtype, ndtype: type):
    """(address, length) of x if it is a 1-D contiguous CPU tensor or NumPy array of
    that dtype (exactly those types: subclasses are converted) whose memory holds its
    values (not a negated view, not a zero tensor without memory), else None."""
    if type(x) is torch.Tensor:
        if x.dtype is tdtype and x.is_cpu and x.layout is torch.strided and x.dim() == 1 and x.is_contiguous() \
                and not x.is_neg():
            n = x.numel()
            p = x.data_ptr()
            return (p, n) if p or not n else None
    elif type(x) is np.ndarray and x.dtype == ndtype and x.ndim == 1 and x.flags.c_contiguous:
        return array_address(x), x.size
    return None


def _jobs_for(tables: list, modes: list):
    """The PackedJobs of these tables and modes, built and kept on first use (None
    where the tables or modes are not all what PackedJobs takes)."""
    try:
        key = (*map(id, tables), *modes)
        entry = _cache.get(key)
    except TypeError:  # an unhashable mode: lookup_many's checks name it
        return None
    if entry is not None and all(r() is t for r, t in zip(entry[0], tables)):
        return entry[1]
    if not all(type(t) is CompressedTable for t in tables) or not all(m in _MODES for m in modes):
        return None
    try:
        packed = PackedJobs(tables, modes, range(len(tables)))
    except TypeError:  # a table of a dtype lookups refuse
        return None

    token = object()

    def forget(_):  # a table died: its jobs go (their handles point into it). No lock: a
        # collection that frees a table may run this inside _cache_lock, on the same thread
        got = _cache.get(key)
        if got is not None and got[2] is token:
            _cache.pop(key, None)

    with _cache_lock:
        while len(_cache) >= _CACHED:
            _cache.pop(next(iter(_cache)), None)
        _cache[key] = (tuple(weakref.ref(t, forget) for t in tables), packed, token)
    return packed


def _packed_lookup_many(tables: list, indices: list, offsets: list, weights: list, modes: list):
    """lookup_many's result through kept jobs, or None where the arguments need
    converting or libibp refused them (lookup_many's checks then say why)."""
    if not tables:
        return None
    arrays = ([], [], [], [])  # PackedJobs.run_arrays' rows (a NumPy store each: 20 us for 26 tables)
    n_bags = None
    for k in range(len(tables)):
        ids, off = _address(indices[k], torch.int64, np.int64), _address(offsets[k], torch.int64, np.int64)
        if n_bags is None and off is not None:
            n_bags = off[1] - 1
        if ids is None or off is None or off[1] - 1 != n_bags or n_bags < 0:
            return None
        w = (0, ids[1]) if weights[k] is None else _address(weights[k], torch.float32, np.float32)
        if w is None or w[1] != ids[1]:
            return None
        for row, x in zip(arrays, (ids[0], ids[1], off[0], w[0])):
            row.append(x)
    packed = _jobs_for(tables, modes)
    if packed is None:
        return None
    out, _, _ = packed.run_arrays(np.array(arrays, dtype=np.uint64), n_bags, tables.__getitem__)
    return out


def lookup_many(tables, indices, offsets, per_sample_weights=None, mode="sum") -> torch.Tensor:
    """Pooled lookups of several tables over one batch, as FBGEMM's TBE forward does them.

    Table t pools its bags from indices[t] and offsets[t] exactly as
    ``tables[t].lookup(indices[t], offsets[t], ...)`` would, every table with the same
    number of bags B; its sums fill columns [D_0 + .. + D_{t-1}, + D_t) of one
    [B, sum of dims] float32 tensor. per_sample_weights: None, or one entry per table
    (None or that table's weights); mode: "sum" / "mean" for all, or one per table.
    Or, as a TBE forward takes them: indices one 1-D tensor of every table's ids,
    table after table, offsets one [T * B + 1] tensor into it (table t's bag b pools
    indices[offsets[t * B + b] : offsets[t * B + b + 1]]) and per_sample_weights one
    tensor like indices (or None).
    CompressedTables run in one native call that spreads all their bags over the
    threads (faster than one lookup per table); bad arguments raise what lookup()
    raises, naming the table.

    Calls into CompressedTables reuse the native jobs of an earlier call into the same
    tables and modes where the ids and offsets need no conversion: the TBE layout, or
    lists of 1-D contiguous CPU int64 tensors or NumPy arrays (float32 weights).
    """
    tables = list(tables)
    n = len(tables)
    if not isinstance(mode, str) and not hasattr(mode, "__iter__"):
        raise TypeError(f"mode must be 'sum', 'mean' or one of those per table, not {mode!r}")
    modes = [mode] * n if isinstance(mode, str) else list(mode)
    arrays = (torch.Tensor, np.ndarray)
    if isinstance(indices, arrays) and (indices.ndim not in (1, 2) or indices.ndim == 2 and
                                        isinstance(offsets, arrays) and offsets.ndim != 2):
        raise ValueError(f"indices must be one 1-D tensor of every table's ids (the TBE layout), or one per "
                         f"table (a row each of a 2-D tensor, with offsets a row each), not a "
                         f"{indices.ndim}-D {type(indices).__name__} with {np.ndim(offsets)}-D offsets")
    if isinstance(indices, arrays) and indices.ndim == 1 and indices.dtype != object:
        vals, off, w, b = _tbe_layout(n, indices, offsets, per_sample_weights)
        packed = _jobs_for(tables, modes) if len(modes) == n else None
        if packed is not None:
            return packed(vals, off, w, b, "table {}".format, tables.__getitem__)
        indices, offsets, per_sample_weights = _split_tbe_layout(n, vals, off, w, b)
    weights = [None] * n if per_sample_weights is None else list(per_sample_weights)
    indices, offsets = list(indices), list(offsets)
    if not len(indices) == len(offsets) == len(weights) == len(modes) == n:
        raise ValueError(f"{n} tables need {n} indices, offsets, per_sample_weights and modes; got "
                         f"{len(indices)}, {len(offsets)}, {len(weights)}, {len(modes)}")
    out = _packed_lookup_many(tables, indices, offsets, weights, modes)
    if out is not None:
        return out
    jobs = []
    for k, t in enumerate(tables):
        if not isinstance(t, TableReads):
            raise TypeError(f"table {k}: a CompressedTable or UpdatableTable, not {type(t).__name__}")
        try:
            jobs.append((t, *t._lookup_args(indices[k], offsets[k], weights[k], modes[k]), modes[k]))
        except (TypeError, ValueError, IndexError) as e:
            raise type(e)(f"table {k}: {e}") from None
    bags = {off.size - 1 for _, _, off, _, _ in jobs}
    if len(bags) > 1:
        raise ValueError(f"every table needs the same number of bags, got {sorted(bags)}")
    b = bags.pop() if bags else 0
    if all(isinstance(t, CompressedTable) for t, *_ in jobs):
        return _lookup_many_checked(jobs, b, lambda k: f"table {k}")
    outs = [t._lookup_checked(idx, off, w, m, f"table {k}") for k, (t, idx, off, w, m) in enumerate(jobs)]
    return torch.cat(outs, dim=1) if outs else torch.empty((b, 0), dtype=torch.float32)


def _tbe_layout(n: int, indices, offsets, per_sample_weights):
    """lookup_many's TBE layout, checked: (ids int64, offsets int64 [n * B + 1] from 0
    to len(ids), weights float32 or None, B)."""
    vals = _as_index_array(indices, "indices")
    off = _as_index_array(offsets, "offsets")
    if off.ndim != 1 or off.size < 1 or (off.size - 1) % max(n, 1) or (n == 0 and off.size != 1):
        raise ValueError(f"offsets must be 1-D with {n} tables x B bags + 1 entries, got shape {off.shape}")
    if off[0] != 0 or off[-1] != vals.size:  # libibp checks that each table's offsets never decrease
        raise ValueError(f"offsets must run from 0 to len(indices) = {vals.size} (got {int(off[0])} .. "
                         f"{int(off[-1])})")
    w = None
    if per_sample_weights is not None:
        if isinstance(per_sample_weights, (list, tuple)):
            raise TypeError("with indices and offsets in the TBE layout, per_sample_weights is one tensor "
                            "like indices (or None), not a list")
        w = _as_float_array(per_sample_weights)
        if _ndim(per_sample_weights) != 1 or w.shape != vals.shape:
            raise ValueError(f"per_sample_weights must be 1-D like indices {vals.shape}, got shape "
                             f"{tuple(np.shape(per_sample_weights))}")
    return vals, off, w, (off.size - 1) // n if n else 0


def keyed_layout(values, offsets, weights, who: str):
    """A batch laid out as a KeyedJaggedTensor's (values, offsets [keys x B + 1],
    weights or None), checked: (values int64, offsets int64 from 0 to len(values) without
    decreasing, weights float32 or None), contiguous NumPy arrays on the host."""
    vals = _as_index_array(values, f"{who}: ids").reshape(-1)
    off = _as_index_array(offsets, f"{who}: offsets").reshape(-1)
    if off.size < 1 or off[0] != 0 or off[-1] != vals.size or (off[1:] < off[:-1]).any():
        raise ValueError(f"{who}: offsets must run from 0 to len(values) = {vals.size} without decreasing (got "
                         f"{int(off[0]) if off.size else None} .. {int(off[-1]) if off.size else None})")
    w = None
    if weights is not None:
        if weights.numel() != vals.size:
            raise ValueError(f"{who}: {weights.numel()} weights for {vals.size} ids")
        check_real_weights(weights, who)
        w = _as_float_array(weights)
    return vals, off, w


def _split_tbe_layout(n: int, vals, off, w, b: int):
    """The TBE layout as per-table lists (ids, bag offsets from 0, weights or None)."""
    ids, offs, ws = [], [], []
    for k in range(n):
        lo, hi = int(off[k * b]), int(off[(k + 1) * b])
        ids.append(vals[lo:hi])
        offs.append(off[k * b:(k + 1) * b + 1] - lo)
        ws.append(None if w is None else w[lo:hi])
    return ids, offs, None if w is None else ws


def _lookup_many_checked(jobs, n_bags: int, what=None) -> torch.Tensor:
    """Pooled lookups of several CompressedTables over one batch, in one native call:
    [n_bags, sum of dims] float32, job after job along the columns (as FBGEMM's TBE
    fills its output). jobs: [(table, ids, bag offsets [n_bags + 1], weights or None,
    mode)], with the arguments _lookup_checked takes (already validated). libibp
    spreads the jobs' bags over its threads in one parallel region and writes each
    job's columns in place (no per-table outputs to concatenate); no decoded copies
    (PackedJobs(copies=False)): the paths this exercises are libibp's own. what(k)
    names job k in errors."""
    for k, (t, idx, off, w, mode) in enumerate(jobs):  # O(1) checks that keep libibp inside the arrays
        if idx.dtype != np.int64 or off.dtype != np.int64 or (w is not None and w.dtype != np.float32):
            raise TypeError(f"job {k}: ids and offsets must be int64 arrays and weights float32")
        if off.size != n_bags + 1:
            raise ValueError(f"job {k}: {off.size - 1} bags, the batch has {n_bags}")
        if off[-1] != idx.size or (w is not None and w.size != idx.size):  # (libibp checks the first too)
            raise ValueError(f"job {k}: offsets end at {int(off[-1])} for {idx.size} ids"
                             + ("" if w is None else f" and {w.size} weights"))
    packed = PackedJobs([t for t, *_ in jobs], [mode for *_, mode in jobs], copies=False)
    arrays = np.array([[array_address(idx) for _, idx, _, _, _ in jobs], [idx.size for _, idx, _, _, _ in jobs],
                       [array_address(off) for _, _, off, _, _ in jobs],
                       [0 if w is None else array_address(w) for _, _, _, w, _ in jobs]],
                      dtype=np.uint64).reshape(4, len(jobs))
    out, rc, k = packed.run_arrays(arrays, n_bags, lambda k: jobs[k][0])
    if rc != lib.IBP_OK:
        _check_lookup_rc(rc, what(k) if what else f"lookup job {k}", jobs[k][1], jobs[k][2], jobs[k][0].shape[0])
    return out
