"""How much of a table set's batched lookup is decoding: `lookup_many` over the compressed tables, over the same weights stored uncompressed and stored raw, with FBGEMM's TBE, in the same rounds.

    python -m benchmarks.headroom --scale 0.05 --min-rows 10000 --dim 64 --dist uniform

Two uncompressed forms of the same weights: `ibp uncompressed`, a table of one cluster
without invariant bits, so that every row is stored whole (uncompressed_table): the
lookup takes the compressed tables' path (deduplication into a scratch, or decode
windows where the ids repeat too little; a copy for a decode) but reads no index; and
`ibp raw`, a raw table (CompressedTable.raw), which the lookup pools straight from its
rows as FBGEMM does (no deduplication, no windows). The gap between `ibp` and `ibp
uncompressed` is what decoding the packed rows costs; between `ibp uncompressed` and
`ibp raw`, what the path that decoding needs costs on the same bytes. Beside the times,
the cache lines that a looked-up row's bytes span where they lie in memory (a packed
row's from wherever it starts in its line), plus the line of its index entry where the
table's rows differ in length (the block bases, 8 bytes a 64 rows, and the bytes a
decode reads past a row are not counted); averaged over the batch's ids, repeats
included (the lookup decodes each distinct id once): a model of what a lookup reads,
not a measurement. Small tables that a call pools from a decoded copy (up to 1 MB raw,
few ids a row: small batches) read neither layout. Each round times the four in its
own order (common.round_orders); the outputs are checked first (the uncompressed and
raw tables' sums bit for bit against the compressed ones', FBGEMM's to 1e-4). 1
thread. Results: a markdown table and benchmarks/results/headroom-<UTC time>.json.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

import ibp_embed
from ibp_embed import CompressedTable, _native, hostmem
from ibp_embed.codec import split_offsets
from ibp_embed.dtypes import as_rows

from . import common
from .ab_set import add_set_args, check_set_args, make_set
from .lookup.workloads import Workload, make_batch

SYSTEMS = ("fbgemm", "ibp", "ibp uncompressed", "ibp raw")


def uncompressed_table(weights: torch.Tensor, word_bits: int) -> CompressedTable:
    """The rows of `weights` as a table of one cluster without invariant bits: every row
    stored whole (its encoding, every word's W bits and the participation bits, would be
    longer), back to back from a line's start. Lookups take the compressed tables' path
    over it (its decode copies the rows) and, its rows being of one length, read no index."""
    rows, dtype, dim = as_rows(weights)
    n_rows, row_bytes = rows.shape
    n_words = -(-row_bytes // (word_bits // 8))
    block_base, rel = split_offsets(np.arange(n_rows + 1, dtype=np.uint64) * np.uint64(row_bytes), row_bytes)
    size = n_rows * row_bytes + _native.lib.ibp_tail_pad(row_bytes, word_bits)
    buf = hostmem.zeros(size + 64)
    payload = buf[-buf.ctypes.data % 64:][:size]
    payload[:n_rows * row_bytes].reshape(n_rows, row_bytes)[:] = rows
    zeros = np.zeros((1, n_words), np.uint64)
    return CompressedTable(shape=(n_rows, dim), dtype=dtype, word_bits=word_bits, masks=zeros, bitvals=zeros,
                           block_base=block_base, rel=rel, payload=payload, payload_bytes=n_rows * row_bytes)


def lines_spanned(address: int, starts: np.ndarray, lengths) -> float:
    """The mean cache lines spanned by rows of `lengths` bytes at address + starts."""
    return float((((address + starts) % 64 + lengths + 63) // 64).mean())


def table_lines(table: CompressedTable, ids: np.ndarray) -> float:
    """lines_spanned of table's rows `ids` in its payload, plus the index entry's line where
    the rows differ in length (libibp reads no index for raw tables and rows of one length)."""
    lengths = np.asarray(table.row_lengths(), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])[:-1]
    return lines_spanned(table._payload.ctypes.data, starts[ids], lengths[ids]) + (lengths.min() != lengths.max())


def tbe_lines(weights: torch.Tensor, ids: np.ndarray) -> float:
    """lines_spanned of rows `ids` of one of FBGEMM's tables (its rows back to back)."""
    row_bytes = weights.shape[1] * weights.element_size()
    return lines_spanned(weights.data_ptr(), ids.astype(np.int64) * row_bytes, row_bytes)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_set_args(p)
    p.add_argument("--rounds", type=int, default=60, help="timed rounds (default 60)")
    args = p.parse_args(argv)
    check_set_args(p, args, ("dim", "batch", "pooling", "rounds"))
    return args


