"""The run's figure: ratios vs FBGEMM, lookups/s, host bytes per batch, compression ratios."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from .names import COLLECTION, FBGEMM, HEADLINE, TORCHREC
from .workloads import CENTER


def plot(results, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"# no plot: matplotlib failed to import ({e})", file=sys.stderr)
        return None
    fig, axes = plt.subplots(2, 2, figsize=(16, 11))
    # (a) ratio vs FBGEMM per table set, center workload
    ax = axes[0][0]
    labels, series = [], {s: [] for s in (HEADLINE, "ibp lookup W32 K1", COLLECTION)}
    for r in results:
        w = next((w for w in r["workloads"] if w["workload"] == CENTER.name), None)
        if w is None or FBGEMM not in w["systems"]:
            continue
        labels.append(r["label"])
        for s in series:
            series[s].append(w["ibp_vs_fbgemm_throughput_ratios"].get(s) or 0)
    x = np.arange(len(labels))
    for i, (s, v) in enumerate(series.items()):
        ax.bar(x + (i - 1) * 0.27, v, 0.27, label=s)
    ax.axhline(0.8, color="r", ls="--", lw=1, label="target 0.8x")
    ax.axhline(1.0, color="k", ls=":", lw=1)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("throughput vs FBGEMM pair")
    ax.set_title(f"ibp / FBGEMM throughput, {CENTER.name}")
    ax.legend(fontsize=8)
    # (b) lookups/s per workload on the first swept table set
    ax = axes[0][1]
    swept = next((r for r in results if len(r["workloads"]) > 2), results[0])
    names = [w["workload"] for w in swept["workloads"]]
    sys_names = [s for s in (FBGEMM, TORCHREC, HEADLINE, COLLECTION)
                 if s in swept["workloads"][0]["systems"]]
    x = np.arange(len(names))
    wdt = 0.8 / max(len(sys_names), 1)
    for i, s in enumerate(sys_names):
        ax.bar(x + (i - len(sys_names) / 2 + 0.5) * wdt,
               [w["systems"][s]["lookups_per_s"] / 1e6 for w in swept["workloads"]], wdt, label=s)
    ax.set_yscale("log")
    ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("M lookups/s")
    ax.set_title(f"lookups/s, {swept['label']}")
    ax.legend(fontsize=8)
    # (c) host bytes per batch (model)
    ax = axes[1][0]
    mo = [w["host_bytes_per_batch_model"] for w in swept["workloads"]]
    for i, (k, lab) in enumerate((("fbgemm UVM", "FBGEMM UVM (per occurrence)"), ("dedup raw", "raw, deduplicated"),
                                  ("ibp W64 K1", "ibp W64 K1 (deduplicated, compressed)"))):
        ax.bar(x + (i - 1) * 0.27, [m[k] / 2**20 for m in mo], 0.27, label=lab)
    ax.set_yscale("log")
    ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("MiB per batch (model, not measured)")
    ax.set_title(f"host bytes per batch, {swept['label']}")
    ax.legend(fontsize=8)
    # (d) compression ratio per table set
    ax = axes[1][1]
    labels = [r["label"] for r in results]
    cols = [("ibp W64 K1", lambda r: r["ibp"]["W64 K1"]["ratio"]),
            ("ibp best", lambda r: max(v["ratio"] for v in r["ibp"].values())),
            ("zstd-3/row", lambda r: r["baselines"]["zstd/row"]["ratio"]),
            ("lz4/row", lambda r: r["baselines"]["lz4/row"]["ratio"]),
            ("blosc2/table", lambda r: r["baselines"]["blosc2/table"]["ratio"])]
    if all("zipnn/table" in r["baselines"] for r in results):
        cols.append(("zipnn/table", lambda r: r["baselines"]["zipnn/table"]["ratio"]))
    x = np.arange(len(labels))
    wdt = 0.8 / len(cols)
    for i, (lab, f) in enumerate(cols):
        ax.bar(x + (i - len(cols) / 2 + 0.5) * wdt, [f(r) for r in results], wdt, label=lab)
    ax.axhline(1.0, color="k", ls=":", lw=1)
    ax.set_ylim(0.8, None)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("raw / stored (all metadata)")
    ax.set_title("compression ratio")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

