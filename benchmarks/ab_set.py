"""A/B of two builds of libibp on a table set's batched lookups, FBGEMM's TBE in the same rounds.

    python -m benchmarks.ab_set HEAD~1                 # HEAD~1 (A) against the working tree (B)
    python -m benchmarks.ab_set a/libibp.so b/libibp.so --dist uniform --min-rows 10000

benchmarks.ab times one table, each build's call right after the other's: the rows one
build read are still in L3 for the next, a regime a model's lookup (other tables, other
layers in between) seldom sees. This harness times what benchmarks.lookup reports:
`ibp_embed.lookup_many` over a Criteo-like table set (benchmarks.lookup's tables,
--scale 0.01: the quick set) in one call, 1 thread, with FBGEMM's TBE (HOST) timed in
the same rounds, so each build runs after the other build or after FBGEMM, never
after itself: the rounds take the six orders of the three in a cycle whose every
round starts with another system than the last one ended with (without FBGEMM, for
bf16, half the calls follow their own build's). A round's three times give its
ratios: B's time over A's, and each build's speed relative to FBGEMM's; the medians
and quartiles over the rounds are printed, and the ratio of the builds' fastest calls.

Builds are given as to benchmarks.ab (a git revision, `.`, or a built libibp.so) and
must share the package's ABI. Both run on the tables the package compressed; each
call is routed to its build by swapping the library that ibp_embed's batched lookups
call (packed_jobs.lib) for the call. Tables pooled from a decoded copy (up to 1 MB
raw, named fewer than IBP_FILL_IDS_PER_ROW ids a row by a call: small batches, none at
the default B4096 x P20) have that copy made once, by the package's library, so a
change to decoding would not show there. A table timed alone, each build right after
the other, does not show what a change costs the set: on a Zen 5 EPYC (2026-12-06) a
lower deduplication threshold that benchmarks.ab timed at 0.92-0.94x on its 101k-row
table (fp32 d128, uniform ids; min and median) took 0.93-0.97x the time here by the
medians but 1.02-1.04x by the fastest calls, over the whole quick fp32 d128 set, each
build as A and as B. Results: a markdown table and
benchmarks/results/ab_set-<UTC time>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import ibp_embed
from ibp_embed import packed_jobs

from . import ab, common
from .lookup.systems import set_weights
from .lookup.tables import TableSet, criteo_rows
from .lookup.workloads import Workload, make_batch

# the six orders, each round starting with another system than the one before ended with
ORDERS = (("fbgemm", "A", "B"), ("fbgemm", "B", "A"), ("B", "fbgemm", "A"),
          ("B", "A", "fbgemm"), ("A", "B", "fbgemm"), ("A", "fbgemm", "B"))


@contextlib.contextmanager
def routed_to(lib):
    """ibp_embed's batched lookups call `lib` within the block."""
    before = packed_jobs.lib
    packed_jobs.lib = lib
    try:
        yield
    finally:
        packed_jobs.lib = before


def make_set(args) -> tuple:
    """(the table set, its weights, FBGEMM's TBE over them or None where it has no kernel)."""
    rows = [n for n in criteo_rows(args.scale) if n >= args.min_rows]
    if not rows:
        raise SystemExit(f"no table of the set has {args.min_rows} rows or more (--min-rows)")
    ts = TableSet("ab_set", args.init, ab.DTYPES[args.dtype], [args.dim] * len(rows), rows)
    tbe, weights = set_weights(ts)
    return ts, weights, tbe


def run_rounds(fns: dict, seconds: float, min_rounds: int) -> dict:
    """Each system's times over rounds that go through ORDERS (of the systems in fns) in
    whole cycles, for `seconds` and at least min_rounds rounds, after a round that warms up."""
    times = {k: [] for k in fns}
    order = [[k for k in o if k in fns] for o in ORDERS]
    for k in order[-1]:
        fns[k]()
    end, i = time.perf_counter() + seconds, 0
    while i < min_rounds or time.perf_counter() < end or i % len(order):
        for k in order[i % len(order)]:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
        i += 1
    return times


def summary(times: dict) -> dict:
    t = {k: np.asarray(v) for k, v in times.items()}
    b_over_a = t["B"] / t["A"]
    out = {"rounds": int(b_over_a.size), "b_over_a_median": float(np.median(b_over_a)),
           "b_over_a_q25": float(np.quantile(b_over_a, 0.25)), "b_over_a_q75": float(np.quantile(b_over_a, 0.75)),
           "b_over_a_fastest": float(t["B"].min() / t["A"].min()),
           "median_ms": {k: float(np.median(v) * 1e3) for k, v in t.items()},
           "min_ms": {k: float(v.min() * 1e3) for k, v in t.items()}}
    if "fbgemm" in t:
        for k in ("A", "B"):
            out[f"{k}_speed_vs_fbgemm_median"] = float(np.median(t["fbgemm"] / t[k]))
    return out


