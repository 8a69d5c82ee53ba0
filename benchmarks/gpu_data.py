"""Tables, id batches and the modeled PCIe bytes of the GPU lookup benchmark (benchmarks/gpu_lookup.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GRANULE = 16  # the kernels' cp.async copy unit


def make_table(n_rows: int, dim: int, dtype: torch.dtype, init: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if init == "uniform":  # TorchRec's default init
        w = (torch.rand(n_rows, dim, generator=g) * 2 - 1) / n_rows ** 0.5
    else:
        w = torch.randn(n_rows, dim, generator=g) * 0.01
    return w.to(dtype)


def zipf_sampler(n_rows: int, alpha: float, seed: int):
    """Bounded Zipf ranks over n_rows, hot rows scattered by a fixed permutation
    (the same for every seed: warm and timed batches share their hot rows)."""
    cdf = np.cumsum(1.0 / np.arange(1, n_rows + 1, dtype=np.float64) ** alpha)
    cdf /= cdf[-1]
    perm = np.random.default_rng(12345).permutation(n_rows)
    rng = np.random.default_rng(seed)

    def draw(n):
        return perm[np.minimum(np.searchsorted(cdf, rng.random(n)), n_rows - 1)]
    return draw


@dataclass
class Batch:
    idx: np.ndarray        # int64 ids
    off: np.ndarray        # int64 offsets, B + 1
    distinct: np.ndarray   # sorted distinct ids
    idx_t: torch.Tensor = None   # on the benchmark's device
    off_t: torch.Tensor = None
    ref: torch.Tensor = None     # libibp's CPU lookup, on the device
    bound: torch.Tensor = None   # sum over the bag of |x| (tolerance of non-exact methods)


def make_batches(dist: str, n_rows: int, bags: int, pooling: int, n_batches: int, alpha: float,
                 seed: int) -> list[Batch]:
    rng = np.random.default_rng(seed)
    draw = zipf_sampler(n_rows, alpha, seed) if dist == "zipf" else \
        (lambda n: rng.integers(0, n_rows, n))
    out = []
    for _ in range(n_batches):
        sizes = rng.integers(max(1, pooling // 2), pooling * 3 // 2 + 1, bags)
        off = np.zeros(bags + 1, np.int64)
        np.cumsum(sizes, out=off[1:])
        idx = draw(int(off[-1])).astype(np.int64)
        out.append(Batch(idx, off, np.unique(idx)))
    return out


def granule_bytes(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Bytes a staged copy of each row fetches: whole 16-byte granules from the one
    holding its first byte to the one holding its last (the payload is 16-aligned)."""
    first = starts // GRANULE
    last = (starts + lengths + GRANULE - 1) // GRANULE
    return ((last - first) * GRANULE).astype(np.int64)
