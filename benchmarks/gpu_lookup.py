#!/usr/bin/env python3
"""GPU lookup benchmark: IBP pooled lookups from pinned host memory against baselines.

Rows compared, on the same table and batches (ms per batch, median of CUDA-event
timings, and the effective bandwidth: raw bytes of every looked-up row / time):

- torch DEVICE: F.embedding_bag on the raw table in device memory (HBM);
- torch UVM-like: the same torch kernel on the raw table left in pinned host
  memory and mapped into the GPU (zero-copy; what FBGEMM MANAGED does);
- torch host gather + H2D: index_select on the CPU, copy, pool on the GPU (the
  baseline of the IBP paper's DLRM numbers);
- ibp host: CudaTable(placement="host"), compressed rows read zero-copy over
  PCIe and decoded on the GPU, with dedup (sort + unique) and fused (no dedup);
- ibp raw host: the same kernels on a table whose rows are all stored raw (no
  compression): isolates what the compression itself buys;
- ibp device: compressed payload in HBM (decode throughput, no PCIe);
- ibp host + cache: a RowCache (load factor 0.2, LRU) in front of ibp host;
- FBGEMM MANAGED / MANAGED_CACHING / DEVICE, when fbgemm_gpu imports.

It also measures pinned host -> device copy bandwidth (the PCIe ceiling) and the
gather (decode) throughput of ibp from HBM. Prints a short table last.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s] {msg}", flush=True)


# ---- a torch CUDA tensor over pinned host memory (zero-copy), through DLPack ----

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", _DELETER)]
_KEEP = []  # ctypes objects that must outlive the tensors made from them
_DTYPES = {torch.float32: (2, 32), torch.float16: (2, 16), torch.bfloat16: (4, 16),
           torch.uint8: (1, 8), torch.int64: (0, 64)}
KDL_CPU, KDL_CUDA = 1, 2


def tensor_from_pointer(ptr: int, shape, dtype: torch.dtype, device_type: int, device_id: int = 0,
                        owner=None) -> torch.Tensor:
    """Wrap memory at `ptr` (C-contiguous `shape` of `dtype`) as a torch tensor, no copy.

    With device_type KDL_CUDA and the device pointer of registered (pinned,
    mapped) host memory, torch's CUDA kernels read host memory over PCIe.
    """
    shape_arr = (ctypes.c_int64 * len(shape))(*shape)
    mt = _DLManagedTensor()
    mt.dl_tensor.data = ptr
    mt.dl_tensor.device = _DLDevice(device_type, device_id)
    mt.dl_tensor.ndim = len(shape)
    code, bits = _DTYPES[dtype]
    mt.dl_tensor.dtype = _DLDataType(code, bits, 1)
    mt.dl_tensor.shape = shape_arr
    mt.dl_tensor.strides = None
    mt.dl_tensor.byte_offset = 0
    mt.manager_ctx = None
    mt.deleter = _DELETER(lambda _p: None)
    _KEEP.append((mt, shape_arr, owner))
    capsule_new = ctypes.pythonapi.PyCapsule_New
    capsule_new.restype = ctypes.py_object
    capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = capsule_new(ctypes.addressof(mt), b"dltensor", None)
    return torch.utils.dlpack.from_dlpack(capsule)


# ---- data ----

def make_table(n_rows: int, dim: int, dtype: torch.dtype, init: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if init == "uniform":  # TorchRec's default init
        w = (torch.rand(n_rows, dim, generator=g) * 2 - 1) / n_rows ** 0.5
    else:
        w = torch.randn(n_rows, dim, generator=g) * 0.01
    return w.to(dtype)


def zipf_sampler(n_rows: int, alpha: float, seed: int):
    """Bounded Zipf ranks over n_rows, hot rows scattered by a fixed permutation."""
    cdf = np.cumsum(1.0 / np.arange(1, n_rows + 1, dtype=np.float64) ** alpha)
    cdf /= cdf[-1]
    perm = np.random.default_rng(seed + 1).permutation(n_rows)
    rng = np.random.default_rng(seed)

    def draw(n):
        return perm[np.minimum(np.searchsorted(cdf, rng.random(n)), n_rows - 1)]
    return draw


def make_batches(dist: str, n_rows: int, bags: int, pooling: int, n_batches: int, alpha: float,
                 seed: int, device):
    rng = np.random.default_rng(seed)
    draw = zipf_sampler(n_rows, alpha, seed) if dist == "zipf" else \
        (lambda n: rng.integers(0, n_rows, n))
    out = []
    for _ in range(n_batches):
        sizes = rng.integers(max(1, pooling // 2), pooling * 3 // 2 + 1, bags)
        off = np.zeros(bags + 1, np.int64)
        np.cumsum(sizes, out=off[1:])
        idx = draw(int(off[-1])).astype(np.int64)
        out.append((torch.from_numpy(idx).to(device), torch.from_numpy(off).to(device)))
    return out


def all_raw_table(w: torch.Tensor):
    """A CompressedTable whose rows are all stored raw: the IBP kernels then move raw bytes."""
    from ibp_embed import _native
    from ibp_embed.dtypes import as_rows
    from ibp_embed.table import CompressedTable

    rows, dtype, dim = as_rows(w)
    n, r = rows.shape
    word_bits = 32
    m = -(-r // 4)
    starts = np.arange(n + 1, dtype=np.uint64) * np.uint64(r)
    block_base = np.ascontiguousarray(starts[::64])
    rel_dtype = np.uint16 if _native.lib.ibp_rel_bytes(r) == 2 else np.uint32
    rel = (starts - np.repeat(block_base, 64)[: n + 1]).astype(rel_dtype)
    pad = int(_native.lib.ibp_tail_pad(r, word_bits))
    payload = np.zeros(n * r + pad, np.uint8)
    payload[: n * r] = rows.reshape(-1)
    zeros = np.zeros((1, m), np.uint64)
    return CompressedTable(shape=(n, dim), dtype=dtype, word_bits=word_bits, masks=zeros,
                           bitvals=zeros.copy(), block_base=block_base, rel=rel, payload=payload,
                           payload_bytes=n * r, validate=False)


# ---- timing ----

def cuda_time(fn, batches, iters: int, warmup: int) -> float:
    """Median milliseconds of fn(idx, off) over the batches (cycled), CUDA events."""
    for i in range(warmup):
        fn(*batches[i % len(batches)])
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        idx, off = batches[i % len(batches)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(idx, off)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--init", default="uniform", choices=["uniform", "normal"])
    ap.add_argument("--bags", type=int, default=16384, help="bags (samples) per batch")
    ap.add_argument("--pooling", type=int, default=32, help="mean ids per bag")
    ap.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cache-load-factor", type=float, default=0.2)
    ap.add_argument("--skip-host-gather", action="store_true", help="skip the CPU gather + H2D row")
    ap.add_argument("--table-out", help="also write the result table (markdown) to this file")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        print("no CUDA device: torch.cuda.is_available() is False; nothing to benchmark")
        return 2
    import ibp_embed
    from ibp_embed import cuda
    from ibp_embed.cache import RowCache

    dev = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(dev)
    log(f"device {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
        f"torch {torch.__version__}")
    dtype = getattr(torch, args.dtype)
    n, dim = args.rows, args.dim
    row_bytes = dim * dtype.itemsize

    # PCIe ceiling: pinned host -> device copies.
    pinned = torch.empty(512 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(pinned, device=dev)
    dst.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(4):
        dst.copy_(pinned, non_blocking=True)
    e.record()
    e.synchronize()
    h2d = 4 * pinned.numel() / (s.elapsed_time(e) / 1e3) / 1e9
    del pinned, dst
    log(f"pinned host -> device copy: {h2d:.1f} GB/s")

    log(f"table {n} x {dim} {args.dtype} ({args.init} init), {n * row_bytes / 2**30:.2f} GiB raw")
    w = make_table(n, dim, dtype, args.init, seed=0)
    t0 = time.time()
    table = ibp_embed.compress(w, progress=False)
    log(f"compressed in {time.time() - t0:.1f}s: {table}")
    raw = all_raw_table(w)

    results = []  # (workload, method, ms, GB/s, note)

    def row(workload, method, ms, n_idx, note=""):
        gbs = n_idx * row_bytes / (ms / 1e3) / 1e9 if ms == ms else float("nan")
        results.append((workload, method, ms, gbs, note))
        log(f"{workload:8s} {method:28s} {ms:9.3f} ms  {gbs:7.1f} GB/s  {note}")

    # Placements.
    ibp_host = cuda.CudaTable(table, dev, placement="host")
    log(f"ibp host placement: {ibp_host.info()}")
    ibp_dev = cuda.CudaTable(table, dev, placement="device")
    raw_host = cuda.CudaTable(raw, dev, placement="host")
    w_dev = w.to(dev)
    # The raw table pinned and mapped: a torch CUDA tensor whose bytes live in host memory.
    w_host = w.contiguous()
    lib = cuda.load_library()
    dptr = cuda.ffi.new("void **")
    cuda.check(lib.ibp_cuda_host_register(cuda.ffi.cast("void *", w_host.data_ptr()),
                                          w_host.numel() * w_host.element_size(), dptr),
               "pinning the raw table", lib)
    w_uvm = tensor_from_pointer(int(cuda.ffi.cast("uintptr_t", dptr[0])), (n, dim), dtype,
                                KDL_CUDA, dev.index, owner=w_host)
    w_pinned_cpu = w_host  # registered: the H2D copies of the host-gather row are DMA-able

    # Decode throughput from HBM (gather, no PCIe), and from host memory.
    g_idx = torch.randint(0, n, (1 << 20,), device=dev)
    for name, ct in (("ibp device gather", ibp_dev), ("ibp host gather", ibp_host),
                     ("ibp raw host gather", raw_host)):
        ms = cuda_time(lambda i, o, ct=ct: ct.gather(i, check=False), [(g_idx, None)], args.iters,
                       args.warmup)
        row("gather", name, ms, g_idx.numel(), "1M random rows, decoded output")
    ms = cuda_time(lambda i, o: w_dev.index_select(0, i), [(g_idx, None)], args.iters, args.warmup)
    row("gather", "torch DEVICE index_select", ms, g_idx.numel())
    ms = cuda_time(lambda i, o: w_uvm.index_select(0, i), [(g_idx, None)], args.iters, args.warmup)
    row("gather", "torch UVM-like index_select", ms, g_idx.numel())

    fbgemm = None
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (CacheAlgorithm,
                                                                          EmbeddingLocation,
                                                                          PoolingMode)
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)
        from fbgemm_gpu.split_embedding_configs import SparseType
        fbgemm = (CacheAlgorithm, EmbeddingLocation, PoolingMode, ComputeDevice,
                  SplitTableBatchedEmbeddingBagsCodegen, SparseType)
    except Exception as e:  # noqa: BLE001
        fbgemm_note = f"fbgemm_gpu unavailable ({type(e).__name__}: {e}); FBGEMM rows skipped"
        log(fbgemm_note)

    def fbgemm_module(location, cache_algo=None):
        (CacheAlgorithm, EmbeddingLocation, PoolingMode, ComputeDevice, TBE, SparseType) = fbgemm
        loc = getattr(EmbeddingLocation, location)
        kw = dict(embedding_specs=[(n, dim, loc, ComputeDevice.CUDA)], pooling_mode=PoolingMode.SUM,
                  weights_precision=SparseType.FP32 if dtype == torch.float32 else SparseType.FP16,
                  output_dtype=SparseType.FP32, device=dev)
        if location == "MANAGED_CACHING":
            kw.update(cache_load_factor=args.cache_load_factor,
                      cache_algorithm=cache_algo or CacheAlgorithm.LRU)
        tbe = TBE(**kw)
        with torch.no_grad():
            tbe.split_embedding_weights()[0].copy_(w.to(tbe.split_embedding_weights()[0].dtype))
        return tbe

    for dist in ("uniform", "zipf"):
        batches = make_batches(dist, n, args.bags, args.pooling, args.batches, args.alpha, 7, dev)
        n_idx = statistics.mean(int(b[0].numel()) for b in batches)
        uniq = statistics.mean(int(torch.unique(b[0]).numel()) for b in batches)
        log(f"{dist}: {args.bags} bags, {n_idx:.0f} ids a batch, {uniq / n_idx:.1%} distinct")

        def emb(weight):
            return lambda i, o: F.embedding_bag(i, weight, o, mode="sum", include_last_offset=True)

        row(dist, "torch DEVICE (HBM)", cuda_time(emb(w_dev), batches, args.iters, args.warmup), n_idx)
        row(dist, "torch UVM-like (zero-copy)", cuda_time(emb(w_uvm), batches, args.iters, args.warmup),
            n_idx)
        if not args.skip_host_gather:
            cpu_batches = [(i.cpu(), o) for i, o in batches]
            staging = torch.empty((max(int(i.numel()) for i, _ in batches), dim),
                                  dtype=dtype).pin_memory()

            def host_gather(i_cpu, o):
                k = i_cpu.numel()
                torch.index_select(w_pinned_cpu, 0, i_cpu, out=staging[:k])
                rows = staging[:k].to(dev, non_blocking=True)
                ar = torch.arange(i_cpu.numel(), device=dev)
                return F.embedding_bag(ar, rows, o, mode="sum", include_last_offset=True)
            ms = cuda_time(host_gather, cpu_batches, max(3, args.iters // 3), 1)
            row(dist, "torch host gather + H2D", ms, n_idx, "CPU index_select")
        for name, ct in (("ibp host dedup", ibp_host), ("ibp raw host dedup", raw_host),
                         ("ibp device dedup", ibp_dev)):
            ms = cuda_time(lambda i, o, ct=ct: ct.lookup(i, o, check=False), batches, args.iters,
                           args.warmup)
            row(dist, name, ms, n_idx)
        for name, ct in (("ibp host fused", ibp_host), ("ibp raw host fused", raw_host)):
            ms = cuda_time(lambda i, o, ct=ct: ct.lookup(i, o, dedup=False, check=False), batches,
                           args.iters, args.warmup)
            row(dist, name, ms, n_idx)
        cache = RowCache(ibp_host, load_factor=args.cache_load_factor, policy="lru")
        for i, o in batches * 2:  # warm the cache
            cache.lookup(i, o)
        cache.reset_stats()
        ms = cuda_time(lambda i, o: cache.lookup(i, o), batches, args.iters, 0)
        row(dist, f"ibp host + cache {args.cache_load_factor}", ms, n_idx,
            f"hit rate {cache.hit_rate:.2f}, {cache.nbytes / 2**20:.0f} MiB")
        ibp_host.check()
        if fbgemm is not None:
            for loc in ("DEVICE", "MANAGED", "MANAGED_CACHING"):
                try:
                    tbe = fbgemm_module(loc)
                    with torch.no_grad():
                        ms = cuda_time(lambda i, o, tbe=tbe: tbe(i, o), batches, args.iters, args.warmup)
                    row(dist, f"FBGEMM {loc}", ms, n_idx)
                    del tbe
                except Exception as e:  # noqa: BLE001
                    log(f"FBGEMM {loc} failed: {type(e).__name__}: {e}")
                    results.append((dist, f"FBGEMM {loc}", float("nan"), float("nan"), "failed"))
        else:
            results.append((dist, "FBGEMM (all placements)", float("nan"), float("nan"),
                            "skipped: fbgemm_gpu not importable"))

    lines = [
        f"GPU lookup benchmark, {time.strftime('%Y-%m-%d')}, {props.name}, torch {torch.__version__}",
        f"table {n} x {dim} {args.dtype} ({args.init} init), IBP ratio {table.ratio:.3f}; "
        f"{args.bags} bags x ~{args.pooling} ids; Zipf alpha {args.alpha}; pinned H2D copy {h2d:.1f} GB/s",
        "GB/s = raw bytes of the rows looked up / time (so it can exceed the PCIe rate)",
        "",
        "| workload | method | ms/batch | GB/s | vs UVM-like | note |",
        "|---|---|---|---|---|---|",
    ]
    base = {wl: ms for wl, m, ms, _, _ in results if m.startswith("torch UVM-like")}
    for wl, m, ms, gbs, note in results:
        speed = base.get(wl, float("nan")) / ms if ms == ms else float("nan")
        lines.append(f"| {wl} | {m} | {ms:.3f} | {gbs:.1f} | {speed:.2f}x | {note} |")
    text = "\n".join(lines) + "\n"
    print()
    print(text, end="")
    if args.table_out:
        Path(args.table_out).write_text(text)
    for ct in (ibp_host, ibp_dev, raw_host):
        ct.close()
    lib.ibp_cuda_host_unregister(cuda.ffi.cast("void *", w_host.data_ptr()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
