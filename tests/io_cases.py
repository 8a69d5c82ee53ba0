"""Tables, checks and the saved `small` table shared by the .ibp file tests
(tests/test_io.py: round trips and atomic saves; tests/test_io_corruption.py:
truncated, corrupted, foreign and malformed files).

The fixtures themselves stay in the test files, each defined there at module scope
from the functions here (`single_thread`, `save_small`): one set-up per test module,
as before the split.
"""
from __future__ import annotations

import contextlib

import torch
from hypothesis import HealthCheck, settings

import ibp_embed
from ibp_embed._native import lib

HYP = settings(deadline=None, max_examples=40, suppress_health_check=list(HealthCheck))


@contextlib.contextmanager
def single_thread():
    """Thousands of tiny decodes: thread start-up would dominate (and shared CI cores)."""
    old_torch, old_ibp = torch.get_num_threads(), lib.ibp_get_num_threads()
    torch.set_num_threads(1)
    lib.ibp_set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old_torch)
        lib.ibp_set_num_threads(old_ibp)


def table_data(n: int, d: int, dtype=torch.float32, seed: int = 0, mixed: bool = False):
    """Embedding-like rows; `mixed` gives rows of very different magnitudes (for K > 1)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.randn(n, d, generator=g, dtype=torch.float64) * 0.01
        if mixed:
            scale = torch.tensor([1e-4, 1.0, 1e4, 1e-8], dtype=torch.float64)
            x = x * scale[torch.randint(0, 4, (n,), generator=g)][:, None]
        return x.to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -100), min(info.max, 100)
    return torch.randint(lo, hi, (n, d), generator=g, dtype=torch.int64).to(dtype)


def raw_bytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:  # torch cannot view some empty tensors' strides as bytes
        return b""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def assert_same(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
    assert raw_bytes(a) == raw_bytes(b)


def save_small(tmp_path_factory):
    """A small saved table with K > 1 and some raw rows: (path, table, data, file bytes)."""
    x = table_data(150, 8, torch.float32, seed=2, mixed=True)
    x[7] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-42, -1e38, 3.0, -float("inf"), 0.0])
    t = ibp_embed.compress(x, clusters=3, word_bits=32, allow_raw=False)
    assert t.clusters > 1, "the fixture must exercise cluster ids"
    assert (t.cluster_ids() == -1).any() and (t.cluster_ids() >= 0).any()
    path = tmp_path_factory.mktemp("small") / "small.ibp"
    t.save(path)
    return path, t, x, path.read_bytes()

