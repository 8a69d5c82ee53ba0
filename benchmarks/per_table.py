"""Where ibp's pooled lookup stands against FBGEMM's TBE, table by table.

    python -m benchmarks.per_table                         # fp32 d128, Zipf and uniform
    python -m benchmarks.per_table --dtype float16 --dim 384 --dist zipf
    python -m benchmarks.per_table --scale 0.03 --min-rows 10000   # make bench's large tables

`benchmarks.lookup` times whole table sets (26 tables in one call); its ratio mixes
tables of a hundred rows with tables of a hundred thousand. Here each table size of
a set (by default the quick set: Criteo Kaggle cardinalities x 0.01, the distinct sizes
from 105 rows up; `--scale` and `--min-rows` pick another, as benchmarks.lookup scales
its sets) is looked up alone: one B x P batch (default B4096 x P20, as the lookup benchmark's
center) into one table, ibp's `lookup_many` (the native call the IBP collection runs)
against FBGEMM's TBE (HOST) with the same weights, 1 thread, calls interleaved
(common.time_interleaved). `--init trained` takes synthetic trained-like rows instead of
TorchRec's init, their popularity that of the Zipf ids: the model of benchmarks.lookup's
trained-like sets, with per_table's own seeds. Outputs are checked against the TBE's first (float32: bit for bit,
as both sum a bag's rows in order; half precision: to 1e-3, FBGEMM widens differently). Results: a markdown table (median ms and the ratio FBGEMM / ibp,
above 1 where ibp is faster) and benchmarks/results/per_table-<UTC time>.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

import ibp_embed
from ibp_embed import datasets

from . import common
from .lookup.systems import build_tbe
from .lookup.tables import criteo_rows

DTYPES = {"float32": torch.float32, "float16": torch.float16}
ALPHA = 1.05  # the Zipf ids' skew, and the trained-like rows' popularity (--init trained)
PERM_SEED = 0  # the popularity order both follow: the rows most moved are the ids drawn most


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--init", choices=("torchrec", "trained"), default="torchrec",
                   help="TorchRec's init, or synthetic trained-like rows whose popularity follows the Zipf "
                        "ids' (benchmarks.lookup's trained-like sets)")
    p.add_argument("--dist", default="zipf,uniform", help="comma-separated, of zipf, uniform")
    p.add_argument("--rows", help="comma-separated table sizes (default: the set's, see --scale)")
    p.add_argument("--scale", type=float, help="the sizes of the set at this Criteo Kaggle cardinality scale "
                   "(default 0.01, the quick set; make bench's is 0.03)")
    p.add_argument("--min-rows", type=int, help="of the set's sizes, those of at least this many rows "
                   "(default 100)")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--repeats", type=int, default=9, help="timed rounds (default 9)")
    p.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    args = p.parse_args(argv)
    args.dists = args.dist.split(",")
    if any(d not in ("zipf", "uniform") for d in args.dists):
        p.error(f"--dist takes zipf and uniform, not {args.dist!r}")
    if args.rows and (args.scale is not None or args.min_rows is not None):
        p.error("--rows chooses the tables itself: not with --scale or --min-rows")
    args.min_rows = 100 if args.min_rows is None else args.min_rows
    if args.scale is not None and not 0 < args.scale <= 1:
        p.error(f"--scale must be in (0, 1], not {args.scale}")
    args.sizes = (common.int_list(p, args.rows, "--rows") if args.rows else
                  sorted({n for n in criteo_rows(args.scale or 0.01) if n >= args.min_rows}))
    for name in ("dim", "batch", "pooling", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    if not args.sizes:
        p.error(f"no table of the set has {args.min_rows} rows or more")
    if min(args.sizes) < 1:
        p.error("--rows: every table needs a row")
    return args


def time_table(n_rows: int, dist: str, args) -> dict:
    dtype = DTYPES[args.dtype]
    if args.init == "trained":
        weights = datasets.make_trained_like_table(n_rows, args.dim, dtype, alpha=ALPHA, seed=n_rows,
                                                   perm_seed=PERM_SEED)
    else:
        weights = datasets.make_table(n_rows, args.dim, dtype, init="torchrec", seed=n_rows)
    table = ibp_embed.compress(weights, progress=False)
    tbe = build_tbe([n_rows], [args.dim], dtype)
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(weights)
    n_ids = args.batch * args.pooling
    ids = (datasets.zipf_ids(n_ids, n_rows, ALPHA, seed=1, perm_seed=PERM_SEED) if dist == "zipf" else
           datasets.uniform_ids(n_ids, n_rows, seed=1))
    offsets = torch.arange(0, n_ids + 1, args.pooling, dtype=torch.int64)
    ids_np, offsets_np = ids.numpy(), offsets.numpy()

    def ibp():
        return ibp_embed.lookup_many([table], [ids_np], [offsets_np])

    want, got = tbe(ids, offsets), ibp()
    same = torch.equal(want, got) if dtype == torch.float32 else torch.allclose(want, got, rtol=1e-3, atol=1e-3)
    if not same:
        raise SystemExit(f"per_table: ibp's pooled sums differ from FBGEMM's ({n_rows} rows, {dist})")
    t = common.time_interleaved({"fbgemm": lambda: tbe(ids, offsets), "ibp": ibp}, repeats=args.repeats)
    return {"rows": n_rows, "dist": dist, "ratio": table.ratio, "word_bits": table.word_bits,
            "distinct": float(np.unique(ids_np).size / n_ids),
            "fbgemm_ms": t["fbgemm"]["median_s"] * 1e3, "ibp_ms": t["ibp"]["median_s"] * 1e3,
            "speed": t["fbgemm"]["median_s"] / t["ibp"]["median_s"], "fbgemm_collapse_refused": tbe.collapse_refused}


def main(argv=None) -> dict:
    args = parse(argv)
    common.steady_allocations()
    with common.threads(1):
        runs = []
        for dist in args.dists:
            for n in args.sizes:
                print(f"[per_table] {args.init} {args.dtype} d{args.dim} {dist} {n} rows", file=sys.stderr,
                      flush=True)
                runs.append(time_table(n, dist, args))
    print(f"{args.init} init, {args.dtype} d{args.dim}, B{args.batch} x P{args.pooling}, one table a call, 1 thread, "
          f"median of {args.repeats} interleaved rounds; load average {common.load_average()}\n")
    print(common.markdown_table(
        ["ids", "rows", "distinct ids", "ibp ratio", "FBGEMM TBE ms", "ibp lookup_many ms", "FBGEMM / ibp"],
        [[r["dist"], r["rows"], f"{r['distinct']:.2f}", f"{r['ratio']:.3f}", common.fmt(r["fbgemm_ms"]),
          common.fmt(r["ibp_ms"]), f"{r['speed']:.2f}x"] for r in runs]))
    return common.save_runs("per_table", {k: v for k, v in vars(args).items() if k != "dists"}, runs,
                            args.results_dir)


if __name__ == "__main__":
    main()
