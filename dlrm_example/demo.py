"""Demo: train the same DLRM with both backends, then compare AUC, memory and lookups.

    python -c "import dlrm_example.demo as d; d.main()"      (what `make demo` can call)
    python -m dlrm_example.demo [--steps N] [--scale F] [--threads T] ...

Embedded defaults: generated Criteo-like data (Kaggle cardinalities x 0.01: 337,865
rows in 26 tables, dim 16, Zipf 1.05), DLRM, row-wise Adagrad (EXACT_ROWWISE_ADAGRAD),
batch 1024, 500 steps, seed 0, one process. Each backend trains in this process
(python -m dlrm_example.train does the same with more options), then:

* AUC / log loss on held-out generated batches (the backends match bit for bit);
* table memory: raw fp32 tables (what TorchRec's EBC holds), IBP's footprint while
  training (arena with free space + row index + masks), the packed size a checkpoint
  holds, and the uncompressed optimizer state;
* lookup throughput of the trained embedding collection (inference, no grad), on the
  same batches: TorchRec's fused FBGEMM TBE (HOST) versus IBP's compressed tables,
  with the IBP tables both as trained (UpdatableTable) and packed (CompressedTable).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from .train import Run, parser as train_parser

DEFAULTS = dict(steps=500, scale=0.01, batch_size=1024, optimizer="adagrad", seed=0, model="dlrm")


def _args(backend: str, a, checkpoint: str) -> argparse.Namespace:
    argv = ["--backend", backend, "--steps", str(a.steps), "--scale", str(a.scale), "--batch-size",
            str(a.batch_size), "--optimizer", a.optimizer, "--seed", str(a.seed), "--model", a.model,
            "--checkpoint", checkpoint, "--checkpoint-every", "0"]
    if a.threads:
        argv += ["--threads", str(a.threads)]
    if not a.progress:
        argv.append("--no-progress")
    return train_parser().parse_args(argv)


def _throughput(ebc, batches, repeats: int):
    """(samples/s, ids/s) of ebc(kjt) under no_grad, median over repeats."""
    n_ids = sum(int(b.values.numel()) for b in batches)
    n_samples = sum(b.size for b in batches)
    kjts = [b.kjt() for b in batches]
    with torch.no_grad():
        for k in kjts[:2]:
            ebc(k)  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            for k in kjts:
                ebc(k)
            times.append(time.perf_counter() - t)
    t = statistics.median(times)
    return n_samples / t, n_ids / t


def _mib(n: int) -> str:
    return f"{n / 2**20:8.2f} MiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dlrm_example.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--scale", type=float, default=DEFAULTS["scale"])
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    p.add_argument("--optimizer", choices=("sgd", "adagrad"), default=DEFAULTS["optimizer"])
    p.add_argument("--model", choices=("dlrm", "dcn"), default=DEFAULTS["model"])
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--lookup-batches", type=int, default=8)
    p.add_argument("--progress", action="store_true", help="show training progress bars")
    a = p.parse_args(argv)

    results = {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlrm_demo_") as tmp:
        for backend in ("torchrec", "ibp"):
            print(f"=== {backend}: training {a.steps} steps ===", flush=True)
            run = Run(_args(backend, a, f"{tmp}/{backend}"))
            try:
                rc = run.run()
                if rc:
                    return rc
                built, data = run.built, run.data
                batches = [data.eval_batch(i, a.batch_size) for i in range(a.lookup_batches)]
                r = dict(run.result)
                r["lookup"] = _throughput(built.ebc, batches, repeats=3)
                if backend == "ibp":
                    r["memory"] = built.ebc.memory_stats()
                    from ibp_embed.torchrec import IBPEmbeddingBagCollection

                    packed = IBPEmbeddingBagCollection.load_compressed(f"{tmp}/ibp/{_latest(tmp, 'ibp')}/tables")
                    r["lookup_packed"] = _throughput(packed, batches, repeats=3)
                    r["packed_nbytes"] = packed.compressed_nbytes
                else:
                    from .model import local_state_shards, local_table_shards

                    raw = sum(s.tensor.numel() * 4 for _, s in local_table_shards(built))
                    st = sum(s.tensor.numel() * 4 for *_, s in local_state_shards(built))
                    r["memory"] = {"raw_bytes": raw, "optimizer_state_bytes": st}
                results[backend] = r
            except KeyboardInterrupt:
                return 130
            finally:
                run.close()

    tr, ib = results["torchrec"], results["ibp"]
    m, mt = ib["memory"], tr["memory"]
    print()
    print(f"=== DLRM on generated Criteo-like data: {a.steps} steps, batch {a.batch_size}, "
          f"{a.optimizer}, scale {a.scale} ({time.perf_counter() - t_all:.0f} s in all) ===")
    print(f"{'':34}{'torchrec (FBGEMM TBE)':>24}{'ibp (compressed)':>22}")
    print(f"{'final train loss':34}{tr['train_loss']:>24.6f}{ib['train_loss']:>22.6f}")
    print(f"{'eval AUC':34}{tr['eval_auc']:>24.6f}{ib['eval_auc']:>22.6f}")
    print(f"{'eval log loss':34}{tr['eval_logloss']:>24.6f}{ib['eval_logloss']:>22.6f}")
    same = tr["train_loss"] == ib["train_loss"] and tr["eval_auc"] == ib["eval_auc"]
    print(f"{'backends identical':34}{'yes' if same else 'NO':>24}")
    print(f"{'training samples/s':34}"
          f"{tr['steps_done'] * a.batch_size / max(tr['train_seconds'], 1e-9):>24,.0f}"
          f"{ib['steps_done'] * a.batch_size / max(ib['train_seconds'], 1e-9):>22,.0f}")
    print("table memory:")
    print(f"  {'raw fp32 tables':32}{_mib(mt['raw_bytes']):>24}{_mib(m['raw_bytes']):>22}")
    print(f"  {'tables while training':32}{_mib(mt['raw_bytes']):>24}{_mib(m['compressed_bytes']):>22}")
    print(f"    {'encoded rows':30}{'':>24}{_mib(m['live_bytes']):>22}")
    print(f"    {'arena free + dead space':30}{'':>24}{_mib(m['arena_bytes'] - m['live_bytes']):>22}")
    print(f"    {'row index (16 B/row) + masks':30}{'':>24}"
          f"{_mib(m['compressed_bytes'] - m['arena_bytes']):>22}")
    print(f"  {'tables packed (checkpoint)':32}{'':>24}{_mib(ib['packed_nbytes']):>22}"
          f"   ratio {m['raw_bytes'] / ib['packed_nbytes']:.3f}")
    print(f"  {'optimizer state (uncompressed)':32}{_mib(mt['optimizer_state_bytes']):>24}"
          f"{_mib(m['optimizer_state_bytes']):>22}")
    print(f"lookup throughput (embedding collection forward, no grad, {a.lookup_batches} batches of "
          f"{a.batch_size}):")
    print(f"  {'samples/s':32}{tr['lookup'][0]:>24,.0f}{ib['lookup'][0]:>22,.0f}   (packed: "
          f"{ib['lookup_packed'][0]:,.0f})")
    print(f"  {'ids/s':32}{tr['lookup'][1]:>24,.0f}{ib['lookup'][1]:>22,.0f}   (packed: "
          f"{ib['lookup_packed'][1]:,.0f})")
    return 0


def _latest(tmp: str, backend: str) -> str:
    with open(f"{tmp}/{backend}/LATEST") as f:
        return f.read().strip()


if __name__ == "__main__":
    sys.exit(main())
