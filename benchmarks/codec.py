"""Codec benchmark: size and single-thread speed of ibp_embed against general codecs.

    python -m benchmarks.codec            # several million rows per table (make bench)
    python -m benchmarks.codec --quick    # small tables, a couple of minutes

On generated Criteo-like tables (ibp_embed.datasets: fp32 / bf16, dim 64 / 128,
TorchRec init, normal(0, 0.01), and a synthetic trained-like table) it measures in
one run, side by side:

- compression ratio, raw bytes / stored bytes with all metadata: ibp_embed (W auto,
  32, 64 with K = 1 and 4; W 16 with K = 1), zstd level 3 and lz4 on each row alone (random access needs
  that) with an 8-byte offset per row counted and a row that does not shrink stored
  raw (the rule ibp uses), and blosc2 shuffle + zstd on the whole table (no random
  access: a reference line);
- single-thread full decode, GB/s of decoded output (torch and libibp on 1 thread);
- single-thread pooled lookup (sum, Zipf ids): lookups/s and GB/s of rows pooled,
  for ibp's fused lookup, per-row zstd / lz4 decode of the batch's unique rows +
  torch embedding_bag, and plain torch embedding_bag on the uncompressed table.

Every timing is the median of --repeats runs after a warm-up. Per-row codecs are
sized on a uniform random sample of rows (--codec-sample; all rows when the table is
smaller) and their stores hold that sample plus every row the lookup batches touch;
zstd decodes through python-zstandard's C batch API (multi_decompress_to_buffer),
lz4 has none, so its rows are decoded in a Python loop. Results: a markdown table
on stdout and benchmarks/results/codec-<UTC time>.json.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import sys
import time

import blosc2
import lz4.block
import numpy as np
import torch
import torch.nn.functional as F
import zstandard

import ibp_embed
from ibp_embed import _native, datasets

from . import common

INITS = ("torchrec", "normal", "trained")
INIT_LABEL = {"torchrec": "torchrec init", "normal": "normal(0,0.01)", "trained": "trained-like"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
IBP_VARIANTS = ((None, 1), (16, 1), (32, 1), (64, 1), (None, 4), (32, 4), (64, 4))
OFFSET_BYTES = 8  # per-row index entry charged to per-row codecs


def variant_name(word_bits, clusters) -> str:
    return f"ibp W{word_bits or 'auto'} K{clusters}"


# ================================================================ tables and batches
def make_weights(init: str, n_rows: int, dim: int, dtype: torch.dtype, seed: int, alpha: float):
    if init == "trained":
        return datasets.make_trained_like_table(n_rows, dim, dtype, alpha=alpha, seed=seed)
    return datasets.make_table(n_rows, dim, dtype, init=init, seed=seed)


def make_batches(n_rows, n_batches, batch_size, pooling, alpha, seed):
    return [datasets.make_bags(n_rows, batch_size, pooling, alpha, seed=seed + 1000 + b)
            for b in range(n_batches)]


# ================================================================ per-row codec store
class PerRowStore:
    """Rows of a table compressed one by one (random access), for a subset of its rows.

    A row whose compressed form is not smaller than the raw row is kept raw. Raw rows
    sit in one contiguous array, compressed ones back to back in a payload; each row
    has one 8-byte index entry (charged in `stored_bytes`).
    """

    def __init__(self, rows: np.ndarray, codec: str):
        n, self.row_bytes = rows.shape
        self.codec = codec
        if codec == "zstd":
            comp = zstandard.ZstdCompressor(level=3, write_checksum=False, write_content_size=False,
                                            write_dict_id=False).compress
            self._dctx = zstandard.ZstdDecompressor()
        elif codec == "lz4":
            def comp(b):
                return lz4.block.compress(b, store_size=False)
        else:
            raise ValueError(codec)
        t0 = time.perf_counter()
        frames = [comp(r) for r in rows]
        self.encode_s = time.perf_counter() - t0
        self.lengths = np.fromiter(map(len, frames), np.int64, n)
        self.is_comp = self.lengths < self.row_bytes
        self.raw_rows = np.ascontiguousarray(rows[~self.is_comp])
        comp_lens = self.lengths[self.is_comp]
        self.payload = b"".join(f for f, c in zip(frames, self.is_comp) if c)
        starts = (np.cumsum(comp_lens) - comp_lens).astype(np.uint64)
        self.segments = np.stack([starts, comp_lens.astype(np.uint64)], axis=1)
        self.slot = np.empty(n, np.int64)
        self.slot[~self.is_comp] = np.arange(self.raw_rows.shape[0])
        self.slot[self.is_comp] = np.arange(comp_lens.size)

    def stored_bytes(self, members: np.ndarray | None = None) -> int:
        """Bytes to store the given local rows (all by default), index entries included."""
        lens = self.lengths if members is None else self.lengths[members]
        return int(np.minimum(lens, self.row_bytes).sum()) + OFFSET_BYTES * lens.size

    def decode(self, local: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows `local` (int64 local ids) as a [len(local), row_bytes] uint8 array."""
        m = local.size
        if out is None:
            out = np.empty((m, self.row_bytes), np.uint8)
        comp = self.is_comp[local]
        slots = self.slot[local]
        if not comp.any():
            np.take(self.raw_rows, slots, axis=0, out=out)
            return out
        raw_at = np.flatnonzero(~comp)
        out[raw_at] = self.raw_rows[slots[raw_at]]
        comp_at = np.flatnonzero(comp)
        out[comp_at] = self._decode_compressed(slots[comp_at])
        return out

    def _decode_compressed(self, slots: np.ndarray) -> np.ndarray:
        r, m = self.row_bytes, slots.size
        segs = self.segments[slots]
        if self.codec == "lz4":
            mv, dec = memoryview(self.payload), lz4.block.decompress
            data = b"".join([dec(mv[s:s + n], uncompressed_size=r) for s, n in segs.tolist()])
            return np.frombuffer(data, np.uint8).reshape(m, r)
        res = self._dctx.multi_decompress_to_buffer(
            zstandard.BufferWithSegments(self.payload, segs.tobytes()),
            decompressed_sizes=np.full(m, r, np.uint64).tobytes(), threads=1)
        # threads=1 decodes into one contiguous buffer; view it without a per-row copy.
        if len(res) == m and res[m - 1].offset == (m - 1) * r:
            addr = np.frombuffer(res[0], np.uint8).ctypes.data
            view = np.ctypeslib.as_array((ctypes.c_uint8 * (m * r)).from_address(addr))
            return view.reshape(m, r).copy()
        return np.frombuffer(b"".join(res[i].tobytes() for i in range(m)), np.uint8).reshape(m, r)


