"""Workloads, the batches drawn for them and the host-bytes model computed from those batches."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ibp_embed import _native, datasets


@dataclasses.dataclass(frozen=True)
class Workload:
    batch: int
    pooling: int | str  # bag size of every feature, or "dlrmv2" (DLRMV2_MULTI_HOT per feature)
    alpha: float | None  # Zipf exponent; None: uniform ids
    threads: int | None = None  # None: --threads

    @property
    def name(self) -> str:
        p = "DLRMv2 multi-hot" if self.pooling == "dlrmv2" else f"P{self.pooling}"
        ids = "uniform" if self.alpha is None else f"Zipf {self.alpha:g}"
        return f"B{self.batch} {p} {ids}" + ("" if self.threads is None else f" @{self.threads} thr")

    def poolings(self, n_features: int) -> list[int]:
        if self.pooling == "dlrmv2":
            hot = datasets.DLRMV2_MULTI_HOT
            return [hot[i % len(hot)] for i in range(n_features)]
        return [int(self.pooling)] * n_features


CENTER = Workload(4096, 20, 1.05)
UNIFORM = Workload(4096, 20, None)
SWEEP = (Workload(4096, 20, 0.9), Workload(4096, 20, 1.2), Workload(1024, 20, 1.05),
         Workload(16384, 20, 1.05), Workload(4096, 1, 1.05), Workload(16384, 1, None),
         Workload(4096, "dlrmv2", 1.05), Workload(4096, "dlrmv2", None))
QUICK_SWEEP = (Workload(4096, 1, 1.05), Workload(4096, "dlrmv2", 1.05))


@dataclasses.dataclass
class Batch:
    values: torch.Tensor  # all ids, feature-major (TBE / KJT order)
    offsets: torch.Tensor  # [F * B + 1] table-major bag offsets
    kjt: object
    features: list  # per feature: (ids np int64, bag offsets np int64 [B + 1])
    uniques: list  # per feature: its distinct ids (sorted)


def make_batch(rows: list[int], work: Workload, seed: int, perm_seeds: list[int | None]) -> Batch:
    """One batch: feature t draws its ids from table t (uniform or Zipf with perm_seeds[t])."""
    from torchrec import KeyedJaggedTensor

    pool = work.poolings(len(rows))
    ids = []
    for t, (n, p) in enumerate(zip(rows, pool)):
        k = work.batch * p
        if work.alpha is None:
            ids.append(datasets.uniform_ids(k, n, seed=seed + t))
        else:
            ids.append(datasets.zipf_ids(k, n, work.alpha, seed=seed + t, perm_seed=perm_seeds[t]))
    values = torch.cat(ids)
    lengths = torch.cat([torch.full((work.batch,), p, dtype=torch.int64) for p in pool])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{t}" for t in range(len(rows))], values=values,
                                              lengths=lengths)
    offsets = kjt.offsets()
    features = []
    for t, p in enumerate(pool):
        features.append((np.ascontiguousarray(ids[t].numpy()),
                         np.arange(0, work.batch * p + 1, max(p, 1), dtype=np.int64)))
    return Batch(values, offsets, kjt, features, [np.unique(ids) for ids, _ in features])


# ================================================================ byte model
def index_bytes_per_row(row_bytes: int) -> int:
    """Offsets-index bytes ibp reads to locate one row: an 8-byte block base and the two
    rel entries (start and end) of the row."""
    return 8 + 2 * int(_native.lib.ibp_rel_bytes(row_bytes))


def batch_host_bytes(feature_ids, row_bytes, row_lengths=None, index_bytes=None, uniques=None) -> dict:
    """Bytes read from the host store for one batch (a model computed from the ids).

    feature_ids[t]: the ids feature t reads from table t; row_bytes[t]: its raw row size;
    row_lengths[t]: stored bytes of every row of table t (CompressedTable.row_lengths());
    index_bytes[t]: index bytes read per distinct row. Returns uvm (every occurrence reads
    a whole raw row: FBGEMM UVM), dedup_raw (each distinct row once, raw) and, given
    row_lengths, ibp (each distinct row once at its stored length, plus index bytes).
    uniques[t], when given, are feature t's distinct ids (saves recomputing them).
    """
    out = {"uvm": 0, "dedup_raw": 0, "ids": 0, "distinct": 0}
    if row_lengths is not None:
        out["ibp"] = 0
    for t, ids in enumerate(feature_ids):
        ids = np.asarray(ids, dtype=np.int64)
        uniq = np.unique(ids) if uniques is None else np.asarray(uniques[t], dtype=np.int64)
        out["ids"] += int(ids.size)
        out["distinct"] += int(uniq.size)
        out["uvm"] += int(ids.size) * int(row_bytes[t])
        out["dedup_raw"] += int(uniq.size) * int(row_bytes[t])
        if row_lengths is not None:
            idx = 0 if index_bytes is None else int(index_bytes[t])
            out["ibp"] += int(np.asarray(row_lengths[t])[uniq].sum()) + idx * int(uniq.size)
    return out

