#!/usr/bin/env python3
"""GPU lookup benchmark: IBP pooled lookups from pinned host memory against baselines.

Methods, on the same table and the same batches (pooled sum lookups, B bags of
about P ids, uniform and Zipf ids):

- ibp host dedup / fused: CudaTable(placement="host"): compressed rows read
  zero-copy over PCIe and decoded on the GPU; dedup sorts and deduplicates the
  batch's ids (each distinct row read once), fused reads every id's row;
- ibp device dedup: the compressed payload in HBM (decode cost, no PCIe);
- raw zero-copy kernel: libibp_cuda's ibp_cuda_raw_lookup over the raw rows in
  pinned host memory: the fused kernel's structure without decoding, the
  stand-in for FBGEMM's UVM placement (FBGEMM's CUDA build cannot be installed
  on the GPU machine); "raw kernel HBM": the same kernel over rows in HBM;
- torch DEVICE: F.embedding_bag on the raw table in HBM;
- torch zero-copy: the same torch kernel on the raw rows left in pinned host
  memory, mapped into the GPU;
- torch host gather + H2D: index_select on the CPU, copy, pool on the GPU (the
  baseline of the IBP paper's DLRM numbers; --skip-host-gather drops it);
- cache over IBP / cache over raw: ibp_embed.cache.RowCache (LRU, HBM) in front
  of the IBP host table, and in front of the raw zero-copy rows with the same
  HBM (its capacity grows by the IBP metadata's HBM bytes: the stand-in for
  FBGEMM's MANAGED_CACHING). Caches are warmed on separate batches of the same
  distribution and timed on the others, each timed batch seen once;
- FBGEMM DEVICE / MANAGED / MANAGED_CACHING, only where fbgemm_gpu's CUDA build
  imports.

Timing: CUDA events around back-to-back calls over all timed batches (no
synchronization between calls; errors are checked after), the median over
--repeats passes; stateful caches get one pass. Every result of every method on
every timed batch is checked against libibp's CPU lookup (bit for bit where the
method sums in libibp's order: the IBP kernels and the raw kernel; otherwise
within 1e-5 of the sum of |terms|), and the kernels' error flags are read.

Columns: PCIe MB/batch (modeled: the 16-byte granules the kernels' cp.async
copies fetch, the raw rows torch's kernels read, the rows a cache fetches),
ratio (raw bytes of the rows read / bytes read: the compression gain alone),
distinct (distinct ids / ids of the batches: the dedup gain available), hit rate
(caches), eff GB/s (raw bytes of every looked-up row / time).

--emulate runs a reduced configuration on the CPU: the IBP and raw kernels
through their host emulation (ibp_cuda_emulate_*), torch on CPU tensors, the
caches on the CPU; times are then CPU times and mean nothing for the GPU, but
every check, column and output runs. --dry-run prints the plan and exits 0.
The table is printed last; the JSON goes to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# The methods, their timing and checks: benchmarks/gpu_methods.py; tables and batches: benchmarks/gpu_data.py.
from benchmarks.gpu_data import granule_bytes, make_batches, make_table  # noqa: E402
from benchmarks.gpu_methods import (Clock, CountingSource, Method, RawSource, Result,  # noqa: E402
                                    fbgemm_methods, log, run_method, tensor_from_pointer)
from benchmarks.raw_baseline import emulate_raw_lookup, raw_lookup  # noqa: E402


# ---- the run ----

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=None, help="table rows (default 2,000,000; --emulate 20,000)")
    ap.add_argument("--dim", type=int, default=None, help="row elements (default 128; --emulate 32)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--init", default="uniform", choices=["uniform", "normal"])
    ap.add_argument("--bags", type=int, default=None, help="bags per batch (default 16384; --emulate 256)")
    ap.add_argument("--pooling", type=int, default=None, help="mean ids per bag (default 32; --emulate 8)")
    ap.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent")
    ap.add_argument("--dists", default="uniform,zipf", help="id distributions, comma separated")
    ap.add_argument("--timed-batches", type=int, default=None, help="distinct timed batches (default 8; --emulate 2)")
    ap.add_argument("--warm-batches", type=int, default=None, help="cache warm-up batches (default 8; --emulate 2)")
    ap.add_argument("--repeats", type=int, default=None, help="timed passes of stateless methods (default 5; --emulate 1)")
    ap.add_argument("--gather-rows", type=int, default=None, help="rows of the gather workload (default 262144; --emulate 2048)")
    ap.add_argument("--cache-load-factor", type=float, default=0.2)
    ap.add_argument("--skip-host-gather", action="store_true", help="skip the CPU gather + H2D method")
    ap.add_argument("--emulate", action="store_true",
                    help="CPU-only: a reduced run through the kernels' host emulation (times are CPU times)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and whether a CUDA device is usable; exit 0")
    ap.add_argument("--table-out", help="also write the result table (markdown) to this file")
    ap.add_argument("--results-dir", default=None, help="where the JSON goes (default benchmarks/results)")
    ap.add_argument("--no-json", action="store_true")
    args = ap.parse_args(argv)
    small = args.emulate
    for name, full, reduced in (("rows", 2_000_000, 20_000), ("dim", 128, 32), ("bags", 16384, 256),
                                ("pooling", 32, 8), ("timed_batches", 8, 2), ("warm_batches", 8, 2),
                                ("repeats", 5, 1), ("gather_rows", 262144, 2048)):
        if getattr(args, name) is None:
            setattr(args, name, reduced if small else full)
    args.dists = [d for d in args.dists.split(",") if d]
    bad = [d for d in args.dists if d not in ("uniform", "zipf")]
    if bad:
        ap.error(f"unknown distributions {bad}")
    return args


def cuda_usable() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    try:
        from ibp_embed import cuda
        n = cuda.device_count()
    except Exception as e:  # noqa: BLE001
        return False, f"libibp_cuda unusable: {e}"
    return (n > 0), (f"{n} device(s)" if n else "libibp_cuda sees no CUDA device")


def main(argv=None) -> int:
    args = parse_args(argv)
    ok_dev, why = cuda_usable()
    if args.dry_run:
        print(f"gpu_lookup plan: table {args.rows} x {args.dim} {args.dtype} ({args.init}), "
              f"{args.bags} bags x ~{args.pooling} ids, {args.timed_batches} timed + "
              f"{args.warm_batches} warm batches per distribution {args.dists}, {args.repeats} passes, "
              f"cache load factor {args.cache_load_factor}, emulate={args.emulate}")
        print(f"CUDA device: {'yes' if ok_dev else 'no'} ({why})" +
              ("" if ok_dev or args.emulate else "; a real run needs a CUDA device (--emulate runs on the CPU)"))
        return 0
    if not args.emulate and not ok_dev:
        print(f"gpu_lookup needs a CUDA device ({why}); run with --emulate for the CPU self-check, "
              f"or --dry-run for the plan")
        return 2
    return run(args)


def run(args) -> int:
    import ibp_embed
    from ibp_embed import cuda
    from ibp_embed.cache import RowCache

    from benchmarks import common

    emulate = args.emulate
    dev = torch.device("cpu") if emulate else torch.device("cuda", torch.cuda.current_device())
    clock = Clock(dev)
    dtype = getattr(torch, args.dtype)
    n, dim = args.rows, args.dim
    row_bytes = dim * dtype.itemsize
    info = {"emulate": emulate, "torch": torch.__version__}
    if emulate:
        log(f"EMULATION on the CPU: the kernels' code runs on the host; times are CPU times, "
            f"not GPU times; torch {torch.__version__}")
        h2d = float("nan")
    else:
        props = torch.cuda.get_device_properties(dev)
        info.update(device=props.name, sms=props.multi_processor_count,
                    device_memory=props.total_memory)
        log(f"device {props.name}, {props.multi_processor_count} SMs, "
            f"{props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}")
        pinned = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
        dst = torch.empty_like(pinned, device=dev)
        dst.copy_(pinned, non_blocking=True)
        ms = clock.time(lambda: [dst.copy_(pinned, non_blocking=True) for _ in range(4)])
        h2d = 4 * pinned.numel() / (ms / 1e3) / 1e9
        del pinned, dst
        log(f"pinned host -> device copy: {h2d:.1f} GB/s (the PCIe ceiling)")
    info["h2d_gbs"] = h2d

    log(f"table {n} x {dim} {args.dtype} ({args.init} init), {n * row_bytes / 2**30:.3f} GiB raw")
    w = make_table(n, dim, dtype, args.init, seed=0).contiguous()
    t0 = time.time()
    table = ibp_embed.compress(w, progress=False)
    log(f"compressed in {time.time() - t0:.1f}s: {table}")
    starts = table._row_starts().astype(np.int64)
    ibp_gran = granule_bytes(starts[:-1], np.diff(starts))
    raw_starts = np.arange(n, dtype=np.int64) * row_bytes
    raw_gran = granule_bytes(raw_starts, np.full(n, row_bytes, np.int64))
    raw_rows = np.full(n, row_bytes, np.int64)

    # ---- placements ----
    lib = cuda.load_library()
    cleanup = []
    if emulate:
        ibp_host = ibp_dev = None
        w_dev = w
        w_zero = w  # the raw rows the zero-copy methods read: here, host memory
        raw_ptr = None
        ibp_meta_hbm = 0
        raw_status = None
    else:
        ibp_host = cuda.CudaTable(table, dev, placement="host")
        ibp_dev = cuda.CudaTable(table, dev, placement="device")
        cleanup += [ibp_host.close, ibp_dev.close]
        ibp_meta_hbm = ibp_host.info()["device_bytes"]
        log(f"ibp host placement: {ibp_host.info()}")
        w_dev = w.to(dev)
        dptr = cuda.ffi.new("void **")
        cuda.check(lib.ibp_cuda_host_register(cuda.ffi.cast("void *", w.data_ptr()),
                                              w.numel() * w.element_size(), dptr),
                   "pinning the raw table", lib)
        cleanup.append(lambda: lib.ibp_cuda_host_unregister(cuda.ffi.cast("void *", w.data_ptr())))
        raw_ptr = int(cuda.ffi.cast("uintptr_t", dptr[0]))
        try:
            w_zero = tensor_from_pointer(raw_ptr, (n, dim), dtype, dev.index, owner=w)
        except Exception as e:  # noqa: BLE001
            log(f"no zero-copy torch tensor ({type(e).__name__}: {e}): torch zero-copy methods skipped")
            w_zero = None
        raw_status = torch.zeros(1, dtype=torch.int32, device=dev)
    info.update(ratio=table.ratio, ibp_nbytes=table.nbytes, raw_nbytes=n * row_bytes,
                ibp_metadata_hbm_bytes=ibp_meta_hbm, word_bits=table.word_bits, clusters=table.clusters)

    def raw_errors():
        if raw_status is not None:
            clock.sync()
            st = int(raw_status.item())
            raw_status.zero_()
            if st:
                raise RuntimeError(f"raw kernel error flags {st:#x}")

    half_eps = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]

    def methods(tag: str) -> list[Method]:
        """The methods of one workload (fresh caches for each)."""
        raw_read = lambda b: int(b.idx.size) * row_bytes  # noqa: E731 - torch kernels: one raw row an id
        ms: list[Method] = []
        if emulate:
            ms.append(Method("ibp host dedup (emulated)", lambda b: cuda.emulate_lookup(table, b.idx, b.off),
                             True, lambda b: int(ibp_gran[b.distinct].sum()), None, dedup=True))
            ms.append(Method("ibp host fused (emulated)",
                             lambda b: cuda.emulate_lookup(table, b.idx, b.off, dedup=False),
                             True, lambda b: int(ibp_gran[b.idx].sum())))
            ms.append(Method("raw zero-copy kernel (emulated)", lambda b: emulate_raw_lookup(w, b.idx, b.off),
                             True, lambda b: int(raw_gran[b.idx].sum()), 1.0))
            ms.append(Method("torch embedding_bag (CPU)",
                             lambda b: F.embedding_bag(b.idx_t, w_dev, b.off_t, mode="sum",
                                                       include_last_offset=True).float(), False, out_eps=half_eps))
        else:
            ms.append(Method("ibp host dedup", lambda b: ibp_host.lookup(b.idx_t, b.off_t, check=False),
                             True, lambda b: int(ibp_gran[b.distinct].sum()), None, dedup=True,
                             check_errors=ibp_host.check))
            ms.append(Method("ibp host fused", lambda b: ibp_host.lookup(b.idx_t, b.off_t, dedup=False,
                                                                          check=False),
                             True, lambda b: int(ibp_gran[b.idx].sum()), check_errors=ibp_host.check))
            ms.append(Method("ibp device dedup (HBM)", lambda b: ibp_dev.lookup(b.idx_t, b.off_t, check=False),
                             True, lambda b: 0, dedup=True, check_errors=ibp_dev.check))
            ms.append(Method("raw zero-copy kernel (UVM stand-in)",
                             lambda b: raw_lookup(raw_ptr, n, dtype, dim, b.idx_t, b.off_t, status=raw_status,
                                                  check=False),
                             True, lambda b: int(raw_gran[b.idx].sum()), 1.0, check_errors=raw_errors))
            ms.append(Method("raw kernel HBM",
                             lambda b: raw_lookup(w_dev.data_ptr(), n, dtype, dim, b.idx_t, b.off_t,
                                                  status=raw_status, check=False),
                             True, lambda b: 0, check_errors=raw_errors))
            ms.append(Method("torch DEVICE (HBM)",
                             lambda b: F.embedding_bag(b.idx_t, w_dev, b.off_t, mode="sum",
                                                       include_last_offset=True).float(), False, lambda b: 0,
                             out_eps=half_eps))
            if w_zero is not None:
                ms.append(Method("torch zero-copy",
                                 lambda b: F.embedding_bag(b.idx_t, w_zero, b.off_t, mode="sum",
                                                           include_last_offset=True).float(),
                                 False, raw_read, 1.0, out_eps=half_eps))
            if not args.skip_host_gather:
                staging = {}

                def host_gather(b):
                    k = b.idx.size
                    if staging.get("n", 0) < k:
                        staging["buf"] = torch.empty((k, dim), dtype=dtype).pin_memory()
                        staging["n"] = k
                    buf = staging["buf"][:k]
                    torch.index_select(w, 0, torch.from_numpy(b.idx), out=buf)
                    rows = buf.to(dev, non_blocking=True)
                    return F.embedding_bag(torch.arange(k, device=dev), rows, b.off_t, mode="sum",
                                           include_last_offset=True).float()
                ms.append(Method("torch host gather + H2D", host_gather, False, raw_read, 1.0,
                                 note="CPU index_select", out_eps=half_eps))
        # Caches at equal HBM: the raw one also gets the HBM the IBP metadata takes.
        cap = int(args.cache_load_factor * n)
        extra = ibp_meta_hbm // row_bytes
        ibp_src = CountingSource(table if emulate else ibp_host, ibp_gran, dev, ibp_meta_hbm)
        c_ibp = RowCache(ibp_src, capacity=cap, policy="lru", device=dev)
        ms.append(Method(f"cache {args.cache_load_factor:g} over ibp host", lambda b: c_ibp.lookup(b.idx_t, b.off_t),
                         False, None, None, dedup=True, cache=c_ibp,
                         check_errors=None if emulate else ibp_host.check))
        raw_src_rows = w if emulate else w_zero
        if raw_src_rows is not None:
            raw_src = CountingSource(RawSource(raw_src_rows), raw_rows, dev)
            c_raw = RowCache(raw_src, capacity=min(n, cap + extra), policy="lru", device=dev)
            ms.append(Method(f"cache {args.cache_load_factor:g} over raw zero-copy",
                             lambda b: c_raw.lookup(b.idx_t, b.off_t), False, None, 1.0, dedup=True,
                             cache=c_raw, note=f"MANAGED_CACHING stand-in, {extra} more rows"))
        ms += fbgemm_methods(args, w, dev, n, dim, dtype, raw_read) if not emulate else []
        return ms

    results: list[Result] = []

    # ---- gather workload: decode throughput (bit-exact against libibp's gather) ----
    g_idx = np.random.default_rng(3).integers(0, n, args.gather_rows)
    g_ref = table.gather(g_idx).to(dev)
    g_idx_t = torch.from_numpy(g_idx).to(dev)
    gathers = [("ibp host gather (emulated)", lambda: cuda.emulate_gather(table, g_idx), ibp_gran[g_idx].sum())] \
        if emulate else [
        ("ibp device gather (HBM)", lambda: ibp_dev.gather(g_idx_t, check=False), 0),
        ("ibp host gather", lambda: ibp_host.gather(g_idx_t, check=False), ibp_gran[g_idx].sum()),
        ("torch DEVICE index_select", lambda: w_dev.index_select(0, g_idx_t), 0)]
    if not emulate and w_zero is not None:
        gathers.append(("torch zero-copy index_select", lambda: w_zero.index_select(0, g_idx_t),
                        args.gather_rows * row_bytes))
    for name, fn, pcie in gathers:
        r = Result("gather", name, pcie_bytes=float(pcie), distinct=np.unique(g_idx).size / g_idx.size)
        try:
            fn()
            clock.sync()
            times = [clock.time(fn) for _ in range(args.repeats)]
            r.ms, r.ms_min = statistics.median(times), min(times)
            got = fn()
            if not emulate and name.startswith("ibp"):
                (ibp_dev if "device" in name else ibp_host).check()
            r.ok = torch.equal(got.contiguous().view(torch.uint8), g_ref.contiguous().view(torch.uint8))
            r.check = "exact" if r.ok else "FAIL: not bit-exact"
        except Exception as e:  # noqa: BLE001
            r.ok, r.check = False, f"FAIL: {type(e).__name__}: {str(e)[:160]}"
            log(f"{name} failed: {type(e).__name__}: {e}")
        r.eff_gbs = args.gather_rows * row_bytes / (r.ms / 1e3) / 1e9 if r.ms == r.ms else float("nan")
        if name.startswith("ibp") and pcie:
            r.ratio = args.gather_rows * row_bytes / float(pcie)
        results.append(r)
        log(f"gather   {name:40s} {r.ms:9.3f} ms  {r.eff_gbs:7.1f} GB/s  {r.check}")
    del g_ref

    # ---- pooled lookups ----
    for di, dist in enumerate(args.dists):
        timed = make_batches(dist, n, args.bags, args.pooling, args.timed_batches, args.alpha, 100 + di)
        warm = make_batches(dist, n, args.bags, args.pooling, args.warm_batches, args.alpha, 200 + di)
        w_abs = w_dev.abs()
        for b in timed + warm:
            b.idx_t, b.off_t = torch.from_numpy(b.idx).to(dev), torch.from_numpy(b.off).to(dev)
        for b in timed:
            b.ref = table.lookup(b.idx, b.off).to(dev)
            b.bound = F.embedding_bag(b.idx_t, w_abs, b.off_t, mode="sum", include_last_offset=True).float()
        del w_abs
        n_ids = statistics.mean(b.idx.size for b in timed)
        distinct = statistics.mean(b.distinct.size / b.idx.size for b in timed)
        ibp_ratio = statistics.mean(float(b.distinct.size * row_bytes / ibp_gran[b.distinct].sum()) for b in timed)
        log(f"{dist}: {args.bags} bags, {n_ids:.0f} ids a batch, {distinct:.1%} distinct")
        for m in methods(dist):
            if m.ratio is None and m.name.startswith(("ibp", "cache")) and "raw" not in m.name:
                m.ratio = ibp_ratio
            r = run_method(m, timed, warm, clock, args.repeats, dist, row_bytes, distinct)
            results.append(r)
            hit = f"hit {r.hit_rate:.2f}" if r.hit_rate is not None else ""
            log(f"{dist:8s} {m.name:40s} {r.ms:9.3f} ms  {r.eff_gbs:7.1f} GB/s  {hit} {r.check}")
        del timed, warm

    for f in cleanup:
        try:
            f()
        except Exception as e:  # noqa: BLE001
            log(f"cleanup: {type(e).__name__}: {e}")

    # ---- report ----
    base = {r.workload: r.ms for r in results if r.method.startswith("raw zero-copy kernel")}
    headers = ["workload", "method", "dedup", "ms/batch", "PCIe MB/batch", "ratio", "distinct",
               "hit rate", "eff GB/s", "vs raw zero-copy", "check"]
    rows = []
    for r in results:
        speed = base.get(r.workload, float("nan")) / r.ms if r.ms == r.ms and r.ms else float("nan")
        rows.append([r.workload, r.method + (f" ({r.note})" if r.note else ""), "yes" if r.dedup else "no",
                     common.fmt(r.ms, 3), common.fmt(None if r.pcie_bytes is None else r.pcie_bytes / 1e6, 2),
                     common.fmt(r.ratio, 3), common.fmt(r.distinct, 3), common.fmt(r.hit_rate, 3),
                     common.fmt(r.eff_gbs, 1), common.fmt(speed, 2) + ("x" if speed == speed else ""), r.check])
    where = "EMULATION on the CPU (times are CPU times, not GPU times)" if emulate else info.get("device", "?")
    head = [f"GPU lookup benchmark, {time.strftime('%Y-%m-%d')}, {where}, torch {torch.__version__}",
            f"table {n} x {dim} {args.dtype} ({args.init} init), IBP ratio {table.ratio:.3f} "
            f"(W={table.word_bits}, K={table.clusters}); {args.bags} bags x ~{args.pooling} ids; Zipf alpha "
            f"{args.alpha}; pinned H2D copy {common.fmt(h2d, 1)} GB/s; {args.timed_batches} timed batches, "
            f"caches warmed on {args.warm_batches} others",
            "PCIe MB/batch: modeled bytes read from host memory; ratio: raw bytes / bytes read of the rows "
            "read; distinct: distinct ids / ids; eff GB/s: raw bytes of all looked-up rows / time",
            ""]
    text = "\n".join(head) + common.markdown_table(headers, rows, "lllrrrrrrrl") + "\n"
    failed = [r for r in results if not r.ok]
    if not args.no_json:
        path = common.write_json({
            "benchmark": "gpu_lookup", "args": vars(args), "info": info,
            "machine": common.machine_info(),
            "results": [vars(r) for r in results], "failed": [r.method for r in failed]},
            "gpu_lookup_emulate" if emulate else "gpu_lookup",
            results_dir=Path(args.results_dir) if args.results_dir else common.RESULTS_DIR)
        log(f"wrote {path}")
    if args.table_out:
        Path(args.table_out).write_text(text)
    if failed:
        log(f"{len(failed)} result(s) failed their check: {', '.join(r.workload + '/' + r.method for r in failed)}")
    print()
    print(text, end="")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