def add_set_args(p: argparse.ArgumentParser) -> None:
    """The table set and workload options (make_set, make_batch), shared with benchmarks.headroom."""
    p.add_argument("--dtype", choices=ab.DTYPES, default="float32")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--init", choices=("torchrec", "trained"), default="torchrec")
    p.add_argument("--word-bits", type=int, choices=(16, 32, 64), default=64)
    p.add_argument("--scale", type=float, default=0.01, help="Criteo cardinality scale (default 0.01: the quick set)")
    p.add_argument("--min-rows", type=int, default=1, help="only the set's tables of at least this many rows")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--dist", choices=("zipf", "uniform"), default="zipf")
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)


def check_set_args(p: argparse.ArgumentParser, args, counts: tuple) -> None:
    """p.error for set options (add_set_args) and the options `counts` (at least 1) out of
    range, before any table is made or build compiled."""
    for name in counts:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if not args.scale > 0:
        p.error("--scale must be positive")
    if not args.alpha > 0:  # zipf_ids would say so, but only after the builds and tables are made
        p.error(f"--alpha must be positive, not {args.alpha:g}")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", help="build A: a git revision, '.' (the working tree) or a libibp.so")
    p.add_argument("b", nargs="?", default=".", help="build B (default: the working tree)")
    add_set_args(p)
    p.add_argument("--isa", choices=tuple(ibp_embed._native.KERNEL_SETS),
                   help="the kernels both builds run (default: the best this CPU has)")
    p.add_argument("--seconds", type=float, default=15.0, help="time the rounds this long (default 15)")
    p.add_argument("--min-rounds", type=int, default=6)
    args = p.parse_args(argv)
    check_set_args(p, args, ("dim", "batch", "pooling", "min_rounds"))
    if not args.seconds >= 0:
        p.error("--seconds must not be negative")
    return args


def main(argv=None) -> dict:
    args = parse(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    common.steady_allocations()
    with tempfile.TemporaryDirectory(prefix="ibp-ab-set-") as tmp:
        libs = {name: ab.load(path)
                for name, path in ab.build_all({"A": args.a, "B": args.b}, Path(tmp), "ab_set").items()}
        print("[ab_set] tables and batch", file=sys.stderr, flush=True)
        ts, weights, tbe = make_set(args)
        tables = [ibp_embed.compress(w, word_bits=args.word_bits, progress=False) for w in weights]
        batch = make_batch(ts.rows, Workload(args.batch, args.pooling,
                                             None if args.dist == "uniform" else args.alpha), 0, ts.perm_seeds())
        fns = {}
        for name, lib in libs.items():
            def call(lib=lib):
                with routed_to(lib):
                    return ibp_embed.lookup_many(tables, batch.values, batch.offsets)
            fns[name] = call
        with torch.no_grad(), ab.kernels(libs, args.isa):
            outs = {name: fn() for name, fn in fns.items()}
            if not torch.equal(outs["A"].view(torch.int32), outs["B"].view(torch.int32)):  # bits: -0.0 too
                raise SystemExit("ab_set: the two builds' outputs differ")
            if tbe is not None:
                fns["fbgemm"] = lambda: tbe(batch.values, batch.offsets)
                ref = fns["fbgemm"]()
                if not torch.allclose(outs["A"], ref, rtol=1e-4, atol=1e-4):
                    raise SystemExit("ab_set: the builds' sums differ from FBGEMM's")
            times = run_rounds(fns, args.seconds, args.min_rounds)
    got = summary(times)
    label = (f"{args.dtype} d{args.dim} {args.init}, {len(ts.rows)} tables of {min(ts.rows)}-{max(ts.rows)} rows, "
             f"W {args.word_bits}; B{args.batch} x P{args.pooling} "
             f"{'uniform' if args.dist == 'uniform' else f'Zipf {args.alpha:g}'}; {args.isa or 'best'} kernels; "
             f"1 thread; {got['rounds']} rounds; load average {common.load_average()}")
    print(f"A = {args.a}, B = {args.b}; {label}\n")
    rows = [[k, common.fmt(got["median_ms"][k], 3), common.fmt(got["min_ms"][k], 3),
             common.fmt(got.get(f"{k}_speed_vs_fbgemm_median"), 3) if k != "fbgemm" else "1"]
            for k in fns]
    print(common.markdown_table(["system", "median ms", "min ms", "speed / FBGEMM's (median of rounds)"], rows))
    print(f"\nB / A time, over rounds: median {got['b_over_a_median']:.3f} (quartiles {got['b_over_a_q25']:.3f}-"
          f"{got['b_over_a_q75']:.3f}); fastest calls {got['b_over_a_fastest']:.3f}")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "results_dir"}
    return common.save_runs("ab_set", {**config, "label": label}, [got], args.results_dir)


if __name__ == "__main__":
    main()
