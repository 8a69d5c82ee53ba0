"""PackedJobs: libibp's lookup jobs for a fixed list of tables, written once.

A module's lookups (IBPEmbeddingBagCollection, the DMP kernel) name the same tables,
dims, modes and output columns call after call; only the batch's pointers change.
_lookup_many_checked fills every job field by field through cffi, about 4 us a
table: 100 of the 254 us a B1 lookup into the 26 Criteo tables took, against 120 us
for TorchRec's fused EBC (1 thread, a Zen 4 EPYC). Here the jobs live in a NumPy
array laid out as ``ibp_lookup_job`` (field offsets from cffi), and a call writes a
batch's pointers for all jobs with a few vectorized stores.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ._native import ffi, lib
from .dtypes import LOOKUP_DTYPES
from .table import _MODES, CompressedTable, _check_lookup_rc


def _job_dtype() -> np.dtype:
    """ibp_lookup_job as a NumPy structured dtype: pointers as uintp, the integers by
    their size and sign, each at the offset cffi reports."""
    ctype = ffi.typeof("ibp_lookup_job")
    names, formats, offsets = [], [], []
    for name, field in ctype.fields:
        t = field.type
        if t.kind == "pointer":
            fmt = np.uintp
        else:
            fmt = np.dtype(f"{'i' if int(ffi.cast(t, -1)) < 0 else 'u'}{ffi.sizeof(t)}")
        names.append(name)
        formats.append(fmt)
        offsets.append(field.offset)
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": ffi.sizeof(ctype)})


_JOB = _job_dtype()


class PackedJobs:
    """Lookups of tables[i] (CompressedTables, modes[i] "sum" or "mean") pooling key
    key_index[i] of a batch laid out as a KeyedJaggedTensor's: values, and offsets
    [n_keys * B + 1] key after key. Job i fills columns [D_0 + .. + D_{i-1}, + D_i) of
    one [B, sum of dims] float32 output. Immutable once built: calls from several
    threads each write their own copy of the jobs."""

    def __init__(self, tables: Sequence[CompressedTable], modes: Sequence[str], key_index: Sequence[int]):
        self.tables = tuple(tables)
        if not len(self.tables) == len(modes) == len(key_index):
            raise ValueError(f"{len(self.tables)} tables need as many modes and key indices, got "
                             f"{len(modes)} and {len(key_index)}")
        for k, t in enumerate(self.tables):
            if not isinstance(t, CompressedTable):
                raise TypeError(f"job {k}: a CompressedTable, not {type(t).__name__}")
            if t.dtype not in LOOKUP_DTYPES:
                raise TypeError(f"job {k}: pooled lookups need a float32, float16 or bfloat16 table, not {t.dtype}")
        dims = [t.shape[1] for t in self.tables]
        self.width = sum(dims)
        self.key_index = np.asarray(key_index, dtype=np.int64).reshape(-1)
        self._cols = np.zeros(len(dims), dtype=np.uint64)  # each job's first output byte
        self._cols[1:] = 4 * np.cumsum(dims[:-1], dtype=np.uint64)
        jobs = np.zeros(len(self.tables), dtype=_JOB)
        jobs["table"] = [int(ffi.cast("uintptr_t", t._c)) for t in self.tables]
        jobs["dtype"] = [LOOKUP_DTYPES[t.dtype] for t in self.tables]
        jobs["dim"] = dims
        jobs["mode"] = [_MODES[m] for m in modes]
        jobs["out_stride"] = self.width
        self._template = jobs

    def __call__(self, values: np.ndarray, offsets: np.ndarray, weights, n_bags: int,
                 what: Callable[[int], str]) -> torch.Tensor:
        """[n_bags, width] float32. values int64, offsets int64 [n_keys * n_bags + 1]
        from 0 to len(values) without decreasing, weights float32 like values or None,
        all contiguous and checked by the caller (libibp checks every id it reads and
        each job's offsets). An out-of-range id raises IndexError naming what(job)."""
        out = torch.empty((n_bags, self.width), dtype=torch.float32)
        n = len(self.tables)
        if n == 0 or n_bags == 0:
            return out
        n_keys = (offsets.size - 1) // n_bags
        if offsets.size != n_keys * n_bags + 1 or (self.key_index.size and self.key_index.max() >= n_keys):
            raise ValueError(f"offsets of {offsets.size} entries do not hold the {n_bags} bags of keys "
                             f"{self.key_index.tolist()}")
        # each key's bag offsets from 0, one row a key (the native jobs want them so)
        rel = np.empty((n_keys, n_bags + 1), dtype=np.int64)
        rel[:, :n_bags] = offsets[:-1].reshape(n_keys, n_bags)
        rel[:, n_bags] = offsets[n_bags::n_bags]
        starts = rel[:, 0].copy()
        rel -= starts[:, None]
        first = starts[self.key_index].astype(np.uint64)
        jobs = self._template.copy()
        jobs["indices"] = np.uint64(values.ctypes.data) + np.uint64(8) * first
        jobs["offsets"] = np.uint64(rel.ctypes.data) + np.uint64(8 * (n_bags + 1)) * self.key_index.astype(np.uint64)
        jobs["n_bags"] = n_bags
        if weights is not None:
            jobs["weights"] = np.uint64(weights.ctypes.data) + np.uint64(4) * first
        jobs["out"] = np.uint64(out.data_ptr()) + self._cols
        failed = ffi.new("uint64_t *")
        rc = lib.ibp_lookup_many(ffi.cast("const ibp_lookup_job *", jobs.ctypes.data), n, failed)
        if rc != lib.IBP_OK:
            k = int(failed[0])
            key, n_rows = int(self.key_index[k]), self.tables[k].shape[0]
            ids = values[int(starts[key]):int(starts[key] + rel[key, n_bags])]
            bad = ids[(ids < 0) | (ids >= n_rows)]
            if rc == lib.IBP_E_INDEX and bad.size:
                raise IndexError(f"{what(k)}: id {int(bad[0])} out of range for a table of {n_rows} rows")
            _check_lookup_rc(rc, what(k), ids, rel[key], n_rows)
        return out
