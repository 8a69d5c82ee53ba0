"""What a table's pages cost a lookup: its payload on huge pages (as ibp_embed allocates
it, see ibp_embed/hostmem.py) against a copy on 4 KiB pages, with FBGEMM's TBE, in one process.

    python -m benchmarks.pages --rows 1101304,303937 --dim 128

Each table is compressed once; its payload is copied into a mapping that refuses huge
pages (MADV_NOHUGEPAGE), the same index and masks, so the two ibp rows differ only in
the pages their rows lie on. One B x P batch (default B4096 x P20) of Zipf 1.05 and of
uniform ids, `lookup_many` on both tables and FBGEMM's TBE (HOST) on the same weights,
each round in its own order (common.round_orders), 1 thread; the outputs are checked
first (bit for bit). How many bytes of each payload are on huge pages is read from
/proc/self/smaps. Results: a markdown table and benchmarks/results/pages-<UTC time>.json.
"""
from __future__ import annotations

import argparse
import mmap
import sys
from pathlib import Path

import numpy as np
import torch

import ibp_embed
from ibp_embed import datasets, hostmem
from ibp_embed.table import CompressedTable

from . import common
from .lookup.systems import build_tbe

SYSTEMS = ("ibp, huge pages", "ibp, 4 KiB pages", "fbgemm")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1101304", help="comma-separated table sizes (default: make demo's table)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--repeats", type=int, default=15, help="timed rounds (default 15)")
    p.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    args = p.parse_args(argv)
    try:
        args.sizes = [int(n) for n in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows takes comma-separated integers, not {args.rows!r}")
    if min(args.sizes) < 1 or min(args.dim, args.batch, args.pooling, args.repeats) < 1:
        p.error("--rows, --dim, --batch, --pooling and --repeats must be positive")
    if not hasattr(mmap, "MADV_NOHUGEPAGE"):
        p.error("this system cannot say which pages memory lies on (no MADV_NOHUGEPAGE)")
    return args


def on_small_pages(table: CompressedTable) -> CompressedTable:
    """table with its payload copied to a mapping that refuses huge pages."""
    region = mmap.mmap(-1, max(table._payload.nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_NOHUGEPAGE)
    payload = np.frombuffer(region, dtype=np.uint8)[:table._payload.nbytes]
    payload[:] = table._payload
    return CompressedTable(shape=table.shape, dtype=table.dtype, word_bits=table.word_bits, masks=table.masks,
                           bitvals=table.bitvals, block_base=table._block_base, rel=table._rel, payload=payload,
                           payload_bytes=table._payload_bytes)


def time_table(n_rows: int, args) -> list[dict]:
    weights = datasets.make_table(n_rows, args.dim, torch.float32, init="torchrec", seed=n_rows)
    huge = ibp_embed.compress(weights, progress=False)
    small = on_small_pages(huge)
    tbe = build_tbe([n_rows], [args.dim], torch.float32)
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(weights)
    del weights
    n_ids = args.batch * args.pooling
    offsets = torch.arange(0, n_ids + 1, args.pooling, dtype=torch.int64)
    runs = []
    for dist in ("zipf", "uniform"):
        ids = (datasets.zipf_ids(n_ids, n_rows, 1.05, seed=1) if dist == "zipf" else
               datasets.uniform_ids(n_ids, n_rows, seed=1))
        fns = {SYSTEMS[0]: lambda: ibp_embed.lookup_many([huge], [ids.numpy()], [offsets.numpy()]),
               SYSTEMS[1]: lambda: ibp_embed.lookup_many([small], [ids.numpy()], [offsets.numpy()]),
               SYSTEMS[2]: lambda: tbe(ids, offsets)}
        with torch.no_grad():
            want = fns["fbgemm"]()
            if not all(torch.equal(fns[s](), want) for s in SYSTEMS[:2]):
                raise SystemExit(f"pages: ibp's pooled sums differ from FBGEMM's ({n_rows} rows, {dist})")
            t = common.time_interleaved(fns, repeats=args.repeats, shuffle=True)
        ms = {s: t[s]["median_s"] * 1e3 for s in SYSTEMS}
        runs.append({"rows": n_rows, "dist": dist, "ms": ms,
                     "small_over_huge": float(np.median(np.array(t[SYSTEMS[1]]["times_s"]) /
                                                        np.array(t[SYSTEMS[0]]["times_s"]))),
                     "huge_page_bytes": [hostmem.huge_pages_bytes(x._payload) for x in (huge, small)],
                     "payload_bytes": int(huge._payload.nbytes)})
    return runs


def main(argv=None) -> dict:
    args = parse(argv)
    runs = []
    with common.threads(1):
        for n in args.sizes:
            print(f"[pages] {n} rows", file=sys.stderr, flush=True)
            runs.extend(time_table(n, args))
    print(f"float32 d{args.dim} TorchRec init, B{args.batch} x P{args.pooling}, 1 thread, median of {args.repeats} "
          f"rounds; load average {common.load_average()}\n")
    mb = [lambda r, k=k: "?" if r["huge_page_bytes"][k] is None else f"{r['huge_page_bytes'][k] / 2**20:,.0f}"
          for k in (0, 1)]
    print(common.markdown_table(
        ["rows", "ids", "payload MiB", "on huge pages MiB (copy)", "ibp huge ms", "ibp 4 KiB ms", "FBGEMM ms",
         "4 KiB / huge", "FBGEMM / ibp huge", "FBGEMM / ibp 4 KiB"],
        [[r["rows"], r["dist"], f"{r['payload_bytes'] / 2**20:,.0f}", f"{mb[0](r)} ({mb[1](r)})",
          *(common.fmt(r["ms"][s]) for s in SYSTEMS), f"{r['small_over_huge']:.2f}x",
          f"{r['ms']['fbgemm'] / r['ms'][SYSTEMS[0]]:.2f}x", f"{r['ms']['fbgemm'] / r['ms'][SYSTEMS[1]]:.2f}x"]
         for r in runs]))
    return common.save_runs("pages", vars(args), runs, args.results_dir)


if __name__ == "__main__":
    main()
