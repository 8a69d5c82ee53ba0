"""Decode speed of every kernel set libibp can run on this CPU, side by side.

    python -m benchmarks.kernels             # fp32 d128 and fp16 d64, W = 16, 32, 64
    python -m benchmarks.kernels --rows 20000 --repeats 20

libibp picks one kernel set at load time (`ibp_isa`: AVX-512, x86-64-v3 with pdep,
x86-64-v3 with bit loops for CPUs that microcode pdep, or portable C); each can be
forced (`ibp_set_isa`), so one process can time them all on the same tables. Per
table (torchrec init and trained-like, each dtype and word size), 1,000 rows spread
over the table are decoded into a buffer of each set's, 1 thread (the rows and the four
buffers, 2.5 MB of fp32 d128, do not all stay in L2; libibp takes the prefetches for
rows in memory for the fp32 d128 table, of more than 8 times L2: rows_in_memory in
native/ibp_spans.inc); the sets' calls alternate in each round, so a change of machine
load hits them alike, each round in its own order (common.round_orders: no set always after the same other). Each
call takes the rows in a new order (one of common.FRESH_ORDERS, in turn), as a
lookup's distinct rows are new to the branch predictor in every batch; the same
rows in the same order every call ("repeated"), whose branches the predictor
learns, are timed too. Their outputs must be bit-identical. Results: markdown
tables of ns a row (min over the rounds, and GB/s of decoded rows), issue 11's decode
lines for the kernel set libibp picked (10 GB/s at every word size; W = 16 and 32 as
fast as W = 64), and benchmarks/results/kernels-<UTC time>.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from ibp_embed import _native, compress, datasets
from ibp_embed.codec import _as_words
from ibp_embed.dtypes import as_rows

from . import common

CASES = ((torch.float32, 128), (torch.float16, 64))
INITS = ("torchrec", "trained")
WORD_BITS = (16, 32, 64)
DECODED_ROWS = 1000
MODES = {"fresh": "rows in a new order every call (as a lookup's rows)",
         "repeated": "the same rows in the same order every call (branches learnt)"}
GBPS_LINE = 10.0  # issue 11: decode at 10 GB/s a core or more, for every word size


def step_mix(weights: torch.Tensor, table) -> dict:
    """What sets a word size's decode apart on this table: its stored bytes a row (payload,
    index and codebook over the rows) and the share of the SIMD steps (512 bits of
    words) of its encoded rows whose words all participate, which the AVX-512 kernels
    decode directly (no field offsets to compute; see native/ibp_isa_avx512.c)."""
    W, rows = table.word_bits, weights.shape[0]
    words = _as_words(as_rows(weights)[0], W).astype(np.uint64)  # the format's words, as compress reads them
    lanes = 512 // W
    steps = words.shape[1] // lanes
    cid = table.cluster_ids().astype(np.int64)
    enc = cid >= 0  # raw rows are copied whole
    m, v = table.masks[cid[enc]], table.bitvals[cid[enc]]
    part = ((words[enc] & m) == v)[:, :steps * lanes].reshape(-1, steps, lanes)
    return {"bytes_per_row": table.nbytes / rows,
            "direct_steps": float(part.all(axis=2).mean()) if part.size else 0.0}


def decode_targets(runs: list, kernel_set: str) -> dict:
    """Issue 11's decode lines for one kernel set, rows in a new order every call (as a
    lookup's): every table at every word size >= 10 GB/s of decoded rows, and W = 16 and
    32 as fast as W = 64 (a time ratio of at most 1)."""
    def case(r):
        return {k: r[k] for k in ("init", "dtype", "dim", "word_bits")}

    def ns(r):
        return r["ns_per_row_fresh"][kernel_set]

    w64 = {(r["init"], r["dtype"], r["dim"]): r for r in runs if r["word_bits"] == 64}
    speeds = [{**case(r), "gbps": r["row_bytes"] / ns(r)} for r in runs]
    ratios = [{**case(r), "time_vs_w64": ns(r) / ns(w64[r["init"], r["dtype"], r["dim"]])}
              for r in runs if r["word_bits"] != 64]
    below = [x for x in speeds if x["gbps"] < GBPS_LINE]
    slower = [x for x in ratios if x["time_vs_w64"] > 1.0]
    return {"kernel_set": kernel_set, "gbps_line": GBPS_LINE, "gbps_met": not below, "gbps": speeds,
            "below_line": below, "w16_w32_as_fast_met": not slower, "time_vs_w64": ratios}


def format_decode_targets(t: dict) -> str:
    def name(x):
        return f"{x['init']} {x['dtype'][6:]} d{x['dim']} W = {x['word_bits']}"

    below = "; ".join(f"{name(x)} {x['gbps']:.1f}" for x in t["below_line"])
    r = [x["time_vs_w64"] for x in t["time_vs_w64"]]
    return (f"Issue 11's decode lines ({t['kernel_set']}, rows in a new order every call): "
            f"{t['gbps_line']:g} GB/s for every word size: "
            + ("met" if t["gbps_met"] else f"MISSED ({len(t['below_line'])} of {len(t['gbps'])} below: {below})")
            + "; W = 16 and 32 as fast as W = 64: " + ("met" if t["w16_w32_as_fast_met"] else "MISSED")
            + (f" ({min(r):.2f}-{max(r):.2f}x its time)" if r else "") + ".")


def time_sets(table, sets: dict, repeats: int, fresh: bool) -> dict:
    """{set name: min seconds of one decode call} on `table`, sets alternating per round;
    fresh: each call's rows in a new order (see the module doc)."""
    lib, ffi = _native.lib, _native.ffi
    ids = np.linspace(0, table.shape[0] - 1, DECODED_ROWS).astype(np.int64)
    orders = common.fresh_orders(ids) if fresh else [ids]
    outs = {name: np.empty((ids.size, table._row_bytes), np.uint8) for name in sets}

    def call(name, isa, order):
        args = (table._c, ffi.cast("const int64_t *", order.ctypes.data), order.size,
                ffi.cast("uint8_t *", outs[name].ctypes.data))
        return lambda: (lib.ibp_set_isa(isa), _native.check(lib.ibp_decode(*args), "decode"))

    picked = lib.ibp_isa()
    try:
        got = common.time_interleaved({name: common.in_turn([call(name, isa, o) for o in orders])
                                       for name, isa in sets.items()}, repeats=repeats, shuffle=True)
        for order in orders:  # the timing leaves each set's last output: every order, set against set
            for name, isa in sets.items():
                call(name, isa, order)()
            first = next(iter(outs))
            for name, out in outs.items():
                if not np.array_equal(out, outs[first]):
                    raise SystemExit(f"kernels: the {name} kernels decoded other bits than the {first} ones")
    finally:
        lib.ibp_set_isa(picked)
    return {name: r["min_s"] for name, r in got.items()}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=101_312, help="table rows (default: the quick set's 101k table)")
    # a round (every set once) takes 0.15-0.75 ms: in two runs of 40 rounds (the default
    # until 7905ef3) on a shared host, a table of each came out 1.4x its time in the others
    p.add_argument("--repeats", type=int, default=200, help="timed rounds (default 200)")
    p.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    args = p.parse_args(argv)
    for name in ("rows", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    args.rows = max(args.rows, DECODED_ROWS)
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    _native.lib.ibp_set_num_threads(1)
    sets = _native.runnable_kernel_sets()
    rows, runs = {mode: [] for mode in MODES}, []
    for init in INITS:
        for dtype, dim in CASES:
            weights = (datasets.make_trained_like_table(args.rows, dim, dtype) if init == "trained" else
                       datasets.make_table(args.rows, dim, dtype, init=init))
            for w in WORD_BITS:
                print(f"[kernels] {init} {dtype} d{dim} W = {w}", file=sys.stderr, flush=True)
                table = compress(weights, word_bits=w, progress=False)
                ns = {mode: {name: sec / DECODED_ROWS * 1e9
                             for name, sec in time_sets(table, sets, args.repeats, mode == "fresh").items()}
                      for mode in MODES}
                runs.append({"init": init, "dtype": str(dtype), "dim": dim, "word_bits": w,
                             "row_bytes": table._row_bytes, **step_mix(weights, table),
                             "ns_per_row_fresh": ns["fresh"], "ns_per_row_repeated": ns["repeated"]})
                for mode in MODES:
                    rows[mode].append([init, f"{str(dtype)[6:]} d{dim}", w] +
                                      [f"{common.fmt(v, 1)} ({common.fmt(table._row_bytes / v, 1)})"
                                       for v in ns[mode].values()])
    picked = next(name for name, isa in sets.items() if isa == _native.lib.ibp_isa())
    print(f"ns a row (GB/s of decoded rows), {args.rows} rows, {DECODED_ROWS} decoded, min of {args.repeats} "
          f"rounds, 1 thread; libibp picked {picked}; load average {common.load_average()}")
    for mode, title in MODES.items():
        print(f"\n{title}\n")
        print(common.markdown_table(["init", "table", "W", *sets], rows[mode]))
    print("\nthe encodings: stored bytes a row, and the share of steps whose words all participate\n")
    print(common.markdown_table(["init", "table", "W", "bytes a row", "direct steps"],
                                [[r["init"], f"{r['dtype'][6:]} d{r['dim']}", r["word_bits"],
                                  f"{r['bytes_per_row']:.1f}", f"{r['direct_steps']:.3f}"] for r in runs]))
    targets = decode_targets(runs, picked)
    print("\n" + format_decode_targets(targets))
    return common.save_runs("kernels", vars(args) | {"sets": sets}, runs, args.results_dir, issue11_decode=targets)


if __name__ == "__main__":
    main()
