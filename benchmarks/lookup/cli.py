"""Command line: the plan of table sets and workloads, the arguments, and main()."""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from pathlib import Path

from .. import common
from .codec_sizes import zipnn_available
from .names import DTYPES, FBGEMM, HEADLINE, IBP_VARIANTS
from .plot import plot
from .report import check_targets, format_targets, report
from .run import run_table_set
from .tables import TableSet, criteo_rows, trained_table_sets
from .workloads import CENTER, QUICK_SWEEP, SWEEP, UNIFORM, Workload


QUICK_SETS = (("fp32", 128, "torchrec"), ("fp32", 128, "trained"), ("fp32", 64, "torchrec"),
              ("fp16", 64, "torchrec"), ("bf16", 64, "trained"))  # (dtype, dim, init)


def plan(args) -> list[tuple[TableSet, list[Workload]]]:
    rows = criteo_rows(args.scale)
    sets = []
    if args.quick:
        combos = [c for c in QUICK_SETS if c[0] in args.dtypes and c[1] in args.dims and c[2] in args.inits]
    else:  # every combination asked for (the issue's targets span dims 64-384)
        combos = [(dt, d, init) for init in args.inits for dt in args.dtypes for d in args.dims]
    for dt, d, init in combos:
        ts = TableSet(name=f"criteo-{dt}-d{d}-{init}", init=init, dtype=DTYPES[dt], dims=[d] * len(rows), rows=rows)
        works = [CENTER, UNIFORM]
        if dt == "fp32" and d == 128:
            if args.all_threads != args.threads and (init == "torchrec" or not args.quick):
                works.append(dataclasses.replace(CENTER, threads=args.all_threads))
            if not args.no_sweep and (init == "torchrec" or not args.quick):
                works += list(QUICK_SWEEP if args.quick else SWEEP)
        sets.append((ts, works))
    if args.trained_tables:
        for ts in trained_table_sets(args.trained_tables):
            sets.append((ts, [CENTER, UNIFORM]))
    return sets


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.lookup", description=sys.modules[__package__].__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small subset (under 2 minutes on 2 cores)")
    p.add_argument("--scale", type=float, help="Criteo Kaggle cardinality scale (default 0.03; --quick 0.01)")
    p.add_argument("--dims", default="128,64")
    p.add_argument("--dtypes", default="fp32,fp16,bf16")
    p.add_argument("--inits", default="torchrec,trained")
    p.add_argument("--trained-tables", metavar="DIR", help="also benchmark the .ibp / .pt tables found here")
    p.add_argument("--no-sweep", action="store_true", help="center and uniform workloads only")
    p.add_argument("--batches", type=int, help="distinct batches per timed pass (default 2; --quick 1)")
    p.add_argument("--repeats", type=int, help="timed passes, median reported (default 5; --quick 3)")
    p.add_argument("--threads", type=int, default=1,
                   help="threads for torch and libibp in the timings (default 1; the fp32 d128 center "
                        "workload also runs on all usable CPUs)")
    p.add_argument("--codec-sample", type=int, help="rows per table sampled for per-row zstd/lz4 "
                   "(default 8192; --quick 2048)")
    p.add_argument("--no-zipnn", action="store_true", help="skip zipnn even if installed")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-json", action="store_true", help="write neither the JSON nor the PNG")
    p.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR,
                   help="where the JSON and the PNG go (default benchmarks/results)")
    p.add_argument("--runs", type=int, default=1,
                   help="run everything this many times (a JSON each) and judge issue 11's targets on the "
                        "median of the runs (default 1; a single run moves a set by 0.1x and more)")
    a = p.parse_args(argv)
    # 0 was read as "unset" before; a round's ratio needs a round, a verdict a run
    for name in ("batches", "repeats", "codec_sample", "runs"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(a, name)}")
    a.scale = a.scale or (0.01 if a.quick else 0.03)
    a.batches = a.batches or (1 if a.quick else 2)
    a.repeats = a.repeats or (3 if a.quick else 5)
    a.codec_sample = a.codec_sample or (2048 if a.quick else 8192)
    a.all_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        a.dims = [int(x) for x in a.dims.split(",")]
    except ValueError:
        p.error(f"--dims: {a.dims!r} is not a comma-separated list of integers")
    if min(a.dims) < 1:
        p.error(f"--dims: {a.dims} must be positive")
    a.dtypes = a.dtypes.split(",")
    a.inits = a.inits.split(",")
    for x in a.dtypes:
        if x not in DTYPES:
            p.error(f"--dtypes: {x!r} is not one of {list(DTYPES)}")
    for x in a.inits:
        if x not in ("torchrec", "trained"):
            p.error(f"--inits: {x!r} is not one of ['torchrec', 'trained']")
    if not a.trained_tables and not plan(a):
        quick = ", ".join(f"{dt} d{d} {init}" for dt, d, init in QUICK_SETS)
        p.error(f"no table set matches --dtypes, --dims and --inits (--quick runs only {quick}; drop --quick "
                "for other dims)")
    return a


