"""Criteo-like synthetic embedding tables and lookup batches for demos and benchmarks.

Everything here is generated: no dataset is downloaded. Generation is vectorised
(torch, in chunks of rows), so tables of tens of millions of rows take seconds.

- ``make_table``: a freshly initialised table (TorchRec's default init, or normal(0, 0.01)).
- ``make_trained_like_table``: a *synthetic* imitation of a trained table, see its docstring.
  It is not a trained table; real trained tables compress differently (GUIDE section 1).
- ``zipf_ids`` / ``uniform_ids`` / ``make_bags``: ids and TorchRec-style pooled batches.

Zipf ids are drawn by popularity rank and mapped to rows through a fixed random
permutation (``perm_seed``), as hashed categorical ids are: the hot rows are scattered
over the table. ``make_trained_like_table`` uses the same permutation, so with equal
``perm_seed`` and ``alpha`` the rows it moved most are the ids ``zipf_ids`` draws most.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

# Criteo Kaggle (7 days, 45.8M samples): cardinalities of the 26 categorical features
# (33.76M rows in all; the original DLRM uses dim 16 on it).
CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
CRITEO_KAGGLE_DIM = 16
# Criteo 1TB as MLPerf DLRMv2 hashes it (mod 40M), dim 128 (104.5 GB of fp32).
DLRMV2_CARDINALITIES = (
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
)
DLRMV2_MULTI_HOT = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
DLRMV2_DIM = 128

INITS = ("torchrec", "normal")
_CHUNK = 1 << 20  # rows generated per step (bounds temporary memory)


def scaled_cardinalities(cardinalities=CRITEO_KAGGLE_CARDINALITIES, *, scale: float = 1.0,
                         max_rows: int | None = None, min_rows: int = 1) -> list[int]:
    """Table sizes scaled by `scale` and capped at `max_rows` (to fit a machine's memory)."""
    out = []
    for n in cardinalities:
        n = max(min_rows, int(round(n * scale)))
        out.append(min(n, max_rows) if max_rows else n)
    return out


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def make_table(n_rows: int, dim: int, dtype: torch.dtype = torch.float32, init: str = "torchrec",
               seed: int = 0) -> torch.Tensor:
    """A freshly initialised [n_rows, dim] table.

    init="torchrec": TorchRec's default EmbeddingBagCollection init,
    uniform(-sqrt(1 / n_rows), +sqrt(1 / n_rows)); init="normal": normal(0, 0.01).
    Values are drawn in fp32 and rounded to `dtype`.
    """
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, not {init!r}")
    if n_rows < 0 or dim < 1:
        raise ValueError(f"bad table shape ({n_rows}, {dim})")
    g = _generator(seed)
    out = torch.empty((n_rows, dim), dtype=dtype)
    bound = math.sqrt(1.0 / max(n_rows, 1))
    for lo in range(0, n_rows, _CHUNK):
        hi = min(lo + _CHUNK, n_rows)
        buf = out[lo:hi] if dtype == torch.float32 else torch.empty((hi - lo, dim))
        if init == "torchrec":
            buf.uniform_(-bound, bound, generator=g)
        else:
            buf.normal_(0.0, 0.01, generator=g)
        if buf.data_ptr() != out[lo:hi].data_ptr():
            out[lo:hi] = buf
    return out


@lru_cache(maxsize=4)
def _zipf_cdf(n_rows: int, alpha: float) -> torch.Tensor:
    """Unnormalised cumulative weights (rank + 1) ** -alpha, float64."""
    return torch.cumsum(torch.arange(1, n_rows + 1, dtype=torch.float64).pow_(-alpha), 0)


@lru_cache(maxsize=4)
def popularity_permutation(n_rows: int, perm_seed: int) -> torch.Tensor:
    """perm[rank] = row: where the rank-th most popular id lives in the table."""
    return torch.randperm(n_rows, generator=_generator(perm_seed))


def zipf_ids(n: int, n_rows: int, alpha: float = 1.05, seed: int = 0,
             perm_seed: int | None = 0) -> torch.Tensor:
    """n int64 ids in [0, n_rows), P(rank r) proportional to (r + 1) ** -alpha (exact
    discrete Zipf by inverse CDF). Ranks go through popularity_permutation(n_rows,
    perm_seed); perm_seed=None returns the ranks themselves (row 0 hottest)."""
    if n_rows < 1:
        raise ValueError("n_rows must be positive")
    if alpha <= 0:
        raise ValueError("alpha must be positive")
    cdf = _zipf_cdf(int(n_rows), float(alpha))
    u = torch.rand(n, generator=_generator(seed), dtype=torch.float64).mul_(cdf[-1])
    ranks = torch.searchsorted(cdf, u, right=True).clamp_(max=n_rows - 1)
    return ranks if perm_seed is None else popularity_permutation(int(n_rows), int(perm_seed))[ranks]


def uniform_ids(n: int, n_rows: int, seed: int = 0) -> torch.Tensor:
    """n int64 ids drawn uniformly from [0, n_rows) (TorchRec's RandomRecDataset: no locality)."""
    return torch.randint(n_rows, (n,), generator=_generator(seed), dtype=torch.int64)


def make_bags(n_rows: int, batch_size: int, pooling: int, alpha: float | None = 1.05,
              seed: int = 0, perm_seed: int | None = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A pooled batch: (indices [batch_size * pooling], offsets [batch_size + 1]), int64.

    Bag b is indices[offsets[b]:offsets[b + 1]] (TorchRec / FBGEMM convention, offsets
    ending at len(indices)). Every bag has `pooling` ids; ids are Zipf(alpha), or
    uniform when alpha is None.
    """
    if batch_size < 0 or pooling < 0:
        raise ValueError("batch_size and pooling must be non-negative")
    n = batch_size * pooling
    ids = uniform_ids(n, n_rows, seed) if alpha is None else zipf_ids(n, n_rows, alpha, seed, perm_seed)
    offsets = torch.arange(0, n + 1, max(pooling, 1), dtype=torch.int64) if pooling else \
        torch.zeros(batch_size + 1, dtype=torch.int64)
    return ids, offsets


def make_trained_like_table(n_rows: int, dim: int, dtype: torch.dtype = torch.float32,
                            alpha: float = 1.05, samples_per_row: float = 20.0,
                            sigma: float = 0.05, seed: int = 0,
                            perm_seed: int | None = 0) -> torch.Tensor:
    """A SYNTHETIC table that imitates a trained one; it was not trained.

    Model: training saw ``samples_per_row * n_rows`` id occurrences drawn Zipf(alpha)
    (the same ranks and permutation as ``zipf_ids``). A row of rank r is then seen
    c_r = samples_per_row * n_rows * p_r times in expectation. It is *touched* with
    probability 1 - exp(-c_r); untouched (cold) rows keep their exact TorchRec init
    bits. A touched row is its init plus normal noise of standard deviation
    sigma * log1p(c_r) / log1p(c_0): the hottest rows move by about `sigma`
    (far from an init of about 1/sqrt(n_rows)), rarely seen rows barely move.
    Real trained tables have more structure (correlated dimensions, optimizer
    effects); benchmark on real ones when they exist.
    """
    table = make_table(n_rows, dim, torch.float32, "torchrec", seed)
    if n_rows == 0:
        return table.to(dtype)
    g = _generator(seed + 0x9E3779B9)
    # rank of every row, and the expected number of times each rank was seen
    if perm_seed is None:
        rank_of_row = torch.arange(n_rows)
    else:
        rank_of_row = torch.empty(n_rows, dtype=torch.int64)
        rank_of_row[popularity_permutation(int(n_rows), int(perm_seed))] = torch.arange(n_rows)
    cdf = _zipf_cdf(int(n_rows), float(alpha))
    total = samples_per_row * n_rows
    out = table if dtype == torch.float32 else torch.empty((n_rows, dim), dtype=dtype)
    top = math.log1p(total / float(cdf[-1]))
    for lo in range(0, n_rows, _CHUNK):
        hi = min(lo + _CHUNK, n_rows)
        r = rank_of_row[lo:hi]
        count = (r + 1).to(torch.float64).pow_(-alpha).mul_(total / float(cdf[-1]))
        touched = torch.rand(hi - lo, generator=g, dtype=torch.float64) < -torch.expm1(-count)
        scale = (torch.log1p(count) * (sigma / top)).to(torch.float32) * touched
        noise = torch.randn((hi - lo, dim), generator=g).mul_(scale[:, None])
        # untouched rows get + (+-0.0): their init bits stay exactly as they were
        chunk = table[lo:hi].add_(noise)
        if out is not table:
            out[lo:hi] = chunk
    return out
