"""PackedJobs: libibp's lookup jobs for a fixed list of tables, written once.

A module's lookups (IBPEmbeddingBagCollection, the DMP kernel) and a program's calls
of lookup_many name the same tables, dims, modes and output columns call after call;
only the batch's pointers change.
Built per call (Slot objects, each feature's id and offset slices, a cffi job
filled field by field), the jobs took about 170 of
the 254 us a B1 forward into the 26 Criteo tables took, against 115-134 us for
TorchRec's fused EBC (1 thread, a Zen 4 EPYC). Here the jobs are kept as
``ibp_keyed_job``s (table, copy, key, dtype, dim, mode), and a call of a batch laid
out as a KeyedJaggedTensor's hands libibp the batch's three arrays
(ibp_lookup_keyed), which fills each job's pointers, counts and offsets itself: with
NumPy's stores into ``ibp_lookup_job``s a B1 call into the 26 tables took 33-34 us,
7 of them the lookup's own; 12-17 us so (ad-hoc timings, the same Zen 4). Calls with
each job's own arrays (run_arrays) hand libibp those arrays' addresses and counts
(ibp_lookup_lists).

Small tables are looked up from a decoded copy where a call names few ids a row of
them. The native lookup decodes a call's distinct rows of a table into a per-thread
cache, or, from IBP_FILL_IDS_PER_ROW (10) ids a row a thread, the whole table, call
after call: at inference batch sizes a table of a thousand rows then decodes most of
its rows for each few dozen bags. A table of up to COPY_MAX_BYTES raw keeps its rows
decoded (bit-exact, a raw table, made by the first call that needs it and kept by the
table: CompressedTable.lookup_copy_nbytes, memory_stats' lookup_copy_bytes), and calls
naming fewer than COPY_IDS_PER_ROW ids a row of it a libibp thread pool from the copy
as FBGEMM pools from its table. A table whose copy cannot be made (a corrupt row, in a
table loaded without verification) is looked up as before, where only the calls that
name the row fail.
The 26 Criteo tables (scale 0.01: 14 copies, 3.6 MB at fp32 d64), one call, P20
Zipf ids, against no copies (1 thread, a Zen 4 EPYC, both orders in one process):
fp32 d64 B16 0.72x the time, B128 0.68-0.71x, B512 0.86-0.96x; fp16 d64 B16 0.77x,
B128 0.75x, B512 0.86x; fp32 d128 B16 0.71x, B128 0.78x. Copies for every call
took 1.08x the time at B768 (15 ids a row of a 1000-row table): the thread's cache
of the whole table stays in L2 across tables where 14 copies do not. On 2 threads,
up to 10 ids a row a thread against 10 a row (fp32 d64): B512 0.77-0.82x the time,
B768 0.82-0.93x, B1024-B1536 0.97-1.09x (noise; fp16 d64 B512 0.80x, B1024 0.98x).
"""
from __future__ import annotations

import threading
from ctypes import addressof, c_char
from typing import Callable, Sequence

import numpy as np
import torch

from . import _native
from ._native import ffi, lib
from .dtypes import LOOKUP_DTYPES
from .table import _MODES, CompressedTable, _check_lookup_rc, _id_out_of_range

# Small tables' decoded copies (see the module's doc)
COPY_MAX_BYTES = 1 << 20
COPY_IDS_PER_ROW = lib.IBP_FILL_IDS_PER_ROW  # a thread: from there libibp decodes the whole table


def array_address(a: np.ndarray) -> int:
    """The address of a's first element (a C-contiguous array's): a third of
    a.ctypes.data's 1 us (the jobs are written for every call)."""
    if not a.flags.c_contiguous:
        raise ValueError("libibp reads contiguous arrays only")
    try:
        return addressof(c_char.from_buffer(a))
    except (TypeError, ValueError):  # read-only or empty
        return a.ctypes.data