def _judged(docs: list) -> tuple[dict, str]:
    """Issue 11's verdicts over runs and their report; a run that cannot be judged (bf16 sets
    only) says so instead, and is kept."""
    # Imported here: this package's __init__ imports cli, and a module it imports at its top
    # is loaded before `python -m benchmarks.lookup.targets` runs it as __main__.
    from . import targets as issue11

    try:
        judged = issue11.combine(docs)
        return judged, issue11.format_issue11(judged)
    except ValueError as e:
        return {"error": str(e)}, f"### Issue 11's targets: not judged ({e})"


def main(argv=None) -> int:
    args = parse_args(argv)
    docs = []
    for i in range(args.runs):
        if args.runs > 1:
            print(f"[run {i + 1} of {args.runs}]", file=sys.stderr, flush=True)
        docs.append(run_once(args))
    if args.runs > 1:
        judged, text = _judged(docs)
        print("\n" + text)
        if not args.no_json:
            path = common.write_json({"benchmark": "lookup_targets", "sources": [d["path"] for d in docs], **judged,
                                      "markdown": text}, "lookup_targets", results_dir=args.results_dir)
            print(f"results: {common.shown(path)}")
    return 0


def run_once(args) -> dict:
    """One run of every table set and workload: prints its report, writes its JSON (unless
    --no-json) and returns {"params", "results", "path"}."""
    stamp = common.utc_stamp()
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    params = {k: v for k, v in vars(args).items() if k not in ("no_json", "results_dir")}
    params.update(steady_allocations=common.steady_allocations(),
                  started_utc=stamp, machine=common.machine_info(), load_average_start=common.load_average(),
                  zipnn_version=None if args.no_zipnn else zipnn_available(),
                  workloads_center=CENTER.name, headline_pair=f"{HEADLINE} vs {FBGEMM}",
                  ibp_variants=[f"W{w} K{k}" for w, k in IBP_VARIANTS],
                  host_bytes_model="FBGEMM UVM: ids x raw row bytes; ibp: per feature, distinct ids x (stored "
                                   "row length + 8-byte block base + 2 rel entries); computed from the batches, "
                                   "not measured")
    if params["zipnn_version"] is None and not args.no_zipnn:
        log("zipnn does not import: its column is skipped (pip install zipnn)")
    sets = plan(args)
    log(f"{len(sets)} table sets, {sum(len(w) for _, w in sets)} (table set, workload) pairs, scale {args.scale:g}, "
        f"timings on {args.threads} thread(s), load average {params['load_average_start']}")
    results = []
    with common.threads(args.all_threads):  # encoding and codecs on all CPUs; each timing sets its own
        for i, (ts, works) in enumerate(sets, 1):
            log(f"[{i}/{len(sets)}] {ts.label}: {len(ts.rows)} tables, {sum(ts.rows):,} rows, "
                f"{ts.raw_bytes / 2**20:.0f} MiB raw")
            r = run_table_set(ts, works, args, log)
            gc.collect()
            log(f"  done in {r['wall_s']:.0f} s (" + ", ".join(f"{k} {v:.0f}" for k, v in r["phases_s"].items()) + ")")
            results.append(r)
    params["load_average_end"] = common.load_average()
    params["wall_s"] = time.perf_counter() - t_start
    targets = check_targets(results, params["machine"])
    judged, judged_text = _judged([{"params": params, "results": results}])
    text = report(results, params) + "\n" + format_targets(targets) + "\n\n" + judged_text + \
        f"\n\nWall time {params['wall_s']:.0f} s; load average at the end {params['load_average_end']}."
    print(text)
    path = None
    if not args.no_json:
        path = common.write_json({"benchmark": "lookup", "params": params, "results": results, "targets": targets,
                                  "issue11_targets": judged, "markdown": text}, "lookup", stamp, args.results_dir)
        png = plot(results, args.results_dir / f"lookup-{stamp}.png")
        print(f"\nresults: {common.shown(path)}" + (f", plot: {common.shown(png)}" if png else ""))
    return {"params": params, "results": results, "path": None if path is None else str(path)}

