"""Inference-sized batches: the IBP collection against TorchRec's EBCs, module to module.

    python -m benchmarks.serving                       # fp32 d64, B1 to B1024
    python -m benchmarks.serving --dtype float16 --dim 128 --batches 1,16

`benchmarks.lookup` times batches of 4096 bags, where a call's native work dominates.
A model served on the CPU looks up far smaller batches, where what a call costs
around its rows shows: Python, building the native jobs, decode plans, the first
rows of each table. Here the 26 Criteo Kaggle tables (cardinalities x --scale, the
quick set's 0.01 by default) are looked up by an IBPEmbeddingBagCollection and by
TorchRec's FusedEmbeddingBagCollection (FBGEMM's TBE, HOST) with the same weights,
forward only under no_grad, one KeyedJaggedTensor of B bags of P Zipf(1.05) ids a
feature (or --stream distinct ones, looked up in turn, as a server sees them), 1
thread (--threads), each IBP call interleaved with its FBGEMM counterpart
(common.time_interleaved, --calls calls a round; in pairs, so that each runs after
the other, whose tables take the caches). One level down, the same batches through
FBGEMM's TBE forward (the fused EBC's kernel, ids and offsets as the KJT holds
them) and through ibp_embed.lookup_many, given the same two tensors (the TBE
layout) and given one tensor of ids and one of offsets a table (lists). Against
TorchRec's inference EBC (torchrec.quant's, FP32 / FP16 rows, FBGEMM's inference TBE,
the module TorchRec serves with): the IBP collection eagerly, and both as a model is
served, each traced with torchrec.fx and scripted. Outputs
are checked against the fused EBC's, the TBE's and the quant EBC's (float32: bit for
bit; float16: to 1e-3). Results: three markdown tables (median us a call and the
ratio of FBGEMM's time to IBP's, above 1 where IBP is faster) and
benchmarks/results/serving-<UTC time>.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

import ibp_embed
from ibp_embed import datasets

from . import common
from .lookup.systems import build_tbe, captured, ibp_ebc, torchrec_fused_ebc, torchrec_quant_ebc
from .lookup.tables import criteo_rows
from .lookup.workloads import Workload, make_batch

DTYPES = {"float32": torch.float32, "float16": torch.float16}
# each IBP call and its FBGEMM counterpart
PAIRS = (("ibp", "fused"), ("many", "tbe"), ("many_lists", "tbe"), ("ibp_q", "quant"),
         ("ibp_captured", "quant_captured"))


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
    p.add_argument("--stream", type=int, default=1,
                   help="distinct batches a size, looked up in turn (default 1: the same batch every call)")
    p.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    args = p.parse_args(argv)
    args.sizes = common.int_list(p, args.batches, "--batches")
    for name in ("dim", "pooling", "calls", "repeats", "threads", "stream"):
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
    quant = torchrec_quant_ebc(weights, dtype)
    ibp_captured, quant_captured = captured(ibp), captured(quant)
    runs = []
    with torch.no_grad(), common.threads(args.threads):
        for b in args.sizes:
            print(f"[serving] B{b} x P{args.pooling}", file=sys.stderr, flush=True)
            stream = [serving_batch(rows, b, args.pooling, args.pooling + b + 7919 * s) for s in range(args.stream)]
            calls = {"fused": lambda x: fused(x.kjt).values(), "ibp": lambda x: ibp(x.kjt).values(),
                     "tbe": lambda x: tbe(x.ids, x.offsets),
                     "many": lambda x: ibp_embed.lookup_many(tables, x.ids, x.offsets),
                     "many_lists": lambda x: ibp_embed.lookup_many(tables, x.ids_of, x.offsets_of),
                     "quant": lambda x: quant(x.kjt).values(), "ibp_q": lambda x: ibp(x.kjt).values(),
                     "ibp_captured": lambda x: ibp_captured(x.kjt).values(),
                     "quant_captured": lambda x: quant_captured(x.kjt).values()}
            for x in stream:
                check(calls, x, dtype, b)
            # in pairs: each call after the other's, whose tables evict its own from the caches
            us = {}
            for mine, theirs in PAIRS:
                t = common.time_interleaved({k: lambda f=calls[k]: [f(stream[i % len(stream)])
                                                                    for i in range(args.calls)]
                                             for k in (theirs, mine)}, repeats=args.repeats)
                us[mine], us[f"{theirs} with {mine}"] = (t[k]["median_s"] / args.calls * 1e6 for k in (mine, theirs))
            runs.append({"batch": b, "fused_us": us["fused with ibp"], "ibp_us": us["ibp"],
                         "speed": us["fused with ibp"] / us["ibp"], "tbe_us": us["tbe with many"], "many_us": us["many"],
                         "many_speed": us["tbe with many"] / us["many"], "tbe_lists_us": us["tbe with many_lists"],
                         "many_lists_us": us["many_lists"],
                         "many_lists_speed": us["tbe with many_lists"] / us["many_lists"],
                         "quant_us": us["quant with ibp_q"], "ibp_with_quant_us": us["ibp_q"],
                         "quant_speed": us["quant with ibp_q"] / us["ibp_q"],
                         "quant_captured_us": us["quant_captured with ibp_captured"],
                         "ibp_captured_us": us["ibp_captured"],
                         "captured_speed": us["quant_captured with ibp_captured"] / us["ibp_captured"]})
    print(f"{len(rows)} Criteo tables x {args.scale:g}, {args.dtype} d{args.dim}, P{args.pooling} Zipf 1.05, "
          f"{args.stream} distinct batch(es) a size, forward under no_grad, {args.threads} thread(s), median of "
          f"{args.repeats} interleaved rounds of {args.calls} calls; "
          f"load average {common.load_average()}\n")
    print(common.markdown_table(["batch", "TorchRec fused EBC us", "IBP collection us", "fused / IBP"],
                                [[r["batch"], common.fmt(r["fused_us"], 1), common.fmt(r["ibp_us"], 1),
                                  f"{r['speed']:.2f}x"] for r in runs]))
    print()
    print(common.markdown_table(["batch", "FBGEMM TBE us", "lookup_many us (TBE layout)", "TBE / IBP",
                                 "FBGEMM TBE us", "lookup_many us (lists)", "TBE / IBP"],
                                [[r["batch"], common.fmt(r["tbe_us"], 1), common.fmt(r["many_us"], 1),
                                  f"{r['many_speed']:.2f}x", common.fmt(r["tbe_lists_us"], 1),
                                  common.fmt(r["many_lists_us"], 1), f"{r['many_lists_speed']:.2f}x"] for r in runs]))
    print()
    print(common.markdown_table(["batch", "TorchRec quant EBC us", "IBP collection us", "quant / IBP",
                                 "quant EBC us (traced + scripted)", "IBP collection us (traced + scripted)",
                                 "quant / IBP"],
                                [[r["batch"], common.fmt(r["quant_us"], 1), common.fmt(r["ibp_with_quant_us"], 1),
                                  f"{r['quant_speed']:.2f}x", common.fmt(r["quant_captured_us"], 1),
                                  common.fmt(r["ibp_captured_us"], 1), f"{r['captured_speed']:.2f}x"] for r in runs]))
    return common.save_runs("serving", {k: v for k, v in vars(args).items() if k != "sizes"}, runs,
                            args.results_dir, fbgemm_collapse_refused=tbe.collapse_refused)


def serving_batch(rows: list, b: int, pooling: int, seed: int) -> SimpleNamespace:
    """A batch of b bags a table as each call takes it: the KJT, its ids and offsets (the
    TBE layout), and each table's ids and offsets from 0 (lists)."""
    kjt = make_batch(rows, Workload(b, pooling, 1.05), seed, [None] * len(rows)).kjt
    ids, offsets = kjt.values(), kjt.offsets()
    return SimpleNamespace(kjt=kjt, ids=ids, offsets=offsets,
                           ids_of=[ids[offsets[k * b]:offsets[(k + 1) * b]] for k in range(len(rows))],
                           offsets_of=[offsets[k * b:(k + 1) * b + 1] - offsets[k * b] for k in range(len(rows))])


def check(calls: dict, batch: SimpleNamespace, dtype: torch.dtype, b: int) -> None:
    """Each IBP call's output against FBGEMM's (the fused EBC's, the TBE's, the quant EBC's)."""
    for mine, theirs in PAIRS:
        want, got = calls[theirs](batch), calls[mine](batch)
        same = torch.equal(want, got) if dtype == torch.float32 else \
            torch.allclose(want, got, rtol=1e-3, atol=1e-3)
        if not same:
            names = {"ibp": "the IBP collection", "fused": "the fused EBC", "many": "lookup_many (TBE layout)",
                     "many_lists": "lookup_many (lists)", "tbe": "the TBE",
                     "ibp_q": "the IBP collection", "quant": "the quant EBC",
                     "ibp_captured": "the captured IBP collection", "quant_captured": "the captured quant EBC"}
            raise SystemExit(f"serving: {names[mine]}'s output differs from {names[theirs]}'s (B{b})")


if __name__ == "__main__":
    main()
