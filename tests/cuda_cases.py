"""Tables, batches and checks shared by the CUDA tests (tests/test_cuda_*.py).

CASES are the tables every kernel is checked over (all element types and word sizes,
raw and encoded rows, several clusters); the `case` fixture (tests/conftest.py)
compresses them. The loop helpers build the many-rows-and-bags-per-warp batches of
the emulated and the GPU loop tests.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

import ibp_embed

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmarks.raw_baseline: the raw kernel's Python wrappers
CUDA_DIR = ROOT / "native" / "cuda"


# ---- tables ----

def _mixed(n, dim, dtype, seed=0):
    """Two populations (so several clusters pay) and every 7th row incompressible (raw)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, dim, generator=g) * 0.01
    w[n // 2:] = torch.randn(n - n // 2, dim, generator=g) * 30
    k = len(range(0, n, 7))
    e = 4 if dtype == torch.float16 else 20  # finite in the dtype
    w[::7] = (torch.rand(k, dim, generator=g) - 0.5) * \
        10.0 ** torch.randint(-e, e, (k, dim), generator=g).float()
    w = w.to(dtype)
    assert torch.isfinite(w).all()
    return w


def _smooth(n, dim, dtype, seed=0):
    """Nearly constant rows in [1.5, 1.501): encoded even when a row is a few bytes."""
    g = torch.Generator().manual_seed(seed)
    return (1.5 + torch.rand(n, dim, generator=g) * 1e-3).to(dtype)


ENC = dict(allow_raw=False)  # encoded, though for some the masks outweigh the rows
CASES = [  # (name, weights, compress kwargs)
    ("f32-d128-w32-k4", lambda: _mixed(400, 128, torch.float32), dict(word_bits=32, clusters=4, **ENC)),
    ("f32-d128-w16", lambda: _mixed(300, 128, torch.float32), dict(word_bits=16, clusters=4, **ENC)),
    ("f32-d40-w64", lambda: _mixed(300, 40, torch.float32, 1), dict(word_bits=64, clusters=4, **ENC)),
    ("f16-d41-w64", lambda: _mixed(300, 41, torch.float16, 2), dict(word_bits=64, clusters=4, **ENC)),
    ("f16-d3-w32", lambda: _smooth(200, 3, torch.float16), dict(word_bits=32, **ENC)),
    ("bf16-d16-w16", lambda: _mixed(300, 16, torch.bfloat16, 3), dict(word_bits=16, clusters=2, **ENC)),
    ("bf16-d1-w64", lambda: _smooth(200, 1, torch.bfloat16), dict(word_bits=64, **ENC)),
    ("f32-d1-w32", lambda: _smooth(200, 1, torch.float32), dict(word_bits=32, **ENC)),
    ("i8-d7-w32", lambda: torch.randint(0, 4, (300, 7), dtype=torch.int8,
                                         generator=torch.Generator().manual_seed(4)), dict(word_bits=32, **ENC)),
    ("f64-d5-w64", lambda: _smooth(200, 5, torch.float64), dict(word_bits=64, **ENC)),
    # raw tables (format version 2): rows at i * R, no index and no tail pad in host memory
    ("raw-f32-d40", lambda: _mixed(30, 40, torch.float32, 5), dict(word_bits=64)),
    ("raw-f16-d3", lambda: _mixed(21, 3, torch.float16, 6), dict(word_bits=16)),
]


def _batch(n_rows, n_idx, n_bags, seed):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_rows, n_idx)
    idx[: n_idx // 4] = idx[n_idx // 4: n_idx // 2]  # duplicates
    off = np.sort(rng.integers(0, n_idx + 1, n_bags + 1))
    off[0], off[-1] = 0, n_idx
    off[n_bags // 2] = off[n_bags // 2 + 1]  # an empty bag (unless it already is)
    w = rng.standard_normal(n_idx).astype(np.float32)
    return idx, off, w


def _raw(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def _assert_pooled_close(got, ref, w, idx, off, weights, mode):
    """got within 1e-6 relative of ref, relative to the pooled terms' magnitude.

    Sums in another order, or with fused multiply-adds, differ from libibp's by
    rounding errors that scale with sum |w x|, not with the (possibly cancelled)
    result, so the tolerance of element (b, d) is 1e-6 * (|ref| + sum_p |w_p x_pd|).
    """
    got = got.cpu()
    x = np.abs(w.double().numpy())[np.asarray(idx)]
    if weights is not None:
        x = x * np.abs(np.asarray(weights, np.float64))[:, None]
    off = np.asarray(off)
    bound = np.zeros((off.size - 1, w.shape[1]))
    full = off[1:] > off[:-1]
    if full.any():
        bound[full] = np.add.reduceat(x, off[:-1][full], axis=0)
    if mode == "mean":
        bound /= np.maximum(off[1:] - off[:-1], 1)[:, None]
    tol = 1e-6 * (ref.abs().double() + torch.from_numpy(bound)) + 1e-30
    err = (got.double() - ref.double()).abs()
    assert got.shape == ref.shape and bool((err <= tol).all()), \
        f"max error {float(err.max()):.3g}, max error / tolerance {float((err / tol).max()):.3g}"


# ---- many rows and bags per warp: the kernels' loops ----

LOOP_CASES = [  # (dtype, dim, word_bits): every word size, every element type
    (torch.float32, 64, 32), (torch.float16, 72, 64), (torch.bfloat16, 40, 16)]
LOOP_IDS = ["f32-d64-w32", "f16-d72-w64", "bf16-d40-w16"]


def _loop_table(dtype, dim, word_bits, n_rows, seed=0):
    w = _mixed(n_rows, dim, dtype, seed)
    t = ibp_embed.compress(w, word_bits=word_bits, clusters=4, progress=False)
    lengths = t.row_lengths()
    assert (lengths == dim * w.dtype.itemsize).any() and (lengths < dim * w.dtype.itemsize).any()
    return w, t


def _loop_batch(n_rows, n_bags, grid, seed, pooling=10):
    """Bags of 1 to 2 x pooling ids, every 97th bag empty, 50 single-id bags, a
    3 x pooling last bag and a run of 2 x grid + 1 empty bags (every warp's seek
    passes over two of them): (ids with duplicates, offsets, weights). The caller
    makes the other bags outnumber the grid's warps several times."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 2 * pooling + 1, n_bags)
    sizes[::97] = 0
    lo, run = n_bags // 3, 2 * grid + 1
    sizes[lo:lo + run] = 0
    sizes[2 * n_bags // 3:2 * n_bags // 3 + 50] = 1
    sizes[-1] = 3 * pooling
    off = np.zeros(n_bags + 1, np.int64)
    np.cumsum(sizes, out=off[1:])
    n_ids = int(off[-1])
    idx = rng.integers(0, n_rows, n_ids)
    k = n_ids // 4
    idx[:k] = idx[k:2 * k]  # duplicates
    return idx, off, rng.standard_normal(n_ids).astype(np.float32)


def _check_loops(t, gather, lookup, idx, off, wts, raw_lookup=None):
    """gather and every lookup variant (and the raw kernel's) against libibp, bit for bit."""
    assert torch.equal(_raw(gather(idx)), _raw(t.gather(idx)))
    for mode in ("sum", "mean"):
        for weights in (None, wts):
            ref = t.lookup(idx, off, weights, mode)
            for dedup in (True, False):
                got = lookup(idx, off, weights, mode, dedup)
                assert torch.equal(got, ref), (mode, weights is not None, dedup,
                                               float((got - ref).abs().max()))
            if raw_lookup is not None:
                got = raw_lookup(idx, off, weights, mode)
                assert torch.equal(got, ref), ("raw", mode, weights is not None,
                                               float((got - ref).abs().max()))
