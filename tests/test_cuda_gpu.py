"""The CUDA path on a GPU (marked `gpu`; skipped without a CUDA device).

CudaTable against the CPU path, bit for bit for gathers and within 1e-6 relative
for pooling (bit for bit in the large test, whose batches give every warp of every
kernel several rows and bags), the raw kernel, and the row cache on the device.
benchmarks/gpu_check.sh runs them with `pytest -m gpu`.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ibp_embed
from cuda_cases import LOOP_CASES, LOOP_IDS, _assert_pooled_close, _batch, _check_loops, _loop_batch, \
    _loop_table, _mixed, _raw
from ibp_embed import cuda


# ---- (d): on a GPU ----

def _has_gpu() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return cuda.device_count() > 0
    except Exception:
        return False


gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA device: torch.cuda.is_available() is False")


@pytest.fixture(scope="module")
def gpu_ready(cuda_lib):
    if not _has_gpu():
        pytest.skip("no CUDA device visible to libibp_cuda")
    return torch.device("cuda", torch.cuda.current_device())


@gpu
@needs_gpu
@pytest.mark.parametrize("placement", ["host", "device"])
def test_gpu_gather_is_bit_exact(gpu_ready, case, placement):
    name, w, t = case
    ct = cuda.CudaTable(t, gpu_ready, placement=placement)
    info = ct.info()
    assert info["payload_mode"] in (("registered", "shared", "pinned_copy") if placement == "host"
                                    else ("device_copy",))
    rng = np.random.default_rng(0)
    idx = torch.from_numpy(rng.integers(0, t.shape[0], 3000)).to(gpu_ready)
    got = ct.gather(idx)
    assert got.device == gpu_ready and got.dtype == t.dtype
    assert torch.equal(_raw(got.cpu()), _raw(t.gather(idx.cpu())))
    assert torch.equal(_raw(ct.gather(torch.arange(t.shape[0])).cpu()), _raw(w))
    two_d = idx[:60].reshape(6, 10)
    assert ct.gather(two_d).shape == (6, 10, w.shape[1])
    assert ct.gather(torch.zeros(0, dtype=torch.int64)).shape == (0, w.shape[1])
    ct.close()


@gpu
@needs_gpu
@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "fused"])
@pytest.mark.parametrize("placement", ["host", "device"])
def test_gpu_lookup_matches_cpu(gpu_ready, case, dedup, placement):
    name, w, t = case
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        pytest.skip("pooled lookups are for float tables")
    ct = cuda.CudaTable(t, gpu_ready, placement=placement)
    idx, off, weights = _batch(t.shape[0], 5000, 300, 2)
    for mode in ("sum", "mean"):
        for wts in (None, weights):
            ref = t.lookup(idx, off, wts, mode)
            got = ct.lookup(torch.from_numpy(idx).to(gpu_ready), torch.from_numpy(off).to(gpu_ready),
                            None if wts is None else torch.from_numpy(wts).to(gpu_ready), mode,
                            dedup=dedup)
            assert got.device == gpu_ready and got.shape == ref.shape
            _assert_pooled_close(got, ref, w, idx, off, wts, mode)
    ct.close()


def _loop_sizes(props) -> tuple[int, int, int]:
    """(bags, table rows, grid warps) such that every warp of every kernel's grid
    gets several items on this device: the row kernels' grids hold at most the
    SMs' resident warps (64 an SM on sm_80/sm_90), the dedup pooling kernel's at
    most 16 blocks of 8 warps an SM; _loop_batch puts ~10 ids in a bag."""
    sms = props.multi_processor_count
    grid = sms * getattr(props, "max_threads_per_multi_processor", 2048) // 32
    pool_grid = sms * 16 * 8
    n_bags = max(20_000, 3 * max(grid, pool_grid)) + 2 * grid + 1  # + _loop_batch's empty run
    n_rows = max(30_000, 4 * grid)  # the dedup path's distinct rows outnumber the grid too
    return n_bags, n_rows, grid


def _register(t: torch.Tensor) -> int:
    """Pin a CPU tensor in place; the device pointer the kernels read it through."""
    lib = cuda.load_library()
    dptr = cuda.ffi.new("void **")
    cuda.check(lib.ibp_cuda_host_register(cuda.ffi.cast("void *", t.data_ptr()),
                                          t.numel() * t.element_size(), dptr), "host_register", lib)
    return int(cuda.ffi.cast("uintptr_t", dptr[0]))


def _unregister(t: torch.Tensor) -> None:
    lib = cuda.load_library()
    cuda.check(lib.ibp_cuda_host_unregister(cuda.ffi.cast("void *", t.data_ptr())), "unregister", lib)


@gpu
@needs_gpu
@pytest.mark.parametrize("placement", ["host", "device"])
@pytest.mark.parametrize("dtype,dim,word_bits", LOOP_CASES, ids=LOOP_IDS)
def test_gpu_kernels_walk_many_rows_and_bags_per_warp(gpu_ready, placement, dtype, dim, word_bits):
    """More rows (gather, and the dedup's distinct rows) and more bags (fused,
    dedup pooling, raw kernel) than the grids hold warps, so every warp runs the
    next-row prefetch, the buffer swap and the move to its next bag several
    times; checked bit for bit against libibp (the kernels pool in libibp's
    order with fma, as the emulation, whose same sizes pass without a GPU)."""
    from benchmarks.raw_baseline import raw_lookup

    props = torch.cuda.get_device_properties(gpu_ready)
    n_bags, n_rows, grid = _loop_sizes(props)
    w, t = _loop_table(dtype, dim, word_bits, n_rows)
    idx, off, wts = _loop_batch(n_rows, n_bags, grid, 7)
    assert np.unique(idx).size > 2 * grid and idx.size > 20 * grid
    assert int((np.diff(off) > 0).sum()) > 2 * max(grid, props.multi_processor_count * 128)
    ct = cuda.CudaTable(t, gpu_ready, placement=placement)
    info = ct.info()
    assert info["staged"] and info["warps_per_block"] * 32 <= 1024
    dev = gpu_ready
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    if placement == "host":  # the raw kernel over pinned host rows (zero-copy), else over HBM rows
        w_host = w.contiguous().clone()
        rows_ptr, keep = _register(w_host), w_host
    else:
        keep = w.to(dev)
        rows_ptr = keep.data_ptr()

    def to_dev(x):
        return None if x is None else torch.from_numpy(np.asarray(x)).to(dev)

    def lookup(i, o, wt, mode, dedup):
        return ct.lookup(to_dev(i), to_dev(o), to_dev(wt), mode, dedup=dedup).cpu()

    def raw(i, o, wt, mode):
        return raw_lookup(rows_ptr, n_rows, dtype, dim, to_dev(i), to_dev(o), to_dev(wt), mode,
                          status=status).cpu()
    try:
        _check_loops(t, lambda i: ct.gather(to_dev(i)).cpu(), lookup, idx, off, wts, raw)
        with pytest.raises(IndexError):  # and the raw kernel's error flags
            raw(np.array([0, n_rows]), np.array([0, 2]), None, "sum")
        assert int(status.item()) == 0  # reported and cleared
    finally:
        ct.close()
        if placement == "host":
            _unregister(keep)


@gpu
@needs_gpu
def test_gpu_lookup_edge_cases(gpu_ready):
    w = _mixed(200, 64, torch.float32)
    t = ibp_embed.compress(w)
    ct = cuda.CudaTable(t, gpu_ready)
    dev = gpu_ready
    for dedup in (True, False):
        # all bags empty, no indices
        out = ct.lookup(torch.zeros(0, dtype=torch.int64, device=dev),
                        torch.zeros(5, dtype=torch.int64, device=dev), dedup=dedup)
        assert out.shape == (4, 64) and not out.any()
        # one row named many times, empty bags around it
        idx = torch.full((1000,), 7, dtype=torch.int64, device=dev)
        off = torch.tensor([0, 0, 1000, 1000], device=dev)
        _assert_pooled_close(ct.lookup(idx, off, dedup=dedup), t.lookup(idx.cpu(), off.cpu()),
                             w, idx.cpu().numpy(), off.cpu().numpy(), None, "sum")
        with pytest.raises(IndexError):
            ct.lookup(torch.tensor([1, 200], device=dev), torch.tensor([0, 2], device=dev), dedup=dedup)
        with pytest.raises(IndexError):
            ct.lookup(torch.tensor([-1], device=dev), torch.tensor([0, 1], device=dev), dedup=dedup)
        with pytest.raises(ValueError):
            ct.lookup(torch.tensor([1, 2, 3], device=dev), torch.tensor([0, 2, 1, 3], device=dev),
                      dedup=dedup)
        # the errors were reported and cleared: the next call is fine
        ok = ct.lookup(torch.tensor([1, 2], device=dev), torch.tensor([0, 2], device=dev), dedup=dedup)
        assert torch.equal(ok.cpu(), t.lookup([1, 2], [0, 2]))
    with pytest.raises(IndexError):
        ct.gather(torch.tensor([0, 200], device=dev))
    # asynchronous calls, errors found by check()
    ct.gather(torch.tensor([0, 999], device=dev), check=False)
    with pytest.raises(IndexError):
        ct.check()
    ct.check()
    ct.close()


@gpu
@needs_gpu
def test_gpu_large_rows_and_direct_reads(gpu_ready, monkeypatch):
    # Rows of 120 KB: too large to stage twice per warp in shared memory: direct reads.
    w = _mixed(24, 30000, torch.float32)
    t = ibp_embed.compress(w, word_bits=32)
    ct = cuda.CudaTable(t, gpu_ready)
    assert not ct.info()["staged"]
    assert torch.equal(ct.gather(torch.arange(24)).cpu(), w)
    _assert_pooled_close(ct.lookup(torch.arange(24), torch.tensor([0, 10, 24])),
                         t.lookup(np.arange(24), [0, 10, 24]), w, np.arange(24), [0, 10, 24],
                         None, "sum")
    ct.close()
    # Forced direct reads on a small table (IBP_CUDA_STAGED=0 at placement).
    w = _mixed(500, 128, torch.float32)
    t = ibp_embed.compress(w, clusters=4)
    monkeypatch.setenv("IBP_CUDA_STAGED", "0")
    ct = cuda.CudaTable(t, gpu_ready)
    monkeypatch.delenv("IBP_CUDA_STAGED")
    assert not ct.info()["staged"]
    assert torch.equal(ct.gather(torch.arange(500)).cpu(), w)
    idx, off, weights = _batch(500, 3000, 100, 5)
    _assert_pooled_close(ct.lookup(idx, off, weights, dedup=False), t.lookup(idx, off, weights),
                         w, idx, off, weights, "sum")
    ct.close()


@gpu
@needs_gpu
def test_gpu_shared_registration_and_mmap(gpu_ready, tmp_path):
    w = _mixed(1000, 32, torch.bfloat16)
    t = ibp_embed.compress(w)
    a, b = cuda.CudaTable(t, gpu_ready), cuda.CudaTable(t, gpu_ready)
    a.close()  # b still reads the payload pinned for both
    assert torch.equal(b.gather(torch.arange(1000)).cpu(), w)
    b.close()
    path = tmp_path / "t.ibp"
    t.save(path)
    loaded = ibp_embed.load(path)
    c = cuda.CudaTable(loaded, gpu_ready)
    assert torch.equal(c.gather(torch.arange(1000)).cpu(), w)
    c.close()


@gpu
@needs_gpu
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_gpu_row_cache(gpu_ready, policy):
    from ibp_embed.cache import RowCache

    w = _mixed(2000, 64, torch.float16)
    t = ibp_embed.compress(w)
    assert t.clusters > 1
    ct = cuda.CudaTable(t, gpu_ready)
    cache = RowCache(ct, load_factor=0.2, policy=policy)
    assert cache.device == gpu_ready and cache.rows.device == gpu_ready
    rng = np.random.default_rng(3)
    batches = [_batch(2000, 2000, 100, s) for s in range(6)]
    for i, (idx, off, wts) in enumerate(batches):
        if i + 1 < len(batches):
            cache.prefetch(torch.from_numpy(batches[i + 1][0]).to(gpu_ready))
        got = cache.lookup(torch.from_numpy(idx).to(gpu_ready), torch.from_numpy(off).to(gpu_ready),
                           torch.from_numpy(wts).to(gpu_ready), "mean")
        _assert_pooled_close(got, t.lookup(idx, off, wts, "mean"), w, idx, off, wts, "mean")
    assert cache.prefetched > 0 and cache.hits > 0
    # a host-decoding source for a device cache
    cache2 = RowCache(t, load_factor=0.5, policy=policy, device=gpu_ready)
    idx = rng.integers(0, 2000, 500)
    assert torch.equal(cache2.gather(torch.from_numpy(idx)).cpu(), w[idx])
    ct.close()
