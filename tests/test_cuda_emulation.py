"""The CUDA kernels' code run on the host, without a GPU (ibp_cuda_emulate_*).

The kernels' own per-warp loops over an emulated grid, the per-lane decoding lane
by lane, the same pooling arithmetic: they match libibp bit for bit, for gathers and
lookups (weighted ones too: both use fma) over the CASES tables (tests/cuda_cases.py),
also with many rows and bags per warp and whatever the grid; the raw-row baseline
kernel's emulation matches libibp and torch.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ibp_embed
from cuda_cases import CASES, LOOP_CASES, LOOP_IDS, _assert_pooled_close, _batch, _check_loops, \
    _loop_batch, _loop_table, _mixed, _raw, _smooth
from ibp_embed import cuda
from ibp_embed.errors import FormatError


# ---- the kernels' code, run lane by lane on the host ----

def test_emulated_gather_is_bit_exact(cuda_lib, case):
    name, w, t = case
    rng = np.random.default_rng(0)
    idx = np.concatenate([rng.integers(0, t.shape[0], 500), [0, t.shape[0] - 1, 5, 5]])
    assert torch.equal(_raw(cuda.emulate_gather(t, idx)), _raw(t.gather(idx)))
    assert torch.equal(_raw(cuda.emulate_gather(t, np.arange(t.shape[0]))), _raw(w))


def test_case_tables_cover_the_format(case):
    """The cases hold raw and encoded rows, several clusters and all word sizes."""
    name, w, t = case
    lengths = t.row_lengths()
    row_bytes = w.shape[1] * w.dtype.itemsize
    assert t.is_raw == name.startswith("raw"), name
    if t.is_raw:
        assert t.nbytes == w.numel() * w.element_size(), name
    elif name.startswith(("f32-d128", "f32-d40", "f16-d41", "bf16-d16")):
        assert (lengths == row_bytes).any() and (lengths < row_bytes).any(), name
        assert t.clusters > 1, name
    elif name != "f64-d5-w64":
        assert (lengths < row_bytes).mean() > 0.9, name


def test_case_word_sizes():
    assert {kw["word_bits"] for _, _, kw in CASES} == {16, 32, 64}


@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "fused"])
def test_emulated_lookup_matches_libibp(cuda_lib, case, dedup):
    name, w, t = case
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        pytest.skip("pooled lookups are for float tables")
    idx, off, weights = _batch(t.shape[0], 700, 64, 1)
    for mode in ("sum", "mean"):
        for wts in (None, weights):
            # Same order, same arithmetic (weighted: fmaf(w, x, acc) in both): the same bits.
            ref = t.lookup(idx, off, wts, mode)
            got = cuda.emulate_lookup(t, idx, off, wts, mode, dedup)
            assert torch.equal(got, ref), (mode, wts is not None, float((got - ref).abs().max()))


def test_emulated_weighted_pooling_uses_fma(cuda_lib):
    """The kernels pool weighted rows with one rounding, fma(w, x, acc), as libibp's
    fmaf does. Here acc = -(1 + 2^-11) after the first row, and the second adds
    (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24: one rounding keeps 2^-24, two (the product
    rounds to 1 + 2^-11 first) give 0."""
    x = torch.tensor([[1.0 + 2.0 ** -11], [1.0 + 2.0 ** -12]], dtype=torch.float32)
    t = ibp_embed.compress(x, word_bits=32)
    idx, off = np.array([0, 1]), np.array([0, 2])
    wts = np.array([-1.0, 1.0 + 2.0 ** -12], np.float32)
    twice = np.float32(np.float32(wts[1] * np.float32(x[1, 0].item())) - np.float32(x[0, 0].item()))
    assert twice == 0.0
    assert t.lookup(idx, off, wts)[0, 0].item() == 2.0 ** -24
    for dedup in (True, False):
        assert cuda.emulate_lookup(t, idx, off, wts, dedup=dedup)[0, 0].item() == 2.0 ** -24


def test_emulated_lookup_edge_cases(cuda_lib):
    t = ibp_embed.compress(_mixed(50, 8, torch.float32))
    for dedup in (True, False):
        out = cuda.emulate_lookup(t, np.zeros(0, np.int64), np.zeros(4, np.int64), dedup=dedup)
        assert out.shape == (3, 8) and not out.any()
        with pytest.raises(IndexError):
            cuda.emulate_lookup(t, [1, 50], [0, 2], dedup=dedup)
        with pytest.raises(IndexError):
            cuda.emulate_lookup(t, [-1], [0, 1], dedup=dedup)
        with pytest.raises(ValueError, match="offsets"):
            cuda.emulate_lookup(t, [1, 2, 3], [0, 2, 1, 3], dedup=dedup)
        with pytest.raises(ValueError, match="offsets"):
            cuda.emulate_lookup(t, [1, 2, 3], [0, 2], dedup=dedup)
    with pytest.raises(IndexError):
        cuda.emulate_gather(t, [0, 50])
    # the emulated table takes weights as CudaTable does: any sequence of real numbers
    table = cuda.EmulatedCudaTable(t)
    ids, off = torch.tensor([1, 2]), torch.tensor([0, 2])
    assert torch.equal(table.lookup(ids, off, [0.5, 2.0]), table.lookup(ids, off, torch.tensor([0.5, 2.0])))
    with pytest.raises(TypeError, match="per_sample_weights must be real numbers"):
        table.lookup(ids, off, torch.ones(2, dtype=torch.complex64))


def test_emulated_decode_detects_corrupt_rows(cuda_lib):
    w = _smooth(64, 32, torch.float32)
    t = ibp_embed.compress(w, word_bits=32, clusters=1)
    assert (t.row_lengths() < 128).all()
    # Flip word j's participation bit in row 5, j a word with >= 8 invariant bits:
    # the bitstream then needs at least a byte more or less than the row holds.
    j = int(np.argmax(np.bitwise_count(t._masks[0])))
    assert np.bitwise_count(t._masks[0][j]) >= 8
    row = 5
    start = int(t._row_starts()[row])
    payload = t._payload.copy()
    payload[start + j // 8] ^= np.uint8(1 << (j % 8))
    bad = ibp_embed.CompressedTable(shape=t.shape, dtype=t.dtype, word_bits=t.word_bits,
                                    masks=t._masks, bitvals=t._bitvals, block_base=t._block_base,
                                    rel=t._rel, payload=payload, payload_bytes=t._payload_bytes,
                                    validate=False)
    with pytest.raises(FormatError):
        bad.gather([row])
    with pytest.raises(FormatError):
        cuda.emulate_gather(bad, [row])
    ok = [i for i in range(64) if i != row]
    assert torch.equal(cuda.emulate_gather(bad, ok), w[ok])


def test_emulation_handles_an_unaligned_payload(cuda_lib):
    w = _mixed(100, 24, torch.float32)
    t = ibp_embed.compress(w, word_bits=32)
    buf = np.zeros(t._payload.size + 1, np.uint8)
    payload = buf[1:]
    payload[:] = t._payload
    assert payload.ctypes.data % 16
    t2 = ibp_embed.CompressedTable(shape=t.shape, dtype=t.dtype, word_bits=t.word_bits,
                                   masks=t._masks, bitvals=t._bitvals, block_base=t._block_base,
                                   rel=t._rel, payload=payload, payload_bytes=t._payload_bytes)
    assert torch.equal(cuda.emulate_gather(t2, np.arange(100)), w)


# ---- many rows and bags per warp: the kernels' loops ----

# The row kernels' grid on an H100/H200 (132 SMs, 4 blocks of 8 warps an SM).
H100_GRID_WARPS = 132 * 32


@pytest.fixture
def emulated_grid(cuda_lib):
    """Set the emulated grid's warps for a test; the default again after it."""
    yield lambda warps: cuda_lib.ibp_cuda_emulate_grid(warps)
    cuda_lib.ibp_cuda_emulate_grid(0)


@pytest.mark.parametrize("dtype,dim,word_bits", LOOP_CASES, ids=LOOP_IDS)
def test_emulated_kernels_walk_many_rows_and_bags_per_warp(cuda_lib, emulated_grid, dtype, dim,
                                                           word_bits):
    """About 200,000 ids in 20,000 bags (and a run of 8,449 empty ones) on an
    H100-sized grid (4,224 warps): each warp decodes ~47 rows of the gather and
    ~7 of the dedup's distinct rows, and pools ~5 bags, so the next-row prefetch,
    the buffer swap and the move to the next bag run many times, in the kernels'
    own loop code (loops.cuh)."""
    from benchmarks.raw_baseline import emulate_raw_lookup

    emulated_grid(H100_GRID_WARPS)
    n_bags, n_rows = 20_000 + 2 * H100_GRID_WARPS + 1, 30_000
    w, t = _loop_table(dtype, dim, word_bits, n_rows)
    idx, off, wts = _loop_batch(n_rows, n_bags, H100_GRID_WARPS, 7)
    full = int((np.diff(off) > 0).sum())
    assert idx.size > 190_000 and full > 4 * H100_GRID_WARPS
    assert np.unique(idx).size > 4 * H100_GRID_WARPS
    _check_loops(t, lambda i: cuda.emulate_gather(t, i),
                 lambda i, o, wt, m, d: cuda.emulate_lookup(t, i, o, wt, m, d), idx, off, wts,
                 lambda i, o, wt, m: emulate_raw_lookup(w, i, o, wt, m))


@pytest.mark.parametrize("warps", [1, 3, 16, 257, 100_000])
def test_emulated_results_do_not_depend_on_the_grid(cuda_lib, emulated_grid, warps):
    """One warp doing everything, odd grids, and more warps than items: the same bits."""
    from benchmarks.raw_baseline import emulate_raw_lookup

    emulated_grid(warps)
    w, t = _loop_table(torch.float32, 24, 64, 500, seed=3)
    idx, off, wts = _loop_batch(500, 400, 20, 9)
    _check_loops(t, lambda i: cuda.emulate_gather(t, i),
                 lambda i, o, wt, m, d: cuda.emulate_lookup(t, i, o, wt, m, d), idx, off, wts,
                 lambda i, o, wt, m: emulate_raw_lookup(w, i, o, wt, m))


def test_emulated_grid_setting(cuda_lib, emulated_grid):
    assert emulated_grid(7) == 16  # the default
    assert emulated_grid(0) == 7
    assert cuda_lib.ibp_cuda_emulate_grid(0) == 16


# ---- the raw-row baseline kernel (ibp_cuda_raw_lookup), emulated ----

@pytest.mark.parametrize("dtype,dim", [(torch.float32, 16), (torch.float16, 3), (torch.bfloat16, 5),
                                       (torch.float16, 64)])
def test_emulated_raw_lookup_matches_torch_embedding_bag(cuda_lib, dtype, dim):
    """Rows of 6 or 10 bytes start anywhere in a 16-byte granule, and the table's
    end is not on a granule boundary (the last granule is copied partly)."""
    from benchmarks.raw_baseline import emulate_raw_lookup

    n = 1001
    w = _mixed(n, dim, dtype, 5)
    assert (n * dim * w.dtype.itemsize) % 16 or dim in (16, 64)
    idx, off, wts = _batch(n, 4000, 300, 11)
    idx[:10] = n - 1  # the last row
    ii, oo = torch.from_numpy(idx), torch.from_numpy(off)
    for mode in ("sum", "mean"):
        ref = F.embedding_bag(ii, w.float(), oo, mode=mode, include_last_offset=True)
        got = emulate_raw_lookup(w, idx, off, None, mode)
        _assert_pooled_close(got, ref, w, idx, off, None, mode)
    ref = F.embedding_bag(ii, w.float(), oo, mode="sum", per_sample_weights=torch.from_numpy(wts),
                          include_last_offset=True)
    _assert_pooled_close(emulate_raw_lookup(w, idx, off, wts), ref, w, idx, off, wts, "sum")
    # libibp's order and arithmetic: the same bits
    t = ibp_embed.compress(w, progress=False)
    for mode in ("sum", "mean"):
        assert torch.equal(emulate_raw_lookup(w, idx, off, wts, mode), t.lookup(idx, off, wts, mode))


def test_emulated_raw_lookup_errors(cuda_lib):
    from benchmarks.raw_baseline import emulate_raw_lookup

    w = _mixed(50, 8, torch.float32)
    out = emulate_raw_lookup(w, np.zeros(0, np.int64), np.zeros(4, np.int64))
    assert out.shape == (3, 8) and not out.any()
    with pytest.raises(IndexError):
        emulate_raw_lookup(w, [1, 50], [0, 2])
    with pytest.raises(IndexError):
        emulate_raw_lookup(w, [-1], [0, 1])
    with pytest.raises(ValueError, match="offsets"):
        emulate_raw_lookup(w, [1, 2, 3], [0, 2, 1, 3])
    buf = torch.zeros(50 * 8 + 1)
    with pytest.raises(ValueError, match="16-byte aligned"):
        emulate_raw_lookup(buf[1:].view(50, 8), [1], [0, 1])
