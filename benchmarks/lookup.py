"""Lookup benchmark: IBPEmbeddingBagCollection forward against TorchRec/FBGEMM on the CPU.

    python -m benchmarks.lookup            # 4 tables x 1M rows x 64 fp32 = 1 GiB (32x a 32 MB LLC)
    python -m benchmarks.lookup --quick    # 4 tables x 256k rows (256 MiB), a minute or so

One run, the same tables and the same KeyedJaggedTensors for every contender:

- ``fbgemm TBE (HOST)``: FBGEMM's SplitTableBatchedEmbeddingBagsCodegen, fp32,
  EmbeddingLocation.HOST / ComputeDevice.CPU, all tables in one TBE: the kernel
  TorchRec's ``fused`` compute kernel runs on CPU (called directly, no TorchRec
  overhead: the strongest baseline). forward(indices, offsets) with table-major offsets.
- ``torchrec EBC (unsharded)``: torchrec.EmbeddingBagCollection forward (nn.EmbeddingBag
  per table), its weights viewing the TBE's (no extra memory).
- ``ibp EBC``: ibp_embed.torchrec.IBPEmbeddingBagCollection forward, built with
  from_embedding_bag_collection from the same weights, twice: ``dedup=never`` (the
  default: the native fused decode-and-pool on every id) and ``dedup=auto`` (decode
  each distinct id of a feature's batch once when at most half are distinct, then pool).

Ids are Zipf(alpha) over a fixed random popularity permutation (hot rows scattered,
ibp_embed.datasets.zipf_ids), every bag has --pooling ids, one feature per table.
Each timing is the median over --repeats passes over --batches distinct batches,
after a warm-up pass; it is run at 1 thread and at all threads (torch's intra-op
threads and libibp's OpenMP threads set alike). Outputs are checked against the TBE's
(rtol 1e-5). Memory is the bytes each form needs for the tables: raw fp32 for
FBGEMM / TorchRec, compressed (payload, offsets index, masks) for ibp.

Results: a markdown table on stdout and benchmarks/results/lookup-<UTC time>.json.
"""
from __future__ import annotations

import argparse
import gc
import sys

import torch

from ibp_embed import datasets

from . import common


def build_tbe(n_tables: int, rows: int, dim: int):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * n_tables,
        optimizer=EmbOptimType.EXACT_SGD, pooling_mode=PoolingMode.SUM,
        weights_precision=SparseType.FP32, output_dtype=SparseType.FP32, device=torch.device("cpu"))


