"""libibp's lookups as PyTorch operators: ``torch.ops.ibp.pooled_lookup`` and ``torch.ops.ibp.gather``.

As FBGEMM exposes its kernels as ``torch.ops.fbgemm.*``, these are registered with
``torch.library`` (a CPU kernel and a fake kernel for shape propagation), so fx,
``torch.compile(fullgraph=True)`` and ``torch.export`` see a lookup as one node. A
compressed table enters them as plain tensors (``table_tensors``): masks and bitvals
([K, M]), block_base, rel and payload, plus ``meta`` = [rows, dim, word_bits,
payload_bytes]. The tensors hold the table's bytes as signed integers (int64 for the
uint64 arrays, int16 / int32 for rel, uint8 payload): torch pickles those, and not
its unsigned 16/32/64-bit dtypes. Modules keep these tensors as buffers.

The operators trust the table's structure (tables from ``compress``, ``load`` or
``table_from_tensors`` are validated once); the inputs of every call are checked:
shapes and sizes of the table tensors, offsets, id ranges, weights. Bad inputs raise
IndexError / ValueError naming ``what`` (the feature and table).
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import List, Optional

import numpy as np
import torch

from . import _native
from ._native import ffi, lib
from .dtypes import LOOKUP_DTYPES
from .table import CompressedTable, check_integers, check_offset_ends, check_real_weights

TABLE_TENSORS = ("masks", "bitvals", "block_base", "rel", "payload")
# numpy dtype of each table array -> the signed dtype of the same width the tensors use
_SIGNED = {np.dtype(np.uint64): np.int64, np.dtype(np.uint32): np.int32, np.dtype(np.uint16): np.int16,
           np.dtype(np.uint8): np.uint8}
_UNSIGNED = {torch.int64: np.uint64, torch.int32: np.uint32, torch.int16: np.uint16, torch.uint8: np.uint8}


def table_tensors(t: CompressedTable) -> dict:
    """The tensors (sharing the table's memory) and meta list a CompressedTable enters
    the operators as."""
    with warnings.catch_warnings():  # mmap'd tables are read-only; the operators never write
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensors = {}
        for name in TABLE_TENSORS:
            a = getattr(t, f"_{name}")
            tensors[name] = torch.from_numpy(a.view(_SIGNED[a.dtype]))
    return dict(tensors, meta=table_meta(t))


def table_meta(t: CompressedTable) -> List[int]:
    return [t.shape[0], t.shape[1], t.word_bits, t._payload_bytes]


def table_from_tensors(tensors: dict, meta: List[int], dtype: torch.dtype) -> CompressedTable:
    """The CompressedTable over these tensors' memory (validated: raises FormatError)."""
    n, d, w, payload_bytes = meta
    arrays = {}
    for name in TABLE_TENSORS:
        t = tensors[name]
        if t.device.type != "cpu" or t.dtype not in _UNSIGNED:
            raise ValueError(f"table tensor {name} must be an integer CPU tensor, got {t.dtype} on {t.device}")
        arrays[name] = t.contiguous().numpy().view(_UNSIGNED[t.dtype])
    return CompressedTable(shape=(n, d), dtype=dtype, word_bits=w, masks=arrays["masks"],
                           bitvals=arrays["bitvals"], block_base=arrays["block_base"], rel=arrays["rel"],
                           payload=arrays["payload"], payload_bytes=payload_bytes, validate=True)


# ibp_table structs are rebuilt only when a table's tensors change: a cache keyed on
# everything the struct holds (pointers and sizes), so a hit is exactly a rebuild, as
# the tensors are never written in place (their vbits and fixed_len are read from them).
_STRUCTS: "OrderedDict[tuple, object]" = OrderedDict()
_STRUCTS_MAX = 4096


def _c_table(masks, bitvals, block_base, rel, payload, meta, row_bytes: int):
    n, d, w, payload_bytes = meta
    key = (masks.data_ptr(), bitvals.data_ptr(), block_base.data_ptr(), rel.data_ptr(), payload.data_ptr(),
           tuple(masks.shape), rel.element_size(), payload.numel(), n, row_bytes, w, payload_bytes)
    c = _STRUCTS.get(key)
    if c is not None:
        _STRUCTS.move_to_end(key)
        return c
    k, m = masks.shape
    vbits = (w - np.bitwise_count(masks.numpy().view(np.uint64))).astype(np.uint8)
    c = ffi.new("ibp_table *")
    c.cb.row_bytes, c.cb.word_bits, c.cb.n_words, c.cb.n_clusters = row_bytes, w, m, k
    c.cb.masks = ffi.cast("const uint64_t *", masks.data_ptr())
    c.cb.bitvals = ffi.cast("const uint64_t *", bitvals.data_ptr())
    c.cb.vbits = _native.ptr(vbits, "const uint8_t *")
    c.n_rows, c.rel_bytes = n, rel.element_size()
    c.block_base = ffi.cast("const uint64_t *", block_base.data_ptr())  # NULL-like when raw: unread
    c.rel = ffi.cast("const void *", rel.data_ptr())
    c.payload = ffi.cast("const uint8_t *", payload.data_ptr())
    c.payload_bytes = payload_bytes
    c.fixed_len = lib.ibp_fixed_row_bytes(c)  # rows all one length: read with no index
    _STRUCTS[key] = (c, vbits)  # vbits must live as long as the struct
    if len(_STRUCTS) > _STRUCTS_MAX:
        _STRUCTS.popitem(last=False)
    return _STRUCTS[key]


def _check_table(masks, bitvals, block_base, rel, payload, meta, row_bytes: int, what: str) -> None:
    """O(1) checks that the tensors have the sizes the table's description needs."""
    if len(meta) != 4:
        raise ValueError(f"{what}: meta must be [rows, dim, word_bits, payload_bytes], got {meta}")
    n, d, w, payload_bytes = meta
    if w not in (16, 32, 64) or n < 0 or d < 1:
        raise ValueError(f"{what}: bad table description {meta}")
    m = -(-row_bytes // (w // 8))
    raw = masks.dim() == 2 and masks.shape[0] == 0  # rows at i * R, no index, no tail pad
    index = ((0,), (0,)) if raw else ((n // 64 + 1,), (n + 1,))
    ok = (masks.dim() == 2 and masks.shape[1] == m and masks.shape[0] <= 256 and bitvals.shape == masks.shape
          and masks.dtype == bitvals.dtype == block_base.dtype == torch.int64 and payload.dtype == torch.uint8
          and (tuple(block_base.shape), tuple(rel.shape)) == index and (not raw or payload_bytes == n * row_bytes)
          and rel.element_size() == lib.ibp_rel_bytes(row_bytes) and rel.dtype in (torch.int16, torch.int32)
          and payload.dim() == 1 and payload.numel() >= payload_bytes + (0 if raw else lib.ibp_tail_pad(row_bytes, w))
          and all(x.device.type == "cpu" and x.is_contiguous() for x in (masks, bitvals, block_base, rel, payload)))
    if not ok:
        raise ValueError(f"{what}: the table tensors do not fit the description {meta}")


def _check_on_cpu(what: str, *tensors: Optional[torch.Tensor]) -> None:
    """The operators decode host tables on the CPU: device ids would reach libibp as
    device pointers."""
    for x in tensors:
        if x is not None and x.device.type != "cpu":
            raise RuntimeError(f"{what}: torch.ops.ibp lookups take CPU tensors, got one on {x.device} "
                               f"(a module on cuda looks its tables up eagerly and cannot be scripted, "
                               f"traced or exported: capture it on the CPU)")


def _bad_id(idx: torch.Tensor, n_rows: int) -> int:
    bad = idx[(idx < 0) | (idx >= n_rows)]
    return int(bad[0]) if bad.numel() else -1


@torch.library.custom_op("ibp::pooled_lookup", mutates_args=())
def pooled_lookup(masks: torch.Tensor, bitvals: torch.Tensor, block_base: torch.Tensor, rel: torch.Tensor,
                  payload: torch.Tensor, meta: List[int], dtype: torch.dtype, indices: torch.Tensor,
                  offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor], mode: int,
                  what: str) -> torch.Tensor:
    """[B, dim] float32: bag b pools rows indices[offsets[b]:offsets[b + 1]] (scaled by
    per_sample_weights when given); mode 0 = SUM, 1 = MEAN (an empty bag gives zeros).
    libibp deduplicates the ids itself where that pays."""
    n, d = meta[0], meta[1]
    if dtype not in LOOKUP_DTYPES:
        raise TypeError(f"{what}: pooled lookups need a float32, float16 or bfloat16 table, not {dtype}")
    row_bytes = d * dtype.itemsize
    _check_table(masks, bitvals, block_base, rel, payload, meta, row_bytes, what)
    if mode not in (0, 1):
        raise ValueError(f"{what}: mode must be 0 (sum) or 1 (mean), not {mode}")
    if indices.dim() != 1 or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{what}: indices must be 1-D and offsets 1-D with B + 1 entries")
    check_integers(indices, f"{what}: ids")
    check_integers(offsets, f"{what}: offsets")
    _check_on_cpu(what, indices, offsets, per_sample_weights)
    idx = indices.to(torch.int64).contiguous()
    off = offsets.to(torch.int64).contiguous()
    check_offset_ends(off.numpy(), idx.numel(), "ids", what)  # through NumPy: 1.1 us, not 2.5
    w = None
    if per_sample_weights is not None:
        check_real_weights(per_sample_weights, what)
        if per_sample_weights.shape != indices.shape:
            raise ValueError(f"{what}: per_sample_weights of shape {tuple(per_sample_weights.shape)} for ids of "
                             f"shape {tuple(indices.shape)}")
        w = per_sample_weights.detach().to(torch.float32).contiguous()
    n_bags = off.numel() - 1
    out = torch.empty((n_bags, d), dtype=torch.float32)
    if n_bags == 0:
        return out
    c, _ = _c_table(masks, bitvals, block_base, rel, payload, meta, row_bytes)
    rc = lib.ibp_lookup(c, LOOKUP_DTYPES[dtype], d, ffi.cast("const int64_t *", idx.data_ptr()) if idx.numel()
                        else ffi.NULL, ffi.cast("const int64_t *", off.data_ptr()), n_bags,
                        ffi.NULL if w is None else ffi.cast("const float *", w.data_ptr()), mode,
                        ffi.cast("float *", out.data_ptr()))
    if rc == lib.IBP_E_INDEX:
        raise IndexError(f"{what}: id {_bad_id(idx, n)} out of range for a table of {n} rows")
    if rc == lib.IBP_E_ARG:
        raise ValueError(f"{what}: offsets must be non-decreasing")  # their ends were checked
    _native.check(rc, what)
    return out


@pooled_lookup.register_fake
def _pooled_lookup_fake(masks, bitvals, block_base, rel, payload, meta, dtype, indices, offsets,
                        per_sample_weights, mode, what):
    return offsets.new_empty((offsets.shape[0] - 1, meta[1]), dtype=torch.float32)


@torch.library.custom_op("ibp::gather", mutates_args=())
def gather(masks: torch.Tensor, bitvals: torch.Tensor, block_base: torch.Tensor, rel: torch.Tensor,
           payload: torch.Tensor, meta: List[int], dtype: torch.dtype, indices: torch.Tensor,
           what: str) -> torch.Tensor:
    """Rows `indices` (any shape of integers), bit-exact: indices.shape + [dim] of dtype."""
    n, d = meta[0], meta[1]
    row_bytes = d * dtype.itemsize
    _check_table(masks, bitvals, block_base, rel, payload, meta, row_bytes, what)
    check_integers(indices, f"{what}: ids")
    _check_on_cpu(what, indices)
    idx = indices.to(torch.int64).contiguous().reshape(-1)
    out = torch.empty((idx.numel(), row_bytes), dtype=torch.uint8)
    if idx.numel():
        c, _ = _c_table(masks, bitvals, block_base, rel, payload, meta, row_bytes)
        rc = lib.ibp_decode(c, ffi.cast("const int64_t *", idx.data_ptr()), idx.numel(),
                            ffi.cast("uint8_t *", out.data_ptr()))
        if rc == lib.IBP_E_INDEX:
            raise IndexError(f"{what}: id {_bad_id(idx, n)} out of range for a table of {n} rows")
        _native.check(rc, what)
    return out.view(dtype).reshape(*indices.shape, d)


@gather.register_fake
def _gather_fake(masks, bitvals, block_base, rel, payload, meta, dtype, indices, what):
    return indices.new_empty((*indices.shape, meta[1]), dtype=dtype)
