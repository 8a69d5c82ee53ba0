"""Element dtypes a table may hold, and their conversion to raw row bytes.

The codec is bitwise, so any dtype with 1-, 2-, 4- or 8-byte elements is stored;
pooled lookups need a floating dtype the native library can widen to fp32.
"""
from __future__ import annotations

import numpy as np
import torch

# Pooled lookup support: torch dtype -> IBP_DTYPE_* code in native/ibp.h.
LOOKUP_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

NUMPY_TO_TORCH = {
    np.dtype(np.float64): torch.float64, np.dtype(np.float32): torch.float32,
    np.dtype(np.float16): torch.float16, np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32, np.dtype(np.int16): torch.int16,
    np.dtype(np.int8): torch.int8, np.dtype(np.uint8): torch.uint8,
    np.dtype(np.uint16): torch.uint16, np.dtype(np.uint32): torch.uint32,
    np.dtype(np.uint64): torch.uint64, np.dtype(np.bool_): torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    check_dtype(dtype)
    return dtype


def check_dtype(dtype: torch.dtype) -> None:
    if dtype.is_complex or dtype.itemsize not in (1, 2, 4, 8):
        raise TypeError(f"dtype {dtype} is not supported: elements must be 1, 2, 4 or 8 bytes, not complex")


def check_dense(tensor: torch.Tensor, name: str = "weights") -> None:
    """Tables hold dense values: a sparse tensor has no rows to read as bytes, and a
    quantized one's bytes mean nothing without its scale and zero point (and torch's
    view of them as bytes crashes the process)."""
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"{name}: a {tensor.layout} / quantized tensor is not supported; a dense tensor is "
                        f"needed (a quantized one's int_repr(), its scale and zero point kept apart)")


def as_rows(weights, name: str = "weights") -> tuple[np.ndarray, torch.dtype, int]:
    """(rows as a C-contiguous uint8 [N, D * itemsize] array, dtype, D) of a 2-D tensor or array.

    No copy is made when the input is already contiguous on the CPU.
    """
    if isinstance(weights, np.ndarray):
        if weights.dtype not in NUMPY_TO_TORCH:
            raise TypeError(f"NumPy dtype {weights.dtype} is not supported")
        weights = torch.from_numpy(np.ascontiguousarray(weights))
    if not isinstance(weights, torch.Tensor):
        raise TypeError(f"{name} must be a 2-D torch.Tensor or numpy.ndarray, not {type(weights).__name__}")
    check_dense(weights, name)
    if weights.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, dim], got shape {tuple(weights.shape)}")
    check_dtype(weights.dtype)
    if weights.shape[1] == 0:
        raise ValueError(f"{name} must have at least one column")
    if weights.device.type == "meta":
        raise ValueError(f"{name} on the meta device have no values to compress")
    t = weights.detach().to("cpu").resolve_neg().contiguous()  # a negative view's bytes are not its values
    if t.shape[0] == 0:  # an empty tensor may keep zero strides, which view() rejects
        return np.empty((0, t.shape[1] * t.element_size()), np.uint8), t.dtype, int(t.shape[1])
    rows = t.view(torch.uint8).reshape(t.shape[0], t.shape[1] * t.element_size()).numpy()
    return rows, t.dtype, int(t.shape[1])


def rows_to_tensor(rows: np.ndarray, dtype: torch.dtype, dim: int) -> torch.Tensor:
    """Inverse of as_rows: reinterpret [n, dim * itemsize] bytes as an [n, dim] tensor."""
    if rows.size == 0:  # torch cannot view a zero-stride empty tensor as another dtype
        return torch.empty((rows.shape[0], dim), dtype=dtype)
    return torch.from_numpy(rows).view(dtype).reshape(rows.shape[0], dim)