def make_batches(n_tables, rows, batch, pooling, alpha, n_batches, seed):
    from torchrec import KeyedJaggedTensor

    out = []
    keys = [f"f{t}" for t in range(n_tables)]
    for b in range(n_batches):
        ids = [datasets.zipf_ids(batch * pooling, rows, alpha, seed=seed + 1000 * b + t, perm_seed=t)
               for t in range(n_tables)]
        values = torch.cat(ids)
        lengths = torch.full((n_tables * batch,), pooling, dtype=torch.int64)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
        out.append((kjt, values, kjt.offsets()))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller tables (256 MiB in all)")
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=None, help="rows per table (default 1M, quick 256k)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--init", choices=("torchrec", "normal", "trained"), default="torchrec",
                   help="table contents (datasets.make_table / make_trained_like_table)")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")
    p.add_argument("--batches", type=int, default=None, help="distinct batches (default 8, quick 4)")
    p.add_argument("--repeats", type=int, default=None, help="timed passes (default 5, quick 3)")
    p.add_argument("--threads", type=int, nargs="*", default=None,
                   help="thread counts to run (default: 1 and all)")
    p.add_argument("--no-json", action="store_true")
    args = p.parse_args(argv)
    rows = args.rows or (262_144 if args.quick else 1_048_576)
    n_batches = args.batches or (4 if args.quick else 8)
    repeats = args.repeats or (3 if args.quick else 5)
    all_threads = torch.get_num_threads()
    thread_counts = args.threads or sorted({1, all_threads})
    T, D = args.tables, args.dim

    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    from ibp_embed.torchrec import IBPEmbeddingBagCollection

    raw_bytes = T * rows * D * 4
    print(f"# lookup benchmark: {T} tables x {rows} rows x {D} fp32 = {raw_bytes / 2**20:.0f} MiB raw; "
          f"batch {args.batch}, pooling {args.pooling}, Zipf alpha {args.alpha}, {n_batches} batches; "
          f"{common.cpu_model()}", file=sys.stderr)

    sw = common.Stopwatch()
    tbe = build_tbe(T, rows, D)
    weights = tbe.split_embedding_weights()
    with torch.no_grad():
        for t, w in enumerate(weights):
            if args.init == "trained":
                w.copy_(datasets.make_trained_like_table(rows, D, torch.float32, alpha=args.alpha, seed=t,
                                                         perm_seed=t))
            else:
                w.copy_(datasets.make_table(rows, D, torch.float32, init=args.init, seed=t))
    configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=D, num_embeddings=rows, feature_names=[f"f{t}"])
               for t in range(T)]
    ebc = EmbeddingBagCollection(configs, device=torch.device("meta"))
    for t, w in enumerate(weights):  # share the TBE's storage
        ebc.embedding_bags[f"t{t}"].weight = torch.nn.Parameter(w, requires_grad=False)
    ebc._device = torch.device("cpu")
    t_build = sw()
    sw = common.Stopwatch()
    ibp = IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc)
    t_compress = sw()
    tbe_bytes = sum(w.numel() * w.element_size() for w in weights)
    ibp_bytes = ibp.compressed_nbytes
    print(f"# tables built in {t_build:.1f} s, compressed in {t_compress:.1f} s "
          f"(ratio {raw_bytes / ibp_bytes:.3f})", file=sys.stderr)

    batches = make_batches(T, rows, args.batch, args.pooling, args.alpha, n_batches, seed=1)
    lookups_per_pass = n_batches * T * args.batch * args.pooling

    # correctness on the first batch
    with torch.no_grad():
        kjt, values, offsets = batches[0]
        ref = tbe(values, offsets)
        got_ebc = ebc(kjt).values()
        for mode in ("never", "auto"):
            ibp.dedup = mode
            torch.testing.assert_close(ibp(kjt).values(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_ebc, ref, rtol=1e-5, atol=1e-6)

    def run_ibp(mode):
        def run():
            ibp.dedup = mode
            return [ibp(k) for k, _, _ in batches]
        return run

    contenders = {
        "fbgemm TBE (HOST)": lambda: [tbe(v, o) for _, v, o in batches],
        "torchrec EBC (unsharded)": lambda: [ebc(k) for k, _, _ in batches],
        "ibp EBC, dedup=never": run_ibp("never"),
        "ibp EBC, dedup=auto": run_ibp("auto"),
    }
    memory = {name: ibp_bytes if name.startswith("ibp") else tbe_bytes for name in contenders}
    results = []
    for n in thread_counts:
        with common.threads(n), torch.no_grad():
            timing = {}
            for name, fn in contenders.items():
                gc.collect()
                timing[name] = common.time_runs(fn, repeats=repeats, warmup=1)
            base = timing["fbgemm TBE (HOST)"]["median_s"]
            for name in contenders:
                s = timing[name]["median_s"]
                results.append({
                    "threads": n, "backend": name, "memory_bytes": memory[name],
                    "memory_ratio": raw_bytes / memory[name], "pass_median_s": s,
                    "batch_ms": 1e3 * s / n_batches, "mlookups_per_s": lookups_per_pass / s / 1e6,
                    "throughput_vs_fbgemm": base / s, "times_s": timing[name]["times_s"],
                })

    headers = ["threads", "backend", "table memory (MiB)", "raw / stored", "ms / batch",
               "M lookups/s", "throughput vs FBGEMM"]
    table = common.markdown_table(headers, [
        [r["threads"], r["backend"], common.fmt(r["memory_bytes"] / 2**20, 1), common.fmt(r["memory_ratio"], 3),
         common.fmt(r["batch_ms"], 2), common.fmt(r["mlookups_per_s"], 2), common.fmt(r["throughput_vs_fbgemm"], 2)]
        for r in results], align="rlrrrrr")
    print(f"\n{T} tables x {rows:,} rows x {D} fp32 ({raw_bytes / 2**20:.0f} MiB raw, init {args.init}), "
          f"batch {args.batch} x {T} features, pooling {args.pooling}, Zipf alpha {args.alpha}; "
          f"median of {repeats} passes over {n_batches} batches\n")
    print(table)
    if not args.no_json:
        path = common.write_json({
            "benchmark": "lookup", "machine": common.machine_info(),
            "config": {"tables": T, "rows": rows, "dim": D, "init": args.init, "batch": args.batch,
                       "pooling": args.pooling, "alpha": args.alpha, "batches": n_batches,
                       "repeats": repeats, "raw_bytes": raw_bytes, "compress_s": t_compress},
            "results": results}, "lookup")
        print(f"\nresults: {path.relative_to(common.ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
