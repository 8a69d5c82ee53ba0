"""Inference-sized batches: the IBP collection against TorchRec's fused EBC, module to module.

    python -m benchmarks.serving                       # fp32 d64, B1 to B1024
    python -m benchmarks.serving --dtype float16 --dim 128 --batches 1,16

`benchmarks.lookup` times batches of 4096 bags, where a call's native work dominates.
A model served on the CPU looks up far smaller batches, where what a call costs
around its rows shows: Python, building the native jobs, decode plans, the first
rows of each table. Here the 26 Criteo Kaggle tables (cardinalities x --scale, the
quick set's 0.01 by default) are looked up by an IBPEmbeddingBagCollection and by
TorchRec's FusedEmbeddingBagCollection (FBGEMM's TBE, HOST) with the same weights,
forward only under no_grad, one KeyedJaggedTensor of B bags of P Zipf(1.05) ids a
feature, 1 thread (--threads), calls interleaved (common.time_interleaved, --calls
calls a round). Outputs are checked against the fused EBC's (float32: bit for bit;
float16: to 1e-3). Results: a markdown table (median us a call and the ratio fused / IBP, above
1 where the IBP collection is faster) and benchmarks/results/serving-<UTC time>.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import ibp_embed
from ibp_embed import datasets

from . import common
from .lookup.systems import build_tbe, ibp_ebc, torchrec_fused_ebc
from .lookup.tables import criteo_rows
from .lookup.workloads import Workload, make_batch

DTYPES = {"float32": torch.float32, "float16": torch.float16}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--scale", type=float, default=0.01, help="Criteo Kaggle cardinality scale (default 0.01)")
    p.add_argument("--batches", default="1,16,128,1024", help="comma-separated batch sizes (bags a feature)")
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--calls", type=int, default=20, help="calls a timed round (default 20)")
    p.add_argument("--repeats", type=int, default=9, help="timed rounds (default 9)")
    p.add_argument("--threads", type=int, default=1, help="torch and libibp threads (default 1)")
    p.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    args = p.parse_args(argv)
    try:
        args.sizes = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error(f"--batches takes comma-separated integers, not {args.batches!r}")
    for name in ("dim", "pooling", "calls", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    if min(args.sizes) < 1 or not 0 < args.scale <= 1:
        p.error("--batches must be positive and --scale in (0, 1]")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    common.steady_allocations()
    dtype, rows = DTYPES[args.dtype], criteo_rows(args.scale)
    print(f"[serving] compressing {len(rows)} tables ({sum(rows)} rows, {args.dtype} d{args.dim})",
          file=sys.stderr, flush=True)
    weights = [datasets.make_table(n, args.dim, dtype, init="torchrec", seed=n) for n in rows]
    tables = [ibp_embed.compress(w, progress=False) for w in weights]
    tbe = build_tbe(rows, [args.dim] * len(rows), dtype)
    with torch.no_grad():
        for dst, w in zip(tbe.split_embedding_weights(), weights):
            dst.copy_(w)
    fused, ibp = torchrec_fused_ebc(tbe, [args.dim] * len(rows)), ibp_ebc(tables, [args.dim] * len(rows), dtype)
    runs = []
    with torch.no_grad(), common.threads(args.threads):
        for b in args.sizes:
            print(f"[serving] B{b} x P{args.pooling}", file=sys.stderr, flush=True)
            kjt = make_batch(rows, Workload(b, args.pooling, 1.05), args.pooling + b, [None] * len(rows)).kjt
            want, got = fused(kjt).values(), ibp(kjt).values()
            same = torch.equal(want, got) if dtype == torch.float32 else \
                torch.allclose(want, got, rtol=1e-3, atol=1e-3)
            if not same:
                raise SystemExit(f"serving: the IBP collection's output differs from the fused EBC's (B{b})")
            t = common.time_interleaved({"fused": lambda: [fused(kjt) for _ in range(args.calls)],
                                         "ibp": lambda: [ibp(kjt) for _ in range(args.calls)]},
                                        repeats=args.repeats)
            us = {k: t[k]["median_s"] / args.calls * 1e6 for k in ("fused", "ibp")}
            runs.append({"batch": b, "fused_us": us["fused"], "ibp_us": us["ibp"], "speed": us["fused"] / us["ibp"]})
    print(f"{len(rows)} Criteo tables x {args.scale:g}, {args.dtype} d{args.dim}, P{args.pooling} Zipf 1.05, "
          f"forward under no_grad, {args.threads} thread(s), median of {args.repeats} interleaved rounds of "
          f"{args.calls} calls; "
          f"load average {common.load_average()}\n")
    print(common.markdown_table(["batch", "TorchRec fused EBC us", "IBP collection us", "fused / IBP"],
                                [[r["batch"], common.fmt(r["fused_us"], 1), common.fmt(r["ibp_us"], 1),
                                  f"{r['speed']:.2f}x"] for r in runs]))
    return common.save_runs("serving", {k: v for k, v in vars(args).items() if k != "sizes"}, runs,
                            args.results_dir)


if __name__ == "__main__":
    main()
