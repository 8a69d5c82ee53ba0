"""Training throughput and table memory: IBP tables against TorchRec's fused kernel under DMP.

    python -m benchmarks.training [--steps 500] [--repeats 2] [--worlds 1,2] [--quick]

Runs dlrm_example.train on the demo workload (generated Criteo-like data, Kaggle
cardinalities x 0.01, dim 16, batch 1024, row-wise Adagrad) for both backends with the
same plan, on 1 process and under torchrun on 2 (gloo), interleaving the backends and
repeating each run; reports the median samples/s, the ratio ibp / torchrec of the same
repeat round, whether the losses and eval AUC are identical, and the table memory each
rank holds. Writes benchmarks/results/training-<UTC>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from . import common

BACKENDS = ("torchrec", "ibp")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_trainer(backend: str, world: int, steps: int, extra: list) -> dict:
    """One training run; its --report JSON."""
    with tempfile.TemporaryDirectory(prefix="bench_training_") as tmp:
        report = Path(tmp) / "report.json"
        args = ["-m", "dlrm_example.train", "--backend", backend, "--steps", str(steps), "--no-progress",
                "--report", str(report), *extra]
        env = dict(os.environ)
        if world == 1:
            cmd = [sys.executable, *args]
        else:  # one thread a rank: the ranks share the machine's cores
            torchrun = Path(sys.executable).with_name("torchrun")
            cmd = [str(torchrun), "--nproc_per_node", str(world), "--master_port", str(_free_port()), *args,
                   "--threads", "1"]
            env["OMP_NUM_THREADS"] = "1"
        p = subprocess.run(cmd, cwd=common.ROOT, capture_output=True, text=True, env=env, timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
        return json.loads(report.read_text())


HEADERS = ["ranks", "torchrec samples/s", "ibp samples/s", "ibp / torchrec", "identical",
           "tables MiB per rank, torchrec", "ibp", "ibp above packed (% of raw)"]


def measure(worlds, steps: int, repeats: int, extra: list):
    """(table rows, every run's report) for each process count in worlds."""
    rows, runs = [], []
    for world in worlds:
        by_backend = {b: [] for b in BACKENDS}
        for _ in range(repeats):
            for b in BACKENDS:  # interleaved: slow phases of a shared machine hit both
                r = run_trainer(b, world, steps, extra)
                by_backend[b].append(r)
                runs.append(r)
        tr, ib = by_backend["torchrec"], by_backend["ibp"]
        ratios = [i["samples_per_s"] / t["samples_per_s"] for t, i in zip(tr, ib)]
        identical = all(t["train_loss"] == i["train_loss"] and t["eval_auc"] == i["eval_auc"] for t, i in zip(tr, ib))
        mem_t, mem_i = tr[0]["memory_per_rank"], ib[0]["memory_per_rank"]
        held = [m["ibp"] + m["fbgemm"] for m in mem_i]
        over = sum(m["ibp"] - m["ibp_packed"] for m in mem_i) / max(sum(m["ibp_raw"] for m in mem_i), 1)
        rows.append([world, f"{statistics.median(r['samples_per_s'] for r in tr):,.0f}",
                     f"{statistics.median(r['samples_per_s'] for r in ib):,.0f}",
                     f"{statistics.median(ratios):.2f}x", "yes" if identical else "NO",
                     " / ".join(f"{m['raw'] / 2**20:.2f}" for m in mem_t),
                     " / ".join(f"{h / 2**20:.2f}" for h in held), f"{100 * over:.1f}%"])
    return rows, runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.training", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worlds", default="1,2", help="process counts, comma-separated")
    ap.add_argument("--scale", type=float, default=0.01)
    ap.add_argument("--quick", action="store_true", help="100 steps, one repeat")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.repeats = 100, 1
    rows, runs = measure([int(w) for w in a.worlds.split(",")], a.steps, a.repeats, ["--scale", str(a.scale)])
    print(common.markdown_table(HEADERS, rows))
    path = common.write_json({"machine": common.machine_info(), "args": vars(a), "rows": rows,
                              "headers": HEADERS, "runs": runs}, "training")
    print(f"results: {common.shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
