"""A/B of two builds of libibp in one process: decode and single-table lookups.

    python -m benchmarks.ab HEAD~1              # HEAD~1 (A) against the working tree (B)
    python -m benchmarks.ab cd78949 HEAD --what lookup --dtype float16 --dim 64
    python -m benchmarks.ab a/libibp.so b/libibp.so   # two libraries already built

A build is a git revision (its `native/` and `Makefile`, from `git archive`), `.` for
the working tree, or the path of a built libibp.so; revisions are compiled with
`make lib` into a temporary folder. Both builds run on the same tables and ids, which
the installed package compresses, so they must share its ABI (`ibp_abi_version`).

Measurements, 1 thread, each call of A followed by the same call of B:
- `decode`: rows 0..m of the table, m rows of output that stay in cache;
- `decode-fresh`: the same rows in a new order every call (common.fresh_orders), which
  the branch predictor cannot learn, as it cannot a lookup's rows: `decode` measures
  learnt branches (fp32 d64 rows 0.6x the time of these on a Zen 4);
- `decode-cold`: every 5th row of the table, a 64 MiB buffer written before each call;
- `decode-stream`: every call m rows drawn anew (uniformly) from the whole table, each
  build its own (drawn alike): a gather's rows from where the table lies (memory, for a
  table much larger than the caches), as lookup-stream's below;
- `encode`: rows 0..m of the table encoded again with its codebook (rows that stay in cache;
  the call includes zeroing the payload, which encode ORs into);
- `lookup`: one pooled lookup (sum) of a B x P batch of Zipf or uniform ids;
- `lookup-fresh`: the same with another batch every call (LOOKUP_BATCHES of them, in
  turn): one batch again and again lets the predictor learn the branches of its rows'
  decode (bf16 d128 torchrec-init rows decoded 1.13-1.25x slower without the direct
  steps in one order every call, 0.75-0.81x in a new one);
- `lookup-cold`: `lookup` after the 64 MiB write, as in a model whose other tables and
  layers run between two lookups into a table: a batch repeated finds its rows in L3
  (a uniform batch into 506k fp16 d64 rows names 9 MB of them), so `lookup` times
  rows from L3 where a model reads them from memory;
- `lookup-stream`: every call a batch that no call before it named, each build its own
  (drawn alike), as a server's requests come: rows a batch shares with earlier ones (a
  Zipf batch's hot rows) are in cache, the others come from where the table lies. The
  builds' outputs are compared on one batch both look up first.

Timing two builds on the same input one after the other favours the second, which finds
what the first left in cache (15-20% on fp16 tables that nearly fit the cache), so every
measurement is run twice, A first and then B first, and both ratios are printed. Their
outputs must be bit-identical. Results: a markdown table (min and median ms, B / A) and
benchmarks/results/ab-<UTC time>.json.

Apart from the order there is the position: a build timed against itself
(`python -m benchmarks.ab X.so X.so`) put B 1.01-1.03x behind A on fp16 d64 lookups and
1.08-1.17x on fp16 d384 ones (one process, 2026-12-03, the Sapphire Rapids Xeon of docs/benchmarks.md), in
both orders. Where a change's effect is that small, time it with the builds swapped as
well: `--swapped` runs every measure again in a second process that loads B first and
prints those rows as `<measure> swapped` (B / A still the second build against the
first), so a change that holds in both positions shows in both sets of rows.
`--isolated` avoids positions altogether.

`--isolated` times each build in a process of its own instead (the processes alternate,
in both orders; each makes the same table and ids and reports a digest of its output),
for changes whose effect one library could hide from the other: in one process the two
share memory and caches. Both modes serve large allocations from a heap kept mapped
(common.steady_allocations, as benchmarks.lookup does), so neither sees what a process
with glibc's defaults pays for a large buffer freed and allocated again (fresh pages,
zeroed by the kernel): time such changes in a plain process. Keeping the lookup scratch
between calls (f7a6470) timed 1.05-1.08x in one process, 1.01-1.03x with --isolated,
and 0.82x in a plain process.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ibp_embed import _native, compress, datasets
from ibp_embed.dtypes import LOOKUP_DTYPES

from . import common

WHAT = ("decode", "decode-fresh", "decode-cold", "decode-stream", "encode", "lookup", "lookup-fresh", "lookup-cold",
        "lookup-stream")
LOOKUP_BATCHES = 8
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FLUSH_BYTES = 64 << 20


# ================================================================ builds
def build(spec: str, into: Path) -> Path:
    """The libibp.so of one build spec (see the module doc), compiled under `into`."""
    if spec.endswith(".so"):
        path = Path(spec)
        if not path.is_file():
            raise SystemExit(f"ab: {spec}: no such library")
        return path
    src = into / "src"
    src.mkdir(parents=True)
    if spec == ".":
        shutil.copytree(common.ROOT / "native", src / "native", ignore=shutil.ignore_patterns("build"))
        shutil.copy2(common.ROOT / "Makefile", src / "Makefile")
    else:
        archive = subprocess.run(["git", "archive", spec, "native", "Makefile"], cwd=common.ROOT,
                                 capture_output=True)
        if archive.returncode:
            raise SystemExit(f"ab: git archive {spec}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    made = subprocess.run(["make", "-s", "lib", f"BUILD={into}"], cwd=src, capture_output=True, text=True)
    if made.returncode:
        raise SystemExit(f"ab: building {spec} failed:\n{made.stdout}{made.stderr}")
    return into / "libibp.so"


def build_all(specs: dict, into: Path, tag: str = "ab") -> dict:
    """{name: libibp.so} of each build spec (see build), compiled under into / name,
    each named on stderr as it is built."""
    paths = {}
    for name, spec in specs.items():
        print(f"[{tag}] {name} = {spec}" + ("" if spec.endswith(".so") else ": building"), file=sys.stderr, flush=True)
        paths[name] = build(spec, into / name)
    return paths


def load(path: Path):
    lib = _native.ffi.dlopen(str(path))
    if lib.ibp_abi_version() != _native.lib.ibp_abi_version():
        raise SystemExit(f"ab: {path} has ABI {lib.ibp_abi_version()}, the package "
                         f"{_native.lib.ibp_abi_version()}: the builds cannot share its tables")
    lib.ibp_set_num_threads(1)
    return lib


@contextlib.contextmanager
def kernels(libs: dict, isa: str | None):
    """Each build on the named kernel set, then back on its own choice (a build given as
    the package's libibp.so is the package's library, dlopen'ed twice)."""
    before = {name: lib.ibp_isa() for name, lib in libs.items()}
    try:
        for lib in libs.values():
            if isa and lib.ibp_set_isa(_native.KERNEL_SETS[isa]):
                raise SystemExit(f"ab: this CPU cannot run libibp's {isa} kernels")
        yield
    finally:
        for name, lib in libs.items():
            lib.ibp_set_isa(before[name])


# ================================================================ calls
def decode_call(lib, table, ids: np.ndarray, out: np.ndarray):
    ffi = _native.ffi
    args = (table._c, ffi.cast("const int64_t *", ids.ctypes.data), ids.size, ffi.cast("uint8_t *", out.ctypes.data))
    return lambda: _native.check(lib.ibp_decode(*args), "decode")


def encode_call(lib, table, rows: np.ndarray, out: np.ndarray):
    """ibp_encode of rows (the table's first rows, decoded) into out, where the table stores them."""
    ffi, n = _native.ffi, rows.shape[0]
    starts = np.concatenate([[0], np.cumsum(table.row_lengths()[:n])]).astype(np.uint64)
    # a row stored raw (cluster id -1) is stored raw under every cluster: cluster 0 will do
    clusters = None if table.is_raw else np.maximum(table.cluster_ids()[:n], 0).astype(np.uint8)
    args = (ffi.addressof(table._c, "cb"), ffi.cast("const uint8_t *", rows.ctypes.data), n,
            ffi.NULL if clusters is None else ffi.cast("const uint8_t *", clusters.ctypes.data),
            ffi.cast("const uint64_t *", starts.ctypes.data),
            ffi.cast("uint8_t *", out.ctypes.data))

    def call():
        out[:] = 0  # encode ORs its fields in: part of the timed call
        _native.check(lib.ibp_encode(*args), "encode")
    call.arrays = (starts, clusters)  # what the arguments point into, alive as long as the call
    return call


def lookup_call(lib, table, dtype, ids: np.ndarray, offsets: np.ndarray, out: np.ndarray):
    ffi = _native.ffi
    args = (table._c, LOOKUP_DTYPES[dtype], out.shape[1], ffi.cast("const int64_t *", ids.ctypes.data),
            ffi.cast("const int64_t *", offsets.ctypes.data), out.shape[0], ffi.NULL, 0,
            ffi.cast("float *", out.ctypes.data))
    return lambda: _native.check(lib.ibp_lookup(*args), "lookup")


def time_pair(calls: dict, outs: dict, repeats: int, flush: np.ndarray | None) -> dict:
    """Time the builds' calls alternately, in the order of `calls`, after a warm-up round;
    their outputs must be equal (with one build: nothing to compare)."""
    times = {name: [] for name in calls}
    for rep in range(repeats + 1):  # the first round warms up
        for name, call in calls.items():
            if flush is not None:
                flush += 1
            t0 = time.perf_counter()
            call()
            if rep:
                times[name].append(time.perf_counter() - t0)
    if len(outs) == 2:
        a, b = outs.values()
        if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            raise SystemExit("ab: the two builds' outputs differ")
    return {name: {"min_s": min(t), "median_s": float(np.median(t))} for name, t in times.items()}


def digest(out: np.ndarray) -> str:
    return hashlib.sha256(out.view(np.uint8).tobytes()).hexdigest()


def make_table(args):
    dtype = DTYPES[args.dtype]
    weights = (datasets.make_trained_like_table(args.rows, args.dim, dtype) if args.init == "trained" else
               datasets.make_table(args.rows, args.dim, dtype, init=args.init))
    return compress(weights, word_bits=args.word_bits, clusters=args.clusters, progress=False)


def same_outputs(each: dict, outs: dict) -> None:
    """Every input of a call that takes several in turn (each[build][i]), by both
    builds: their outputs must be equal for each (the timing compares the last one's)."""
    for calls in zip(*each.values()):
        for call in calls:
            call()
        if not np.array_equal(*outs.values()):
            raise SystemExit("ab: the two builds' outputs differ")


def lookup_ids(args, seed: int) -> np.ndarray:
    """A batch's ids (args.batch x args.pooling of args.dist)."""
    n = args.batch * args.pooling
    return (datasets.zipf_ids(n, args.rows, args.alpha, seed=seed, perm_seed=3) if args.dist == "zipf" else
            datasets.uniform_ids(n, args.rows, seed=seed)).numpy().astype(np.int64)


def measure_stream(what: str, libs: dict, table, args, orders) -> list[dict]:
    """measure()'s `lookup-stream` and `decode-stream`: each build's calls take batches
    (rows) of their own, each once."""
    dtype = DTYPES[args.dtype]
    gather = what == "decode-stream"  # cached_rows rows drawn from the whole table, as a gather's
    n = args.cached_rows if gather else args.batch * args.pooling
    offsets = None if gather else np.arange(0, n + 1, args.pooling, dtype=np.int64)
    outs = {k: np.empty((n, args.dim * dtype.itemsize), np.uint8) if gather else
            np.empty((args.batch, args.dim), np.float32) for k in libs}

    def ids_of(seed: int) -> np.ndarray:
        return datasets.uniform_ids(n, args.rows, seed=seed).numpy().astype(np.int64) if gather else \
            lookup_ids(args, seed)

    def call(lib, ids: np.ndarray, out: np.ndarray):
        return decode_call(lib, table, ids, out) if gather else lookup_call(lib, table, dtype, ids, offsets, out)

    first = ids_of(0)
    if len(libs) == 2:
        same_outputs({k: [call(lib, first, outs[k])] for k, lib in libs.items()}, outs)
    results, seed, batches = [], 1, []  # batches: alive while their calls may run
    for order in orders:
        calls = {}
        for k in order:
            mine = [ids_of(s) for s in range(seed, seed + args.repeats + 1)]  # and the warm-up's
            seed += len(mine)
            batches.append(mine)
            calls[k] = common.in_turn([call(libs[k], b, outs[k]) for b in mine])
        got = time_pair(calls, {}, args.repeats, None)  # other batches: outputs not comparable
        results.append({"order": ", ".join(order), **got, "units": n, "digest": digest(outs[order[0]])})
    return results


def measure(what: str, libs: dict, table, args, orders=(("A", "B"), ("B", "A"))) -> list[dict]:
    """Both orders of one measurement: [{'order': 'A, B', 'A': ..., 'B': ..., 'digest': ...}, ...]
    (the digest of the outputs, equal for both builds; for the streams, of the last call
    of the order's first build)."""
    dtype = DTYPES[args.dtype]
    if what.endswith("-stream"):
        return measure_stream(what, libs, table, args, orders)
    if what in ("lookup", "lookup-fresh", "lookup-cold"):
        n = args.batch * args.pooling
        batches = [lookup_ids(args, s) for s in range(1, 1 + (LOOKUP_BATCHES if what == "lookup-fresh" else 1))]
        ids = batches[0]
        offsets = np.arange(0, n + 1, args.pooling, dtype=np.int64)
        outs = {k: np.empty((args.batch, args.dim), np.float32) for k in libs}
        each = {k: [lookup_call(lib, table, dtype, b, offsets, outs[k]) for b in batches] for k, lib in libs.items()}
    elif what == "encode":
        m = min(args.rows, args.cached_rows)
        ids = np.arange(m, dtype=np.int64)
        rows = np.ascontiguousarray(table.decompress()[:m].contiguous().view(torch.uint8).numpy())
        size = int(table.row_lengths()[:m].sum()) + 64
        outs = {k: np.empty(size, np.uint8) for k in libs}
        each = {k: [encode_call(lib, table, rows, outs[k])] for k, lib in libs.items()}
    else:
        ids = (np.arange(0, args.rows, 5) if what == "decode-cold" else
               np.arange(min(args.rows, args.cached_rows))).astype(np.int64)
        outs = {k: np.empty((ids.size, args.dim * dtype.itemsize), np.uint8) for k in libs}
        row_orders = common.fresh_orders(ids) if what == "decode-fresh" else [ids]
        each = {k: [decode_call(lib, table, o, outs[k]) for o in row_orders] for k, lib in libs.items()}
    flush = np.zeros(FLUSH_BYTES, np.uint8) if what.endswith("-cold") else None
    if len(libs) == 2 and len(next(iter(each.values()))) > 1:  # a new order or batch every call
        same_outputs(each, outs)
    results = []
    for order in orders:
        calls = {k: common.in_turn(each[k]) for k in each}  # both builds from the first input: both end on the same
        got = time_pair({k: calls[k] for k in order}, outs, args.repeats, flush)
        results.append({"order": ", ".join(order), **got, "units": ids.size, "digest": digest(outs[order[0]])})
    return results


def measure_isolated(what: str, paths: dict, args) -> list[dict]:
    """measure()'s result with each build timed in a process of its own (see the module
    doc): the processes alternate, A then B and B then A."""
    results = []
    for order in (("A", "B"), ("B", "A")):
        got = {}
        for name in order:  # the worker gets these very options, as JSON
            config = {**vars(args), "a": str(paths[name]), "what": [what], "results_dir": None}
            run = subprocess.run([sys.executable, "-m", "benchmarks.ab", "--worker", json.dumps(config)],
                                 cwd=common.ROOT, capture_output=True, text=True)
            if run.returncode:
                raise SystemExit(f"ab: the {name} process failed:\n{run.stdout}{run.stderr}")
            got[name] = json.loads(run.stdout.strip().splitlines()[-1])
        if got["A"]["digest"] != got["B"]["digest"]:
            raise SystemExit("ab: the two builds' outputs differ")
        results.append({"order": ", ".join(order), "A": got["A"]["X"], "B": got["B"]["X"],
                        "units": got["A"]["units"], "digest": got["A"]["digest"]})
    return results


def measure_swapped(paths: dict, args) -> dict:
    """measure()'s results for every args.what, from a process that loads build B first
    and A second (see the module doc): {what: [...]}, its rows named for the builds as
    in this process, each with the library each name ran ("libs")."""
    config = {**vars(args), "a": str(paths["B"]), "b": str(paths["A"]), "results_dir": None}
    run = subprocess.run([sys.executable, "-m", "benchmarks.ab", "--worker-pair", json.dumps(config)],
                         cwd=common.ROOT, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"ab: the swapped process failed:\n{run.stdout}{run.stderr}")
    swap = {"A": "B", "B": "A"}
    return {what: [{**r, "order": ", ".join(swap[n] for n in r["order"].split(", ")), "A": r["B"], "B": r["A"],
                    "libs": {"A": r["libs"]["B"], "B": r["libs"]["A"]}}
                   for r in results]
            for what, results in json.loads(run.stdout.strip().splitlines()[-1]).items()}


def worker(args, pair: bool = False) -> None:
    """`--worker CONFIG` (measure_isolated's options as JSON): time build args.a alone on
    args.what and print measure()'s result (JSON). `--worker-pair CONFIG`
    (measure_swapped's): builds args.a and args.b, loaded in that order, on every
    args.what, printed as {what: measure()'s results}."""
    torch.set_num_threads(1)
    common.steady_allocations()
    if pair:
        specs = {"A": args.a, "B": args.b}
        libs = {name: load(build(spec, Path("unused"))) for name, spec in specs.items()}
        table = make_table(args)
        with kernels(libs, args.isa):
            print(json.dumps({what: [{**r, "libs": specs} for r in measure(what, libs, table, args)]
                              for what in args.what}))
        return
    lib = load(build(args.a, Path("unused")))
    table = make_table(args)
    with kernels({"X": lib}, args.isa):
        (result,) = measure(args.what[0], {"X": lib}, table, args, orders=(("X",),))
    print(json.dumps(result))


# ================================================================ main
def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", help="build A: a git revision, '.' (the working tree) or a libibp.so")
    p.add_argument("b", nargs="?", default=".", help="build B (default: the working tree)")
    p.add_argument("--what", default=",".join(WHAT), help=f"comma-separated, of {', '.join(WHAT)}")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--init", choices=("torchrec", "normal", "trained"), default="torchrec")
    p.add_argument("--word-bits", type=int, choices=(16, 32, 64), help="default: compress picks")
    p.add_argument("--clusters", type=int, default=1, help="the most clusters compress may keep (default 1)")
    p.add_argument("--rows", type=int, default=101_312, help="table rows (default: the quick set's 101k table)")
    p.add_argument("--cached-rows", type=int, default=1000, help="rows decoded by `decode`, `decode-fresh` and `decode-stream` (default 1000)")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--dist", choices=("zipf", "uniform"), default="zipf")
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--isa", choices=tuple(_native.KERNEL_SETS),
                   help="the kernels both builds run (default: the best this CPU has)")
    p.add_argument("--repeats", type=int, default=50, help="timed rounds per order (default 50)")
    p.add_argument("--isolated", action="store_true",
                   help="time each build in a process of its own (for changes to what libibp keeps between calls)")
    p.add_argument("--swapped", action="store_true",
                   help="also time the builds loaded the other way round, in a second process (the position "
                        "effect): rows '<measure> swapped'")
    p.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    args = p.parse_args(argv)
    if args.swapped and args.isolated:
        p.error("--swapped and --isolated: a process per build has no position to swap")
    args.what = [w.strip() for w in args.what.split(",") if w.strip()]
    bad = [w for w in args.what if w not in WHAT]
    if bad:
        p.error(f"unknown --what {', '.join(bad)}; choose from {', '.join(WHAT)}")
    for name in ("dim", "rows", "cached_rows", "batch", "pooling", "repeats", "clusters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if not args.alpha > 0:  # zipf_ids would say so, but only after both builds are compiled
        p.error(f"--alpha must be positive, not {args.alpha:g}")
    if args.clusters > 256:
        p.error(f"--clusters must be at most 256 (the format's limit), not {args.clusters}")
    return args


def main(argv=None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--worker"], ["--worker-pair"]):  # one process of --isolated, or --swapped's
        return worker(argparse.Namespace(**json.loads(argv[1])), pair=argv[0] == "--worker-pair")
    args = parse(argv)
    torch.set_num_threads(1)
    common.steady_allocations()
    with tempfile.TemporaryDirectory(prefix="ibp-ab-") as tmp:
        paths = build_all({"A": args.a, "B": args.b}, Path(tmp))
        runs = {}
        if args.isolated:
            for what in args.what:
                print(f"[ab] {what}, a process per build", file=sys.stderr, flush=True)
                runs[what] = measure_isolated(what, paths, args)
        else:
            libs = {name: load(path) for name, path in paths.items()}
            table = make_table(args)
            with kernels(libs, args.isa):
                for what in args.what:
                    print(f"[ab] {what}", file=sys.stderr, flush=True)
                    runs[what] = measure(what, libs, table, args)
            if args.swapped:
                print("[ab] every measure again, B loaded first, in a second process", file=sys.stderr, flush=True)
                for what, results in measure_swapped(paths, args).items():
                    if results[0]["digest"] != runs[what][0]["digest"]:
                        raise SystemExit("ab: the swapped process's outputs differ from this one's")
                    runs[f"{what} swapped"] = results
    rows = []
    for what, orders in runs.items():
        for r in orders:
            a, b = r["A"], r["B"]
            rows.append([what, r["order"], common.fmt(a["min_s"] * 1e3, 3), common.fmt(b["min_s"] * 1e3, 3),
                         common.fmt(b["min_s"] / a["min_s"], 3), common.fmt(a["median_s"] * 1e3, 3),
                         common.fmt(b["median_s"] * 1e3, 3), common.fmt(b["median_s"] / a["median_s"], 3)])
    config = {k: v for k, v in vars(args).items() if k != "results_dir"}
    print(f"A = {args.a}, B = {args.b}; {args.dtype} d{args.dim} {args.init}, {args.rows} rows, "
          f"W {args.word_bits or 'auto'}, K <= {args.clusters}; {args.isa or 'best'} kernels; 1 thread"
          f"{'; a process per build' if args.isolated else ''}"
          f"{'; swapped: the same in a process that loads B first' if args.swapped else ''}; "
          f"load average {common.load_average()}\n")
    print(common.markdown_table(["measure", "order", "A min ms", "B min ms", "B / A", "A median ms",
                                 "B median ms", "B / A (median)"], rows))
    return common.save_runs("ab", config, runs, args.results_dir)


if __name__ == "__main__":
    main()