def main(argv=None) -> dict:
    args = parse(sys.argv[1:] if argv is None else argv)
    common.steady_allocations()
    ts, weights, tbe = make_set(args)
    if tbe is None:
        raise SystemExit(f"headroom: FBGEMM has no CPU kernel for {args.dtype}")
    tables = [ibp_embed.compress(w, word_bits=args.word_bits, progress=False) for w in weights]
    whole = [uncompressed_table(w, args.word_bits) for w in weights]
    raw = [CompressedTable.raw(*as_rows(w), word_bits=args.word_bits) for w in weights]
    batch = make_batch(ts.rows, Workload(args.batch, args.pooling, None if args.dist == "uniform" else args.alpha),
                       0, ts.perm_seeds())
    fns = {"fbgemm": lambda: tbe(batch.values, batch.offsets),
           "ibp": lambda: ibp_embed.lookup_many(tables, batch.values, batch.offsets),
           "ibp uncompressed": lambda: ibp_embed.lookup_many(whole, batch.values, batch.offsets),
           "ibp raw": lambda: ibp_embed.lookup_many(raw, batch.values, batch.offsets)}
    with torch.no_grad(), common.threads(1):
        outs = {name: fn() for name, fn in fns.items()}
        for name in ("ibp uncompressed", "ibp raw"):
            if not torch.equal(outs["ibp"].view(torch.int32), outs[name].view(torch.int32)):
                raise SystemExit(f"headroom: the {name.split()[1]} tables' sums differ from the compressed tables'")
        if not torch.allclose(outs["ibp"], outs["fbgemm"], rtol=1e-4, atol=1e-4):
            raise SystemExit("headroom: ibp's sums differ from FBGEMM's")
        timed = common.time_interleaved(fns, repeats=args.rounds, shuffle=True)
    ids = [f[0] for f in batch.features]  # each table's ids
    lines = {"fbgemm": float(np.mean([tbe_lines(w, i) for w, i in zip(weights, ids)])),
             "ibp": float(np.mean([table_lines(t, i) for t, i in zip(tables, ids)])),
             "ibp uncompressed": float(np.mean([table_lines(t, i) for t, i in zip(whole, ids)])),
             "ibp raw": float(np.mean([table_lines(t, i) for t, i in zip(raw, ids)]))}
    fbgemm = np.asarray(timed["fbgemm"]["times_s"])
    lookups = int(batch.values.numel())
    got = {name: {"median_ms": t["median_s"] * 1e3, "min_ms": t["min_s"] * 1e3,
                  "ns_per_lookup_median": t["median_s"] * 1e9 / lookups,
                  "speed_vs_fbgemm_median": float(np.median(fbgemm / np.asarray(t["times_s"]))),
                  "lines_per_row": lines[name]}
           for name, t in timed.items()}
    label = (f"{args.dtype} d{args.dim} {args.init}, {len(ts.rows)} tables of {min(ts.rows)}-{max(ts.rows)} rows, "
             f"W {args.word_bits} (compression {sum(t.raw_nbytes for t in tables) / sum(t.nbytes for t in tables):.3f}x); "
             f"B{args.batch} x P{args.pooling} {'uniform' if args.dist == 'uniform' else f'Zipf {args.alpha:g}'}; "
             f"1 thread; {args.rounds} rounds; load average {common.load_average()}")
    print(label + "\n")
    print(common.markdown_table(
        ["system", "median ms", "min ms", "ns a lookup (median)", "speed / FBGEMM's (median of rounds)",
         "lines a row spans"],
        [[name, common.fmt(g["median_ms"], 3), common.fmt(g["min_ms"], 3), common.fmt(g["ns_per_lookup_median"], 1),
          common.fmt(g["speed_vs_fbgemm_median"], 3), common.fmt(g["lines_per_row"], 2)] for name, g in got.items()]))
    config = {k: v for k, v in vars(args).items() if k != "results_dir"}
    return common.save_runs("headroom", {**config, "label": label}, [got], args.results_dir)


if __name__ == "__main__":
    main()
