"""What a table's pages cost a lookup: its payload on huge pages (as ibp_embed allocates
it, see ibp_embed/hostmem.py) against a copy on 4 KiB pages, and FBGEMM's TBE with its
weights where torch puts them and collapsed onto huge pages, in one process.

    python -m benchmarks.pages --rows 1101304,303937 --dim 128

Each table is compressed once; its payload is copied into a mapping that refuses huge
pages (MADV_NOHUGEPAGE), the same index and masks, so the two ibp rows differ only in
the pages their rows lie on. FBGEMM's TBE (HOST) gets the same weights twice: as torch
allocates them (no huge pages asked for: 4 KiB pages where transparent huge pages are
on "madvise") and in a second TBE whose weights madvise(MADV_COLLAPSE) moved onto huge
pages (Linux 6.1 and newer; left out where refused). One B x P batch (default B4096 x
P20) of Zipf 1.05 and of uniform ids, each round in its own order
(common.round_orders), 1 thread; the outputs are checked first (bit for bit). The bytes
on huge pages are /proc/self/smaps' counts of the mappings each lies in (an upper bound
where neighbours merged: hostmem.huge_pages_bytes). Results: a markdown table and
benchmarks/results/pages-<UTC time>.json.
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
from .lookup.systems import build_tbe, collapse_onto_huge_pages

SYSTEMS = ("ibp, huge pages", "ibp, 4 KiB pages", "fbgemm", "fbgemm, huge pages")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1101304", help="comma-separated table sizes (default: make demo's table)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--repeats", type=int, default=15, help="timed rounds (default 15)")
    p.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    args = p.parse_args(argv)
    args.sizes = common.int_list(p, args.rows, "--rows")
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


def tbe_of(weights: torch.Tensor, huge_pages: bool):
    """A TBE (HOST) of weights, on huge pages or as torch allocates it, whether it is on
    huge pages as asked, and its weights as a NumPy view."""
    tbe = build_tbe([weights.shape[0]], [weights.shape[1]], weights.dtype, huge_pages=False)
    done = not huge_pages or collapse_onto_huge_pages(tbe.weights_host)
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(weights)
    return tbe, done, tbe.split_embedding_weights()[0].detach().numpy()


def time_table(n_rows: int, args) -> list[dict]:
    weights = datasets.make_table(n_rows, args.dim, torch.float32, init="torchrec", seed=n_rows)
    huge = ibp_embed.compress(weights, progress=False)
    small = on_small_pages(huge)
    (tbe, _, tbe_w), (tbe_huge, collapsed, tbe_huge_w) = tbe_of(weights, False), tbe_of(weights, True)
    systems = SYSTEMS if collapsed else SYSTEMS[:3]
    del weights
    n_ids = args.batch * args.pooling
    offsets = torch.arange(0, n_ids + 1, args.pooling, dtype=torch.int64)
    runs = []
    for dist in ("zipf", "uniform"):
        ids = (datasets.zipf_ids(n_ids, n_rows, 1.05, seed=1) if dist == "zipf" else
               datasets.uniform_ids(n_ids, n_rows, seed=1))
        fns = {SYSTEMS[0]: lambda: ibp_embed.lookup_many([huge], [ids.numpy()], [offsets.numpy()]),
               SYSTEMS[1]: lambda: ibp_embed.lookup_many([small], [ids.numpy()], [offsets.numpy()]),
               SYSTEMS[2]: lambda: tbe(ids, offsets), SYSTEMS[3]: lambda: tbe_huge(ids, offsets)}
        fns = {s: fns[s] for s in systems}
        with torch.no_grad():
            want = fns["fbgemm"]()
            if not all(torch.equal(fns[s](), want) for s in systems):
                raise SystemExit(f"pages: ibp's pooled sums differ from FBGEMM's ({n_rows} rows, {dist})")
            t = common.time_interleaved(fns, repeats=args.repeats, shuffle=True)
        ms = {s: t[s]["median_s"] * 1e3 for s in systems}
        runs.append({"rows": n_rows, "dist": dist, "ms": ms,
                     "small_over_huge": float(np.median(np.array(t[SYSTEMS[1]]["times_s"]) /
                                                        np.array(t[SYSTEMS[0]]["times_s"]))),
                     "huge_page_bytes": dict(zip(SYSTEMS, (hostmem.huge_pages_bytes(x) for x in
                                                           (huge._payload, small._payload, tbe_w, tbe_huge_w)))),
                     "payload_bytes": int(huge._payload.nbytes), "weights_bytes": int(tbe_w.nbytes)})
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
    def on_huge(r, system):
        got = r["huge_page_bytes"][system]
        return "?" if got is None else f"{got / 2**20:,.0f}"

    def speed(r, over):  # FBGEMM's time over another system's: above 1 where that one is faster
        return f"{r['ms']['fbgemm'] / r['ms'][over]:.2f}x" if over in r["ms"] else "-"

    print(common.markdown_table(
        ["rows", "ids", "MiB on huge pages: ibp / copy / FBGEMM / collapsed", *(f"{s} ms" for s in SYSTEMS),
         "ibp 4 KiB / huge", "FBGEMM / ibp", "FBGEMM / ibp 4 KiB", "FBGEMM / FBGEMM huge"],
        [[r["rows"], r["dist"], " / ".join(on_huge(r, s) for s in SYSTEMS),
          *(common.fmt(r["ms"][s]) if s in r["ms"] else "-" for s in SYSTEMS), f"{r['small_over_huge']:.2f}x",
          speed(r, SYSTEMS[0]), speed(r, SYSTEMS[1]), speed(r, SYSTEMS[3])] for r in runs]))
    if any(SYSTEMS[3] not in r["ms"] for r in runs):
        print("\n(-: this kernel refused MADV_COLLAPSE; FBGEMM's weights stayed where torch put them)")
    return common.save_runs("pages", vars(args), runs, args.results_dir)


if __name__ == "__main__":
    main()