class PackedJobs:
    """Lookups of tables[i] (CompressedTables, modes[i] "sum" or "mean"), job i filling
    columns [D_0 + .. + D_{i-1}, + D_i) of one [B, sum of dims] float32 output. A
    call passes either a batch laid out as a KeyedJaggedTensor's, job i pooling key
    key_index[i] (__call__), or each job's own arrays (run_arrays). The jobs hold the
    tables' native handles, not the tables: the caller keeps them alive for every call
    (JobCache, batched.lookup_many's cache) and passes table_of(job), whose decoded
    copy (a small table's, see the module's doc) the jobs keep once taken. libibp
    only reads the jobs, so calls from several threads share them; copies are taken
    under a lock, and new jobs replace the old whole. copies=False: none (the native
    lookup's own paths, as tests need them)."""

    def __init__(self, tables: Sequence[CompressedTable], modes: Sequence[str], key_index: Sequence[int] = (),
                 copies: bool = True):
        tables = tuple(tables)
        if len(tables) != len(modes):
            raise ValueError(f"{len(tables)} tables need as many modes, got {len(modes)}")
        for k, t in enumerate(tables):
            if not isinstance(t, CompressedTable):
                raise TypeError(f"job {k}: a CompressedTable, not {type(t).__name__}")
            if t.dtype not in LOOKUP_DTYPES:
                raise TypeError(f"job {k}: pooled lookups need a float32, float16 or bfloat16 table, not {t.dtype}")
        dims = [t.shape[1] for t in tables]
        self.width = sum(dims)
        self.key_index = np.asarray(key_index, dtype=np.int64).reshape(-1)
        if self.key_index.size and self.key_index.min() < 0:
            raise ValueError(f"key indices must not be negative, got {self.key_index.tolist()}")
        if self.key_index.size not in (0, len(tables)):  # none: run_arrays only
            raise ValueError(f"{len(tables)} tables need as many key indices, got {self.key_index.size}")
        self._keys_needed = int(self.key_index.max()) + 1 if self.key_index.size else 0
        # per job: its table's handle's address (no reference), dtype code, dim and mode code
        self._fields = [(int(ffi.cast("uintptr_t", t._c)), LOOKUP_DTYPES[t.dtype], t.shape[1], _MODES[m])
                        for t, m in zip(tables, modes)]
        self._rows = np.array([t.shape[0] for t in tables], dtype=np.int64)
        self._small = np.array([copies and not t.is_raw and 0 < t.raw_nbytes <= COPY_MAX_BYTES for t in tables],
                               dtype=bool)
        self._copies = [None] * len(tables)  # job k's table's decoded copy, once taken; never replaced
        self._copy_ptr = np.zeros(len(tables), dtype=np.uint64)
        self._copy_lock = threading.Lock()
        self._refused = 0  # copies that could not be made: a new count makes _copy_limits recompute them
        self._limit = None  # ((libibp's threads, _refused), per job the ids under which it pools from its copy)
        self._copies_made = 0  # a new count makes _keyed_jobs rebuild its jobs
        self._keyed = None  # ((the limits' key, _copies_made), ibp_keyed_job array)

    def _make_copies(self, jobs, table_of) -> None:
        with self._copy_lock:  # a copy's pointer is published once the copy is kept
            for k in jobs:
                if self._copies[k] is None and self._small[k]:
                    try:
                        copy = table_of(k)._lookup_copy()
                    except MemoryError:
                        copy = None
                    if copy is None:  # a corrupt row: only the calls that name it fail
                        self._small[k] = False
                        self._refused += 1
                        continue
                    self._copies[k] = copy
                    self._copy_ptr[k] = int(ffi.cast("uintptr_t", copy._c))
                    self._copies_made += 1

    def _copy_limits(self) -> tuple:
        """(libibp's threads, copies refused) and per job the ids under which it pools
        from its table's decoded copy (0: never)."""
        key = (lib.ibp_get_num_threads(), self._refused)  # read before _small: a refusal after it shows next call
        limit = self._limit
        if limit is None or limit[0] != key:  # one assignment: calls from several threads may race here
            limit = self._limit = (key, np.where(self._small, COPY_IDS_PER_ROW * max(1, key[0]) * self._rows, 0))
        return limit

    def _want_copies(self, n_ids: np.ndarray, table_of) -> None:
        """Makes the copies that jobs of n_ids ids each would have pooled from (for the
        next call: libibp pooled them from their tables)."""
        self._make_copies(np.flatnonzero((n_ids > 0) & (n_ids < self._copy_limits()[1]) & (self._copy_ptr == 0)),
                          table_of)

    def _keyed_jobs(self):
        """The jobs as ibp_lookup_keyed takes them, with the current copies and limits
        (a new array when they change: calls may race)."""
        limit_key, limits = self._copy_limits()
        key = (limit_key, self._copies_made)
        keyed = self._keyed
        if keyed is None or keyed[0] != key:
            jobs = ffi.new("ibp_keyed_job[]", self._rows.size)
            for k, (j, (table, dtype, dim, mode)) in enumerate(zip(jobs, self._fields)):
                j.table, j.dtype, j.dim, j.mode = ffi.cast("const ibp_table *", table), dtype, dim, mode
                j.copy = ffi.cast("const ibp_table *", int(self._copy_ptr[k]))
                j.copy_below = int(limits[k])
                j.key = int(self.key_index[k]) if self.key_index.size else 0  # (run_arrays: unused)
            keyed = self._keyed = (key, jobs)
        return keyed[1]

    def __call__(self, values: np.ndarray, offsets: np.ndarray, weights, n_bags: int,
                 what: Callable[[int], str], table_of: Callable[[int], CompressedTable]) -> torch.Tensor:
        """[n_bags, width] float32 of a batch laid out as a KeyedJaggedTensor's: values
        int64, offsets int64 [n_keys * n_bags + 1] from 0 to len(values), weights
        float32 like values or None, all contiguous (libibp checks the offsets: a
        ValueError). One native call (ibp_lookup_keyed) fills the jobs from the batch
        and runs them; a job that would pool from a small table's decoded copy it lacks
        pools from its table, and the copy is made for the next call. An out-of-range
        id raises IndexError naming what(job)."""
        out = torch.empty((n_bags, self.width), dtype=torch.float32, device="cpu")  # libibp writes it
        n = self._rows.size
        if n == 0 or n_bags == 0:
            return out
        n_keys = (offsets.size - 1) // n_bags
        if self.key_index.size != n:
            raise ValueError("these jobs were built without key indices: call run_arrays")
        if offsets.size != n_keys * n_bags + 1 or self._keys_needed > n_keys:
            raise ValueError(f"offsets of {offsets.size} entries do not hold the {n_bags} bags of keys "
                             f"{self.key_index.tolist()}")
        res = ffi.new("uint64_t[2]")  # the failed job, the copies wanted
        rc = lib.ibp_lookup_keyed(self._keyed_jobs(), n, ffi.cast("const int64_t *", array_address(values)),
                                  values.size, ffi.cast("const int64_t *", array_address(offsets)), n_keys, n_bags,
                                  ffi.NULL if weights is None else ffi.cast("const float *", array_address(weights)),
                                  ffi.cast("float *", out.data_ptr()), res, res + 1)
        if res[1]:
            self._want_copies(offsets[(self.key_index + 1) * n_bags] - offsets[self.key_index * n_bags], table_of)
        if rc != lib.IBP_OK:
            k = int(res[0])
            if k >= n and rc != lib.IBP_E_ARG:  # no job's error: memory
                _native.check(rc, "lookup")
            if k >= n:  # the offsets: name a job of the key where they first decrease
                down = np.flatnonzero(offsets[1:] < offsets[:-1])
                readers = np.flatnonzero(self.key_index == down[0] // n_bags) if down.size else ()
                if not len(readers):
                    raise ValueError(f"offsets must run from 0 to len(values) = {values.size} without decreasing")
                k = int(readers[0])
            key, n_rows = int(self.key_index[k]), int(self._rows[k])
            lo, hi = int(offsets[key * n_bags]), int(offsets[(key + 1) * n_bags])
            ids = values[lo:hi]
            error = _id_out_of_range(ids, n_rows, what(k)) if rc == lib.IBP_E_INDEX else None
            if error is not None:
                raise error
            _check_lookup_rc(rc, what(k), ids, offsets[key * n_bags:(key + 1) * n_bags + 1] - lo, n_rows)
        return out

    def run_arrays(self, arrays: np.ndarray, n_bags: int, table_of: Callable[[int], CompressedTable]):
        """[n_bags, width] float32 from each job's own arrays: arrays[:, k] holds job k's
        ids' address, their count, its bag offsets' address ([n_bags + 1] int64) and
        its float32 weights' address (0: none). libibp checks every id it reads and
        that the offsets run from 0 to the count without decreasing; where it refuses
        a job: (the output or None, libibp's return code, the failed job)."""
        out = torch.empty((n_bags, self.width), dtype=torch.float32, device="cpu")  # libibp writes it
        if self._rows.size == 0:
            return out, lib.IBP_OK, 0
        arrays = np.ascontiguousarray(arrays, dtype=np.uint64)
        if arrays.shape != (4, self._rows.size):
            raise ValueError(f"run_arrays takes [4, {self._rows.size}] words, got {arrays.shape}")
        res = ffi.new("uint64_t[2]")  # the failed job, the copies wanted
        at, row = array_address(arrays), 8 * arrays.shape[1]
        rc = lib.ibp_lookup_lists(self._keyed_jobs(), self._rows.size, ffi.cast("const int64_t *const *", at),
                                  ffi.cast("const uint64_t *", at + row),
                                  ffi.cast("const int64_t *const *", at + 2 * row),
                                  ffi.cast("const float *const *", at + 3 * row), n_bags,
                                  ffi.cast("float *", out.data_ptr()), res, res + 1)
        if res[1]:
            self._want_copies(arrays[1].astype(np.int64), table_of)
        if rc != lib.IBP_OK and res[0] >= self._rows.size:  # no job's error: memory
            _native.check(rc, "lookup_many")
        return (out if rc == lib.IBP_OK else None), rc, int(res[0])
