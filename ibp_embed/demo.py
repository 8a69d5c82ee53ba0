"""`make demo`: compress a generated Criteo-like table and run pooled lookups on it.

    python -m ibp_embed.demo [--rows N] [--dim D] [--dtype float32|bfloat16|float16]
                             [--init torchrec|normal|trained] [--threads T]

The default table is Criteo Kaggle's 4th categorical feature (2,202,608 ids) scaled
to half, dim 128, fp32, with TorchRec's default init. It is compressed with one mask
(K=1) and with up to 4 (K=4), decompressed and checked bit for bit, then pooled
lookups (batch 4096, pooling 20, Zipf 1.05 ids) run on the compressed tables and,
in the same run, with torch's embedding_bag on the uncompressed tensor.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from . import _native, compress, datasets, hostmem

DEFAULT_ROWS = datasets.CRITEO_KAGGLE_CARDINALITIES[3] // 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _table(headers, rows) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ibp_embed.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=DEFAULT_ROWS)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--init", choices=("torchrec", "normal", "trained"), default="torchrec")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="threads for torch and libibp (default: torch's)")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--alpha", type=float, default=1.05)
    a = p.parse_args(argv)
    if a.rows < 1 or a.dim < 1 or a.threads < 1:
        p.error("--rows, --dim and --threads must be positive")
    torch.set_num_threads(a.threads)
    _native.set_num_threads(a.threads)
    dtype = DTYPES[a.dtype]

    t = time.perf_counter()
    if a.init == "trained":
        weights = datasets.make_trained_like_table(a.rows, a.dim, dtype, alpha=a.alpha)
    else:
        weights = datasets.make_table(a.rows, a.dim, dtype, init=a.init)
    gen_s = time.perf_counter() - t
    # torch's embedding_bag reads the weights where torch put them, which asks for no huge
    # pages; the compressed tables' payloads have them (hostmem): both on huge pages, so
    # that the comparison is of the lookups, not of the pages
    raw = weights.numel() * weights.element_size()
    refused = not hostmem.collapse(weights.data_ptr(), raw)
    init = {"torchrec": "TorchRec init", "normal": "normal(0, 0.01)",
            "trained": "synthetic trained-like"}[a.init]
    print(f"ibp_embed demo: {a.rows:,} x {a.dim} {a.dtype} table ({raw / 1e6:,.0f} MB), {init}; "
          f"Criteo Kaggle C4 has {datasets.CRITEO_KAGGLE_CARDINALITIES[3]:,} rows. "
          f"Generated in {gen_s:.1f} s; {a.threads} thread(s).\n")

    tables, size_rows = {}, [["uncompressed", "-", "-", f"{raw / 1e6:,.1f}", "1.000", "-", "-", "-"]]
    for k in (1, 4):
        t = time.perf_counter()
        ct = compress(weights, clusters=k, progress=False)
        enc_s = time.perf_counter() - t
        exact = torch.equal(ct.decompress().view(torch.uint8), weights.view(torch.uint8))
        dec_s = _median_time(ct.decompress, 3)
        if not exact:
            raise SystemExit(f"K={k}: decompress() is NOT bit-exact")
        tables[f"ibp K={k}"] = ct
        size_rows.append([f"ibp K={k}", ct.word_bits, ct.clusters, f"{ct.nbytes / 1e6:,.1f}", f"{ct.ratio:.3f}",
                          f"{enc_s:.1f}", f"{raw / dec_s / 1e9:.2f}", "yes"])
    print(_table(["table", "W", "K kept", "MB", "ratio", "encode s", "decode GB/s", "bit-exact"], size_rows))
    print("(MB and ratio count everything needed to decode: payload, offsets index, masks; decode: "
          "decompress() of the whole table, median of 3.)\n")

    batches = [datasets.make_bags(a.rows, a.batch_size, a.pooling, a.alpha, seed=1 + b) for b in range(4)]
    n_ids = sum(i.numel() for i, _ in batches)
    engines = {"torch embedding_bag (uncompressed)":
               lambda i, o: F.embedding_bag(i, weights, o, mode="sum", include_last_offset=True)}
    for name, ct in tables.items():
        engines[name] = ct.lookup
    ref = F.embedding_bag(batches[0][0], weights.float(), batches[0][1], mode="sum",
                          include_last_offset=True) if dtype == torch.float32 else None
    rows, base = [], None
    for name, fn in engines.items():
        if ref is not None and name.startswith("ibp"):
            if not torch.allclose(fn(*batches[0]), ref, rtol=1e-4, atol=1e-6):
                raise SystemExit(f"{name}: pooled lookup differs from torch embedding_bag")
        s = _median_time(lambda fn=fn: [fn(i, o) for i, o in batches], 5)
        lps = n_ids / s
        base = base or lps
        rows.append([name, f"{s / len(batches) * 1e3:.2f}", f"{lps / 1e6:.1f}",
                     f"{lps * a.dim * weights.element_size() / 1e9:.2f}", f"{lps / base:.2f}x"])
    print(f"Pooled lookups (sum): batch {a.batch_size} x pooling {a.pooling}, Zipf({a.alpha}) ids, "
          f"{len(batches)} batches, median of 5:")
    print(_table(["engine", "ms/batch", "M lookups/s", "GB/s", "vs torch"], rows))
    if ref is not None:
        print("Pooled sums of the compressed tables match torch's embedding_bag.")
    if refused:
        print("(torch's weights stayed on the pages torch gave them: this kernel refused "
              "madvise(MADV_COLLAPSE), and lookups from memory on 4 KiB pages are slower.)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