# ================================================================ measurements
def ibp_decode_into(table, out: np.ndarray) -> None:
    """Decode the whole table into a preallocated buffer (codec speed, no allocation)."""
    _native.check(_native.lib.ibp_decode(table._c, _native.ffi.NULL, 0,
                                         _native.ptr(out, "uint8_t *")), "decode")


def lookup_rate(fn, batches, row_bytes, repeats):
    def run():
        for idx, off in batches:
            fn(idx, off)
    t = common.time_runs(run, repeats)
    ids = sum(int(i.numel()) for i, _ in batches)
    return {"lookups_per_s": ids / t["median_s"], "gbps": ids * row_bytes / t["median_s"] / 1e9,
            "batch_ms": t["median_s"] / len(batches) * 1e3, "times_s": t["times_s"]}


def bench_table(cfg, args, batches_cache) -> dict:
    init, dtype_name, dim, n_rows = cfg["init"], cfg["dtype"], cfg["dim"], cfg["rows"]
    dtype = DTYPES[dtype_name]
    t0 = time.perf_counter()
    weights = make_weights(init, n_rows, dim, dtype, args.seed, args.alpha)
    rows = weights.view(torch.uint8).reshape(n_rows, -1).numpy()
    row_bytes = rows.shape[1]
    raw_nbytes = rows.nbytes
    phases = {"generate": time.perf_counter() - t0}
    res = {**cfg, "row_bytes": row_bytes, "raw_nbytes": raw_nbytes,
           "generate_s": phases["generate"], "phases_s": phases, "ibp": {}, "baselines": {}}
    clock = time.perf_counter()

    def phase(name):
        nonlocal clock
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - clock
        clock = now

    key = (n_rows,)
    if key not in batches_cache:
        batches_cache.clear()
        batches_cache[key] = make_batches(n_rows, args.batches, args.batch_size, args.pooling,
                                          args.alpha, args.seed)
    batches = batches_cache[key]
    out = np.empty_like(rows)
    out.fill(0)  # fault the pages in before anything is timed

    phase("batches")

    # ---- ibp_embed: every variant; throughput once per distinct encoded table
    measured = {}  # (word_bits, clusters, nbytes) -> throughput dict
    auto_w = {}
    for word_bits, clusters in IBP_VARIANTS:
        name = variant_name(word_bits, clusters)
        if word_bits is not None and auto_w.get(clusters, (None,))[0] == word_bits:
            # compress() is deterministic: the fixed-W table is the auto one, not encoded twice
            res["ibp"][name] = {**res["ibp"][variant_name(None, clusters)], "word_bits_requested": word_bits,
                                "encode_s": None, "same_as": variant_name(None, clusters)}
            continue
        t = time.perf_counter()
        table = ibp_embed.compress(weights, word_bits=word_bits, clusters=clusters, progress=False)
        enc_s = time.perf_counter() - t
        entry = {"word_bits_requested": word_bits, "clusters_requested": clusters,
                 "word_bits": table.word_bits, "clusters": table.clusters, "nbytes": table.nbytes,
                 "ratio": table.ratio, "encode_s": enc_s, "encode_threads": torch.get_num_threads()}
        if word_bits is None:
            auto_w[clusters] = (table.word_bits,)
        phase("ibp_encode")
        tkey = (table.word_bits, table.clusters, table.nbytes)
        if tkey in measured:
            entry.update(measured[tkey])
        else:
            with common.threads(1):
                d = common.time_runs(lambda: ibp_decode_into(table, out), args.repeats)
                exact = bool(np.array_equal(out, rows))
                api = common.time_runs(table.decompress, max(1, args.repeats // 2))
                idx0, off0 = batches[0]
                got = table.lookup(idx0, off0)
                uniq, inv = torch.unique(idx0, return_inverse=True)
                ref = F.embedding_bag(inv, weights[uniq].float(), off0, mode="sum", include_last_offset=True)
                lookup_ok = bool(torch.allclose(got, ref, rtol=1e-4, atol=1e-5))
                lk = lookup_rate(table.lookup, batches, row_bytes, args.repeats)
            thr = {"decode_gbps": raw_nbytes / d["median_s"] / 1e9, "decode_times_s": d["times_s"],
                   "decompress_api_gbps": raw_nbytes / api["median_s"] / 1e9, "bit_exact": exact,
                   "lookup_matches_torch": lookup_ok, "lookup": lk}
            measured[tkey] = thr
            entry.update(thr)
        res["ibp"][name] = entry
        del table
        gc.collect()
        phase("ibp_measure")

    # ---- per-row zstd / lz4 over a uniform sample plus the rows the batches touch
    rng = np.random.default_rng(args.seed)
    sample = np.arange(n_rows) if n_rows <= args.codec_sample else \
        np.sort(rng.choice(n_rows, args.codec_sample, replace=False))
    touched = torch.unique(torch.cat([i for i, _ in batches])).numpy()
    members = np.union1d(sample, touched)
    local_of = torch.full((n_rows,), -1, dtype=torch.int64)
    local_of[torch.from_numpy(members)] = torch.arange(members.size)
    sample_local = np.searchsorted(members, sample)
    sub = np.ascontiguousarray(rows[members])
    sample_out = np.empty((sample.size, row_bytes), np.uint8)
    sample_out.fill(0)
    for codec in ("zstd", "lz4"):
        phase("other")
        store = PerRowStore(sub, codec)
        phase("rowcodec_encode")
        stored = store.stored_bytes(sample_local)

        def rowstore_lookup(idx, off, store=store):
            uniq, inv = torch.unique(idx, return_inverse=True)
            got = store.decode(local_of[uniq].numpy())
            w = torch.from_numpy(got).view(dtype).reshape(-1, dim)
            return F.embedding_bag(inv, w, off, mode="sum", include_last_offset=True)

        with common.threads(1):
            d = common.time_runs(lambda: store.decode(sample_local, sample_out), args.repeats)
            exact = bool(np.array_equal(sample_out, rows[sample]))
            lk = lookup_rate(rowstore_lookup, batches, row_bytes, args.repeats)
        res["baselines"][f"{codec}/row"] = {
            "ratio": sample.size * row_bytes / stored, "sampled_rows": int(sample.size),
            "rows_compressed_fraction": float(store.is_comp[sample_local].mean()),
            "encode_s_per_row": store.encode_s / members.size,
            "decode_gbps": sample.size * row_bytes / d["median_s"] / 1e9, "decode_times_s": d["times_s"],
            "bit_exact": exact, "lookup": lk,
            "settings": "zstd level 3, one frame per row, no checksum / content size"
            if codec == "zstd" else "lz4.block default mode, no stored size"}
        del store
        gc.collect()
        phase("rowcodec_measure")
    del sub, sample_out

    # ---- blosc2 on the whole table (no random access)
    flat = rows.reshape(-1)
    t = time.perf_counter()
    sc = blosc2.SChunk(chunksize=args.blosc_chunk, data=flat,
                       cparams=blosc2.CParams(codec=blosc2.Codec.ZSTD, clevel=args.blosc_clevel,
                                              filters=[blosc2.Filter.SHUFFLE], typesize=dtype.itemsize,
                                              nthreads=torch.get_num_threads()),
                       dparams=blosc2.DParams(nthreads=1))
    enc_s = time.perf_counter() - t
    phase("blosc2_encode")
    out_flat = out.reshape(-1)
    csize = args.blosc_chunk

    def blosc_decode():
        for c in range(sc.nchunks):
            sc.decompress_chunk(c, out_flat[c * csize:(c + 1) * csize])

    with common.threads(1):
        old_blosc = blosc2.set_nthreads(1)
        try:
            d = common.time_runs(blosc_decode, args.repeats)
        finally:
            blosc2.set_nthreads(old_blosc)
    res["baselines"]["blosc2/table"] = {
        "ratio": raw_nbytes / sc.cbytes, "nbytes": sc.cbytes, "encode_s": enc_s,
        "decode_gbps": raw_nbytes / d["median_s"] / 1e9, "decode_times_s": d["times_s"],
        "bit_exact": bool(np.array_equal(out, rows)),
        "settings": f"SChunk {csize >> 20} MiB chunks, zstd clevel {args.blosc_clevel}, shuffle"}
    del sc
    phase("blosc2_measure")

    # ---- uncompressed references: memcpy and torch embedding_bag
    with common.threads(1):
        d = common.time_runs(lambda: np.copyto(out, rows), args.repeats)
        lk = lookup_rate(lambda i, o: F.embedding_bag(i, weights, o, mode="sum", include_last_offset=True),
                         batches, row_bytes, args.repeats)
    res["baselines"]["uncompressed"] = {"ratio": 1.0, "decode_gbps": raw_nbytes / d["median_s"] / 1e9,
                                        "decode_times_s": d["times_s"], "lookup": lk,
                                        "settings": "decode = memcpy; lookup = torch embedding_bag"}
    phase("uncompressed_measure")
    torch_lps = lk["lookups_per_s"]
    for v in res["ibp"].values():
        v["lookup_vs_torch"] = v["lookup"]["lookups_per_s"] / torch_lps
        v["ratio_vs_zstd_row"] = v["ratio"] / res["baselines"]["zstd/row"]["ratio"]
        v["ratio_vs_blosc2"] = v["ratio"] / res["baselines"]["blosc2/table"]["ratio"]
    for name in ("zstd/row", "lz4/row"):
        b = res["baselines"][name]
        b["lookup_vs_torch"] = b["lookup"]["lookups_per_s"] / torch_lps
    del out, weights, rows
    gc.collect()
    return res


# ================================================================ report
def table_label(r) -> str:
    dt = {"float32": "fp32", "bfloat16": "bf16"}[r["dtype"]]
    return f"{dt} d{r['dim']} {INIT_LABEL[r['init']]}"


def ratio_cell(e) -> str:
    extra = "" if e["clusters_requested"] == 1 or e["clusters"] == e["clusters_requested"] \
        else f" k{e['clusters']}"
    if e["word_bits_requested"] is None:
        extra = f" w{e['word_bits']}" + extra
    return f"{e['ratio']:.3f}{extra}"


def report(results, params) -> str:
    n_rows = sorted({r["rows"] for r in results})
    m = params["machine"]
    lines = [f"## Codec benchmark: {', '.join(f'{n:,}' for n in n_rows)} rows per table, "
             f"{params['machine']['cpu_model']}, single thread for all speeds", "",
             f"Run {params['started_utc']}, commit {(m['git_commit'] or '?')[:10]}"
             f"{' (dirty)' if m['git_dirty'] else ''}, libibp {m['libibp_sha256_16']}, "
             f"torch {m['versions']['torch']}, numpy {m['versions']['numpy']}, "
             f"{m['cpus_usable']} usable CPUs.", ""]
    lines.append("Compression ratio (raw / stored, all metadata; per-row codecs pay an 8-byte offset "
                  "per row and store a row raw when it does not shrink; blosc2 compresses the whole table, "
                  "no random access). `w`: word size auto picked; `kN`: clusters kept when fewer "
                  "than asked.")
    lines.append("")
    heads = ["table"] + [variant_name(w, k).removeprefix("ibp ") for w, k in IBP_VARIANTS] + \
        ["zstd-3/row", "lz4/row", "blosc2/table", "ibp enc s K1/K4"]
    rows = []
    for r in results:
        ib, bl = r["ibp"], r["baselines"]
        rows.append([table_label(r)] + [ratio_cell(ib[variant_name(w, k)]) for w, k in IBP_VARIANTS] +
                    [f"{bl['zstd/row']['ratio']:.3f}", f"{bl['lz4/row']['ratio']:.3f}",
                     f"{bl['blosc2/table']['ratio']:.3f}",
                     f"{ib['ibp Wauto K1']['encode_s']:.1f}/{ib['ibp Wauto K4']['encode_s']:.1f}"])
    lines += [common.markdown_table(heads, rows), ""]

    lines.append("Full decode, GB/s of output (ibp: native decode into a preallocated buffer; "
                 "`api`: `decompress()` including its allocation).")
    lines.append("")
    heads = ["table", "ibp W16", "ibp W32", "ibp W64", "ibp auto K4", "ibp api", "zstd-3/row", "lz4/row",
             "blosc2/table", "memcpy"]
    rows = []
    for r in results:
        ib, bl = r["ibp"], r["baselines"]
        rows.append([table_label(r), common.fmt(ib["ibp W16 K1"]["decode_gbps"]),
                     common.fmt(ib["ibp W32 K1"]["decode_gbps"]),
                     common.fmt(ib["ibp W64 K1"]["decode_gbps"]),
                     common.fmt(ib["ibp Wauto K4"]["decode_gbps"]),
                     common.fmt(ib["ibp Wauto K1"]["decompress_api_gbps"])] +
                    [common.fmt(bl[b]["decode_gbps"]) for b in ("zstd/row", "lz4/row", "blosc2/table",
                                                                  "uncompressed")])
    lines += [common.markdown_table(heads, rows), ""]

    lines.append(f"Pooled lookup (sum), batch {params['batch_size']} x pooling {params['pooling']}, "
                 f"Zipf {params['alpha']} ids: M lookups/s (GB/s of rows pooled). Per-row codecs decode "
                 "each batch's unique rows, then torch embedding_bag.")
    lines.append("")
    heads = ["table", "torch (raw)", "ibp W32", "ibp W64", "ibp auto K4", "zstd-3/row", "lz4/row",
             "ibp auto K1 / torch"]
    rows = []

    def cell(e):
        return f"{e['lookup']['lookups_per_s'] / 1e6:.1f} ({e['lookup']['gbps']:.2f})"

    for r in results:
        ib, bl = r["ibp"], r["baselines"]
        rows.append([table_label(r), cell(bl["uncompressed"]), cell(ib["ibp W32 K1"]), cell(ib["ibp W64 K1"]),
                     cell(ib["ibp Wauto K4"]), cell(bl["zstd/row"]), cell(bl["lz4/row"]),
                     f"{ib['ibp Wauto K1']['lookup_vs_torch']:.2f}x"])
    lines += [common.markdown_table(heads, rows), ""]
    return "\n".join(lines)


def check_targets(results) -> dict:
    """The issue's targets, as measured in this run."""
    dec = [(table_label(r), r["ibp"]["ibp Wauto K1"]["decode_gbps"]) for r in results
           if r["dtype"] == "float32" and r["dim"] == 128]
    per_w = [(f"{table_label(r)} W{w}", r["ibp"][variant_name(w, 1)]["decode_gbps"]) for r in results
             for w in (16, 32, 64) if r["dtype"] == "float32" and r["dim"] == 128]
    norm = [(table_label(r), max(v["ratio"] for v in r["ibp"].values())) for r in results
            if r["dtype"] == "float32" and r["init"] == "normal"]
    kk = []
    for r in results:
        for w in (None, 32, 64):
            k1, k4 = r["ibp"][variant_name(w, 1)]["ratio"], r["ibp"][variant_name(w, 4)]["ratio"]
            kk.append((f"{table_label(r)} W{w or 'auto'}", k1, k4))
    exact = all(e["bit_exact"] for r in results for e in list(r["ibp"].values()) + list(r["baselines"].values())
                if "bit_exact" in e)
    lookups_ok = all(e["lookup_matches_torch"] for r in results for e in r["ibp"].values())
    return {
        "decode_fp32_d128_ge_2gbps": {"met": all(g >= 2.0 for _, g in dec) if dec else None,
                                      "values": {k: v for k, v in dec}},
        "decode_fp32_d128_ge_10gbps_every_w": {"met": all(g >= 10.0 for _, g in per_w) if per_w else None,
                                               "values": {k: v for k, v in per_w}},
        "ratio_normal_fp32_ge_1.10": {"met": all(x >= 1.10 for _, x in norm) if norm else None,
                                      "values": {k: v for k, v in norm}},
        "k4_ratio_ge_k1_every_table": {"met": all(k4 >= k1 for _, k1, k4 in kk),
                                       "failures": [k for k, k1, k4 in kk if k4 < k1]},
        "all_bit_exact": exact,
        "ibp_lookups_match_torch": lookups_ok,
    }


def format_targets(t) -> str:
    def yn(b):
        return "n/a (not in this run)" if b is None else "met" if b else "NOT met"

    def vals(v):
        return f" ({', '.join(f'{k}: {x}' for k, x in v.items())})" if v else ""

    d = t["decode_fp32_d128_ge_2gbps"]
    d10 = t["decode_fp32_d128_ge_10gbps_every_w"]
    n = t["ratio_normal_fp32_ge_1.10"]
    k = t["k4_ratio_ge_k1_every_table"]
    return "\n".join([
        "Targets (issue 2):",
        f"- decode fp32 dim 128 >= 2 GB/s per core: {yn(d['met'])}"
        + vals({k_: f"{v:.2f}" for k_, v in d["values"].items()}),
        f"- ratio >= 1.10 on normal(0,0.01) fp32: {yn(n['met'])}"
        + vals({k_: f"{v:.3f}" for k_, v in n["values"].items()}),
        f"- K=4 ratio >= K=1 ratio on every table and W: {yn(k['met'])}"
        + (f" (fails: {', '.join(k['failures'])})" if k["failures"] else ""),
        f"- every decode bit-exact: {yn(t['all_bit_exact'])}; ibp lookups equal torch: "
        f"{yn(t['ibp_lookups_match_torch'])}",
        "Targets (issue 11):",
        f"- decode fp32 dim 128 >= 10 GB/s per core for every word size (K=1): {yn(d10['met'])}"
        + vals({k_: f"{v:.2f}" for k_, v in d10["values"].items()}),
    ])


# ================================================================ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.codec", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small tables and fewer repeats (a couple of minutes)")
    p.add_argument("--rows", type=int, help="rows per table (default 4,000,000; --quick 65,536)")
    p.add_argument("--dims", default="64,128")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--inits", default=",".join(INITS))
    p.add_argument("--repeats", type=int, help="timed runs per measurement, median reported (default 5; --quick 3)")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of lookup ids (and trained-like table)")
    p.add_argument("--batches", type=int, help="distinct batches per timed lookup run (default 4; --quick 2)")
    p.add_argument("--codec-sample", type=int, default=1 << 18,
                   help="rows sampled to size per-row codecs (default 262144)")
    p.add_argument("--blosc-clevel", type=int, default=1, help="blosc2 zstd level (1 compressed best here)")
    p.add_argument("--blosc-chunk", type=int, default=4 << 20, help="blosc2 chunk bytes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-json", action="store_true", help="do not write benchmarks/results/*.json")
    a = p.parse_args(argv)
    a.rows = a.rows or (65_536 if a.quick else 4_000_000)
    a.repeats = a.repeats or (3 if a.quick else 5)
    a.batches = a.batches or (2 if a.quick else 4)
    a.dims = [int(x) for x in a.dims.split(",")]
    a.dtypes = a.dtypes.split(",")
    a.inits = a.inits.split(",")
    for x in a.dtypes:
        if x not in DTYPES:
            p.error(f"--dtypes: {x!r} is not one of {sorted(DTYPES)}")
    for x in a.inits:
        if x not in INITS:
            p.error(f"--inits: {x!r} is not one of {INITS}")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    stamp = common.utc_stamp()
    started = time.perf_counter()
    params = {k: v for k, v in vars(args).items() if k != "no_json"}
    params["machine"] = common.machine_info()
    params["ibp_variants"] = [variant_name(w, k) for w, k in IBP_VARIANTS]
    params["started_utc"] = stamp
    params["threads_for_speed"] = 1
    params["threads_for_encode"] = torch.get_num_threads()
    configs = [{"init": i, "dtype": d, "dim": dim, "rows": args.rows}
               for i in args.inits for d in args.dtypes for dim in sorted(args.dims, reverse=True)]
    results, batches_cache = [], {}
    for n, cfg in enumerate(configs, 1):
        t = time.perf_counter()
        print(f"[{n}/{len(configs)}] {table_label(cfg)}, {cfg['rows']:,} rows ...", end=" ", file=sys.stderr,
              flush=True)
        r = bench_table(cfg, args, batches_cache)
        r["wall_s"] = time.perf_counter() - t
        print(f"{r['wall_s']:.0f} s (" + ", ".join(f"{k} {v:.0f}" for k, v in r["phases_s"].items()) + ")",
              file=sys.stderr, flush=True)
        results.append(r)
    targets = check_targets(results)
    text = report(results, params) + "\n" + format_targets(targets)
    print(text)
    params["wall_s"] = time.perf_counter() - started
    if not args.no_json:
        path = common.write_json({"benchmark": "codec", "params": params, "results": results,
                                  "targets": targets, "markdown": text}, "codec", stamp)
        print(f"\nresults: {common.shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
