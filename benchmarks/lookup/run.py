"""One table set: build and size its tables, then time every system on every workload."""
from __future__ import annotations

import gc
import time

import numpy as np
import torch
import torch.nn.functional as F

import ibp_embed

from .. import common
from .codec_sizes import (
    BLOSC_CHUNK,
    BLOSC_CLEVEL,
    blosc2_size,
    per_row_codec_sizes,
    zipnn_available,
    zipnn_size,
)
from .names import (
    BATCHED,
    DTYPE_SHORT,
    EBC_VARIANTS,
    FBGEMM,
    HEADLINE,
    IBP_VARIANTS,
    TORCH_RAW,
    TORCHREC,
    ebc_name,
    lookup_name,
    pair_of,
)
from .systems import ibp_ebc, reference_output, set_weights, torchrec_fused_ebc
from .tables import TableSet
from .workloads import batch_host_bytes, index_bytes_per_row, make_batch


def run_table_set(ts: TableSet, workloads, args, log) -> dict:
    """Build one table set, size it with every codec, time every system on every workload."""
    sw = common.Stopwatch()
    n_tables = len(ts.rows)
    res = {"table_set": ts.name, "label": ts.label, "init": ts.init, "dtype": DTYPE_SHORT[ts.dtype],
           "dims": ts.dims, "rows": ts.rows, "n_tables": n_tables, "raw_bytes": ts.raw_bytes,
           "source": ts.source, "phases_s": {}}
    clock = [time.perf_counter()]

    def phase(name):
        now = time.perf_counter()
        res["phases_s"][name] = res["phases_s"].get(name, 0.0) + now - clock[0]
        clock[0] = now

    # ---- weights: inside the TBE when FBGEMM has a kernel for the dtype (shared by TorchRec)
    tbe, weights = set_weights(ts)
    fused = None
    if tbe is not None:
        fused = torchrec_fused_ebc(tbe, ts.dims)
        res["fbgemm_collapse_refused"] = tbe.collapse_refused  # its weights left on 4 KiB pages
    else:
        res["fbgemm_unavailable"] = f"FBGEMM {common._version('fbgemm_gpu')} CPU (HOST) kernel has no " \
                                    f"{DTYPE_SHORT[ts.dtype]} weights"
    row_bytes = [d * ts.dtype.itemsize for d in ts.dims]
    phase("generate")

    # ---- ibp variants (all threads for encoding)
    variants = {}
    res["ibp"] = {}
    for wb, k in IBP_VARIANTS:
        t0 = time.perf_counter()
        tabs = [ibp_embed.compress(w, word_bits=wb, clusters=k, progress=False) for w in weights]
        enc = time.perf_counter() - t0
        nbytes = sum(t.nbytes for t in tabs)
        name = f"W{wb} K{k}"
        entry = {"word_bits": wb, "clusters_asked": k, "clusters_kept": [t.clusters for t in tabs],
                 "nbytes": nbytes, "ratio": ts.raw_bytes / nbytes, "encode_s": enc,
                 "encode_mb_per_s": ts.raw_bytes / enc / 1e6,
                 "table_ratios": [t.ratio for t in tabs]}
        same = next((n for n, v in variants.items() if v["word_bits"] == wb and
                     all(a.nbytes == b.nbytes and a.clusters == b.clusters for a, b in zip(v["tables"], tabs))),
                    None)
        if same is not None:
            entry["same_as"] = same  # K4 kept one cluster everywhere: the K1 tables
            tabs = variants[same]["tables"]
        variants[name] = {"word_bits": wb, "clusters": k, "tables": tabs, "same_as": same,
                          "row_lengths": [t.row_lengths() for t in tabs]}
        res["ibp"][name] = entry
        log(f"  ibp {name}: ratio {entry['ratio']:.3f}, encode {enc:.1f} s"
            + (f" (same tables as {same})" if same else ""))
    phase("ibp_encode")

    # ---- size-only baselines, per table
    base = {"zstd/row": 0.0, "lz4/row": 0.0, "blosc2/table": 0.0}
    enc_s = {k: 0.0 for k in base}
    zipnn_ok = zipnn_available() is not None and not args.no_zipnn
    if zipnn_ok:
        base["zipnn/table"] = 0.0
        enc_s["zipnn/table"] = 0.0
    per_table = {k: [] for k in base}
    zipnn_exact = True
    for t, w in enumerate(weights):
        rows_u8 = w.detach().contiguous().view(torch.uint8).reshape(w.shape[0], -1).numpy()
        raw_t = rows_u8.nbytes
        pr = per_row_codec_sizes(rows_u8, args.codec_sample, seed=t)
        for codec in ("zstd", "lz4"):
            base[f"{codec}/row"] += pr[codec]["nbytes"]
            enc_s[f"{codec}/row"] += pr[codec]["encode_s"]
            per_table[f"{codec}/row"].append(raw_t / pr[codec]["nbytes"])
        b2 = blosc2_size(rows_u8, ts.dtype.itemsize)
        base["blosc2/table"] += b2["nbytes"]
        enc_s["blosc2/table"] += b2["encode_s"]
        per_table["blosc2/table"].append(raw_t / b2["nbytes"])
        if zipnn_ok:
            zn = zipnn_size(rows_u8, ts.dtype, verify=not args.quick)
            base["zipnn/table"] += zn["nbytes"]
            enc_s["zipnn/table"] += zn["encode_s"]
            per_table["zipnn/table"].append(raw_t / zn["nbytes"])
            zipnn_exact &= zn.get("bit_exact", True)
    res["baselines"] = {k: {"nbytes": v, "ratio": ts.raw_bytes / v, "encode_s": enc_s[k],
                            "table_ratios": per_table[k]} for k, v in base.items()}
    res["baselines"]["zstd/row"]["settings"] = "zstd level 3 per row, 8-byte offset per row, " \
        f"sampled {args.codec_sample} rows per table (estimated encode time)"
    res["baselines"]["lz4/row"]["settings"] = "lz4.block per row, 8-byte offset per row, sampled"
    res["baselines"]["blosc2/table"]["settings"] = f"SChunk {BLOSC_CHUNK >> 20} MiB chunks, zstd " \
        f"clevel {BLOSC_CLEVEL}, shuffle; no random access"
    if zipnn_ok:
        res["baselines"]["zipnn/table"]["settings"] = "zipnn byte mode on the whole table, defaults; no " \
            "random access"
        res["baselines"]["zipnn/table"]["bit_exact"] = zipnn_exact if not args.quick else None
    phase("codec_sizes")

    res["memory_bytes"] = {FBGEMM: ts.raw_bytes if tbe is not None else None,
                           TORCHREC: ts.raw_bytes if tbe is not None else None,
                           "raw (torch)": ts.raw_bytes}
    for name, v in variants.items():
        res["memory_bytes"][f"ibp {name}"] = sum(t.nbytes for t in v["tables"])

    # ---- systems
    systems = {}
    if tbe is not None:
        systems[FBGEMM] = lambda b: tbe(b.values, b.offsets)
        systems[TORCHREC] = lambda b: fused(b.kjt).values()
    systems[TORCH_RAW] = lambda b: torch.cat([
        F.embedding_bag(torch.from_numpy(ids), w, torch.from_numpy(off), mode="sum", include_last_offset=True)
        for w, (ids, off) in zip(weights, b.features)], dim=1)

    def lookup_fn(tabs):
        return lambda b: torch.cat([tab.lookup(ids, off) for tab, (ids, off) in zip(tabs, b.features)], dim=1)

    def lookup_many_fn(tabs):
        return lambda b: ibp_embed.lookup_many(tabs, [ids for ids, _ in b.features], [off for _, off in b.features])

    for wb, k in IBP_VARIANTS:
        v = variants[f"W{wb} K{k}"]
        if v["same_as"] is None:
            systems[lookup_name(wb, k)] = lookup_fn(v["tables"])
    systems[BATCHED] = lookup_many_fn(variants["W64 K1"]["tables"])
    for wb, k in EBC_VARIANTS:
        v = variants[f"W{wb} K{k}"]
        if v["same_as"] is None:
            m = ibp_ebc(v["tables"], ts.dims, ts.dtype)
            systems[ebc_name(wb, k)] = (lambda m: lambda b: m(b.kjt).values())(m)
    aliases = {}  # system not timed -> the system it equals
    for wb, k in IBP_VARIANTS:
        same = variants[f"W{wb} K{k}"]["same_as"]
        if same is not None:
            sw_, sk = (int(x[1:]) for x in same.split())
            aliases[lookup_name(wb, k)] = lookup_name(sw_, sk)
            if (wb, k) in EBC_VARIANTS:
                aliases[ebc_name(wb, k)] = ebc_name(sw_, sk)
    res["systems_aliased"] = aliases

    res["workloads"] = []
    for work in workloads:
        wres = run_workload(ts, work, weights, row_bytes, variants, systems, aliases, args, log)
        res["workloads"].append(wres)
        phase("lookups")
    res["wall_s"] = sw()
    return res  # the tables go with this frame; main() collects


