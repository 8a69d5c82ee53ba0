"""Tables and checks shared by the codec and lookup tests."""
from __future__ import annotations

import numpy as np
import torch

WORD_BITS = (16, 32, 64)
ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64,
              torch.float64, torch.uint8, torch.bool, torch.int16, torch.int32)
LOOKUP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor):
    """Same dtype, shape and bytes (NaN payloads, signed zeros and all)."""
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def from_bytes(raw: np.ndarray, dtype: torch.dtype, n: int, dim: int) -> torch.Tensor:
    """uint8 [n, dim * itemsize] -> [n, dim] tensor of dtype (the same bits)."""
    if n == 0:
        return torch.empty((0, dim), dtype=dtype)
    return torch.from_numpy(np.ascontiguousarray(raw)).view(dtype).reshape(n, dim)


def to_bytes(w: torch.Tensor) -> np.ndarray:
    """[n, dim] tensor -> its rows as uint8 [n, dim * itemsize]."""
    return w.contiguous().view(torch.uint8).reshape(w.shape[0], w.shape[1] * w.element_size()).numpy()


def random_bits(n: int, dim: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Uniformly random bit patterns (bool: random 0/1)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, dim * dtype.itemsize), dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    return from_bytes(raw, dtype, n, dim)


def structured(n: int, dim: int, dtype: torch.dtype, seed: int = 0, noise_frac: float = 0.3) -> torch.Tensor:
    """Rows sharing a base pattern, with a fraction of their bits random: many invariant bits."""
    rng = np.random.default_rng(seed)
    r = dim * dtype.itemsize
    base = rng.integers(0, 256, size=r, dtype=np.uint8)
    noise_mask = (rng.random((r, 8)) < noise_frac) @ (1 << np.arange(8))
    noise = rng.integers(0, 256, size=(n, r), dtype=np.uint8) & noise_mask.astype(np.uint8)
    raw = base ^ noise
    if dtype == torch.bool:
        raw &= 1
    return from_bytes(raw, dtype, n, dim)


def magnitude_clusters(n=256, dim=16, seed=0, scales=(1e-6, 1e-2, 1e2, 1e6)) -> torch.Tensor:
    """Rows from four groups of very different magnitudes: four exponent patterns."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor(scales)
    group = torch.arange(n) % 4
    return torch.randn(n, dim, generator=g) * scales[group][:, None]
