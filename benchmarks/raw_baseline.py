"""The raw-row baseline kernel of libibp_cuda (ibp_cuda_raw_lookup) and its host
emulation, from Python: the UVM stand-in of the GPU benchmark (benchmarks/gpu_lookup.py),
and of the CUDA tests (tests/test_cuda_emulation.py, tests/test_cuda_gpu.py).

ibp_cuda_raw_lookup pools raw (uncompressed) rows with the IBP fused lookup's kernel
structure and arithmetic, without decoding: rows in pinned host memory are read
zero-copy over PCIe, as FBGEMM's UVM placement reads them.
"""
from __future__ import annotations

import numpy as np
import torch

_MODES = {"sum": 0, "mean": 1}


def _ptr(ffi, t: torch.Tensor | None, ctype: str):
    return ffi.cast(ctype, t.data_ptr()) if t is not None and t.numel() else ffi.NULL


def raw_lookup(rows_ptr: int, n_rows: int, dtype: torch.dtype, dim: int, idx: torch.Tensor,
               off: torch.Tensor, weights: torch.Tensor | None = None, mode: str = "sum",
               status: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
    """ibp_cuda_raw_lookup over n_rows raw rows at device-readable address rows_ptr
    (device memory, or registered host memory's device pointer); idx, off, weights,
    status (one int32) on the current CUDA device. Returns [B, dim] float32."""
    from ibp_embed import cuda
    from ibp_embed.dtypes import LOOKUP_DTYPES

    lib, ffi = cuda.load_library(), cuda.ffi
    dev = idx.device
    n_bags = off.numel() - 1
    out = torch.empty((n_bags, dim), dtype=torch.float32, device=dev)
    flags = lib.IBP_CUDA_CHECK if check else 0
    rc = lib.ibp_cuda_raw_lookup(
        ffi.cast("const void *", rows_ptr), n_rows, LOOKUP_DTYPES[dtype], dim,
        _ptr(ffi, idx, "const int64_t *"), idx.numel(), _ptr(ffi, off, "const int64_t *"), n_bags,
        _ptr(ffi, weights, "const float *"), _MODES[mode],
        ffi.cast("float *", out.data_ptr()), _ptr(ffi, status, "int *"),
        ffi.cast("void *", torch.cuda.current_stream(dev).cuda_stream), flags)
    cuda.check(rc, "raw_lookup", lib)
    return out


def emulate_raw_lookup(w: torch.Tensor, idx, off, weights=None, mode: str = "sum") -> torch.Tensor:
    """What raw_lookup computes over the rows of the CPU tensor w, by the kernel's
    code run on the host (ibp_cuda_emulate_raw_lookup)."""
    from ibp_embed import cuda
    from ibp_embed.dtypes import LOOKUP_DTYPES

    lib, ffi = cuda.load_library(), cuda.ffi
    w = w.contiguous()
    idx = np.ascontiguousarray(np.asarray(idx, dtype=np.int64)).reshape(-1)
    off = np.ascontiguousarray(np.asarray(off, dtype=np.int64)).reshape(-1)
    wt = None if weights is None else np.ascontiguousarray(np.asarray(weights, np.float32)).reshape(-1)
    n_bags = off.size - 1
    out = torch.zeros((n_bags, w.shape[1]), dtype=torch.float32)
    rc = lib.ibp_cuda_emulate_raw_lookup(
        ffi.cast("const void *", w.data_ptr()), w.shape[0], LOOKUP_DTYPES[w.dtype], w.shape[1],
        ffi.cast("const int64_t *", idx.ctypes.data) if idx.size else ffi.NULL, idx.size,
        ffi.cast("const int64_t *", off.ctypes.data), n_bags,
        ffi.cast("const float *", wt.ctypes.data) if wt is not None and wt.size else ffi.NULL,
        _MODES[mode], ffi.cast("float *", out.data_ptr()))
    cuda.check(rc, "emulate_raw_lookup", lib)
    return out