def run_workload(ts, work, weights, row_bytes, variants, systems, aliases, args, log) -> dict:
    t_start = time.perf_counter()
    seeds = [args.seed + 7919 * b for b in range(args.batches)]
    perm = ts.perm_seeds()
    batches = [make_batch(ts.rows, work, s, perm) for s in seeds]
    dims_sum = sum(ts.dims)
    ids_per_batch = sum(int(b.values.numel()) for b in batches) / len(batches)
    out_bytes_per_batch = work.batch * dims_sum * 4
    raw_row_bytes_per_batch = np.mean([sum(ids.size * rb for (ids, _), rb in zip(b.features, row_bytes))
                                       for b in batches])

    # ---- host-byte model, averaged over the batches
    idx_b = [index_bytes_per_row(rb) for rb in row_bytes]
    model = {}
    for name, v in variants.items():
        per = [batch_host_bytes([ids for ids, _ in b.features], row_bytes, v["row_lengths"], idx_b, b.uniques)
               for b in batches]
        model[f"ibp {name}"] = float(np.mean([p["ibp"] for p in per]))
        model["fbgemm UVM"] = float(np.mean([p["uvm"] for p in per]))
        model["dedup raw"] = float(np.mean([p["dedup_raw"] for p in per]))
        model["distinct_fraction"] = float(np.mean([p["distinct"] / p["ids"] for p in per]))

    # ---- correctness on the first batch, against torch on the raw weights (also the warm-up pass)
    n_threads = work.threads or args.threads
    ref = reference_output(weights, batches[0])
    matches = {}
    with torch.no_grad(), common.threads(n_threads):
        for name, fn in systems.items():
            got = fn(batches[0])
            # torch's embedding_bag on 16-bit weights returns 16-bit sums: compare at that precision
            tol = dict(rtol=1e-4, atol=1e-5) if got.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
            matches[name] = bool(got.shape == ref.shape and torch.allclose(got.float(), ref, **tol))
    bad = [n for n, ok in matches.items() if not ok]
    if bad:
        log(f"  WARNING {work.name}: outputs differ from torch's embedding_bag: {bad}")

    # ---- timing: systems interleaved pass by pass (fairer ratios on a shared machine)
    gc.collect()
    with torch.no_grad(), common.threads(n_threads):
        timing = common.time_interleaved({name: (lambda fn=fn: [fn(b) for b in batches])
                                          for name, fn in systems.items()}, repeats=args.repeats, warmup=0,
                                          shuffle=True)
    sysres = {}
    for name in list(systems) + list(aliases):
        src = aliases.get(name, name)
        t = timing[src]
        s = t["median_s"] / len(batches)
        entry = {"batch_s": s, "lookups_per_s": ids_per_batch / s, "pooled_output_gbps": out_bytes_per_batch / s / 1e9,
                 "raw_rows_gbps": raw_row_bytes_per_batch / s / 1e9, "times_s": t["times_s"],
                 "matches_reference": matches[src]}
        if src != name:
            entry["same_as"] = src
        sysres[name] = entry
    ratios = {}
    for name, e in sysres.items():
        p = pair_of(name)
        if p is not None:
            # a round's ratio sets the pair side by side in one stretch of machine load: their median
            # holds when the load moves between rounds (the ratio of the medians need not)
            per_round = [a / b for a, b in zip(sysres[p]["times_s"], e["times_s"])] if p in sysres else None
            r = float(np.median(per_round)) if per_round else None
            e["ibp_vs_fbgemm_throughput_ratio"] = r
            e["ibp_vs_fbgemm_round_ratios"] = per_round
            e["paired_with"] = p
            e["ibp_vs_torch_raw_throughput_ratio"] = sysres[TORCH_RAW]["batch_s"] / e["batch_s"]
            ratios[name] = r
    wres = {"workload": work.name, "batch": work.batch, "pooling": work.pooling,
            "poolings": work.poolings(len(ts.rows)), "alpha": work.alpha, "ids": "uniform" if work.alpha is None
            else "zipf", "batches": len(batches), "repeats": args.repeats, "threads": n_threads,
            "load_average_after": common.load_average(),
            "ids_per_batch": ids_per_batch, "pooled_output_bytes_per_batch": out_bytes_per_batch,
            "host_bytes_per_batch_model": model, "systems": sysres,
            "ibp_vs_fbgemm_throughput_ratio": ratios.get(HEADLINE),
            "ibp_vs_fbgemm_throughput_ratios": ratios, "wall_s": time.perf_counter() - t_start}
    if FBGEMM not in sysres:
        wres["ibp_vs_fbgemm_unavailable"] = f"FBGEMM {common._version('fbgemm_gpu')} has no CPU (HOST) kernel " \
                                            f"for {DTYPE_SHORT[ts.dtype]} weights"
    hl = sysres.get(HEADLINE, {})
    fb = sysres.get(FBGEMM)
    log(f"  {work.name}: {HEADLINE} {hl.get('lookups_per_s', 0) / 1e6:.1f} M/s"
        + (f", fbgemm {fb['lookups_per_s'] / 1e6:.1f} M/s, ratio {ratios.get(HEADLINE):.2f}" if fb else "")
        + f" ({wres['wall_s']:.0f} s)")
    return wres

