"""Lookup benchmark (issue 5): ibp_embed against FBGEMM / TorchRec and general codecs on CPU.

    python -m benchmarks.lookup            # full grid, about 10 minutes on 2 shared cores (make bench)
    python -m benchmarks.lookup --quick    # a small subset, under 2 minutes
    python -m benchmarks.lookup --trained-tables DIR   # also tables saved by the DLRM example

Tables ("Criteo-like"): the 26 Criteo Kaggle categorical cardinalities scaled by --scale
(default 0.03, quick 0.01): a table of n rows gets max(round(n * scale), min(n, 1000)) rows,
so small tables keep their size and large ones shrink (the largest: 10.1M -> 304k rows; the
fp32 dim-128 set is 498 MiB, 16x a 32 MiB LLC; quick: 169 MiB, 5x). One *table set* is
those 26 tables at one dim (128, 64) and one dtype (fp32, fp16, bf16) with one kind of
weights: "torchrec" (TorchRec's default init, uniform(+-sqrt(1/n)), datasets.make_table) or
"trained-like" (datasets.make_trained_like_table: a synthetic imitation, not a trained
table; its hot rows are the rows the Zipf ids draw most). Full run: all 12 sets; quick:
fp32 d128 torchrec / trained-like, fp16 d64 torchrec, bf16 d64 trained-like.
--trained-tables DIR adds the tables found under DIR: *.ibp files (ibp_embed.load, e.g. a
save_compressed checkpoint) and *.pt/*.pth files holding a plain (unsharded) state_dict, or
a dict containing one, whose 2-D floating tensors with "embedding" in their key are the
tables; one table set per dtype found, timed on the center and uniform workloads. Real
trained tables have no known popularity order: their Zipf ids use a random permutation.

Batches (one feature per table, every bag of a feature the same size, ids per feature
uniform or Zipf(alpha) over a fixed random popularity permutation, datasets.zipf_ids):
    center     B=4096, pooling 20, Zipf 1.05      (every table set)
    uniform    B=4096, pooling 20, uniform ids    (every table set)
    center on all usable CPUs ("@2 thr")          (fp32 d128 sets; quick: torchrec only)
and on the fp32 d128 sets (quick: the torchrec one, pooling 1 and DLRMv2 Zipf only) a
sweep around the center: Zipf 0.9 and 1.2; B=1024 and B=16384 (pooling 20, Zipf 1.05);
pooling 1 (B=4096, Zipf 1.05) and (B=16384, uniform); DLRMv2 multi-hot sizes per feature
(3,2,1,2,6,...,12,100,27,10,3,1,1; B=4096, Zipf 1.05 and uniform).

Systems, timed in the same run on the same tables and batches. Timings run on --threads
(default 1) torch intra-op and libibp OpenMP threads: on this machine's 2 shared cores,
2-thread OpenMP timings swing 10x with other tenants' load, 1-thread ones far less. Every
system first runs the first batch once (its output checked against torch's embedding_bag:
the warm-up), then the systems are timed interleaved, pass by pass (common.time_interleaved:
--repeats rounds over all systems (default 5, quick 3), each pass over --batches distinct
batches (default 2, quick 1); the median pass is reported). Large allocations come from a
heap that stays mapped (common.steady_allocations): a batch's 54 MiB output was otherwise
a fresh mapping, page-faulted at random, and FBGEMM's timings swung 3x with it:
- "fbgemm TBE": FBGEMM SplitTableBatchedEmbeddingBagsCodegen, EmbeddingLocation.HOST /
  ComputeDevice.CPU, all tables in one TBE, forward(indices, offsets) (the kernel TorchRec's
  fused compute kernel runs on CPU). fp32 and fp16 weights; FBGEMM 1.8's CPU kernel has no
  bf16 (NotImplementedError), so bf16 table sets have no FBGEMM rows (ratio null).
- "torchrec FusedEBC": torchrec.modules.fused_embedding_modules.FusedEmbeddingBagCollection
  forward on the KeyedJaggedTensor, over that same TBE (its own TBE is replaced by ours: it
  would otherwise hold fp32 for every data_type; TorchRec's sharded fused kernel holds fp16
  tables as fp16, as here). A sharded (DMP) EBC adds its input/output dist on top.
- "torch embedding_bag": F.embedding_bag per feature on the raw weights (a reference with
  bf16 too; ibp systems carry ibp_vs_torch_raw_throughput_ratio against it).
- "ibp lookup W{64,32} K{1,4}": CompressedTable.lookup per feature (ids and bag offsets
  sliced ahead of time), outputs concatenated like the TBE's; paired with "fbgemm TBE".
- "ibp lookup_many W64 K1": every feature in one native call writing its columns of one
  output (ibp_embed.lookup_many: what the IBP collection and the DMP kernel run),
  the like-for-like pair of the TBE's forward; paired with "fbgemm TBE".
- "ibp EBC W64 K{1,4}": IBPEmbeddingBagCollection forward on the KeyedJaggedTensor;
  paired with "torchrec FusedEBC".
  A K4 variant that kept one cluster in every table is the K1 table: not timed twice.
- GPU placements (DEVICE, MANAGED = UVM, MANAGED_CACHING) are in benchmarks/gpu_lookup.py.
- Size only: zstd level 3 and lz4 on each row (--codec-sample rows sampled per table, an
  8-byte offset per row, a row that does not shrink stored raw: benchmarks.codec.PerRowStore),
  blosc2 (shuffle + zstd level 1, 4 MiB chunks) and zipnn (when it imports) on each whole
  table (no random access). Encoding (ibp and codecs) runs on all usable CPUs.

Figures: lookups/s; GB/s of pooled output (B x sum(dims) x 4 bytes per batch; also GB/s of
raw rows pooled); compression ratio with all metadata (raw bytes / stored bytes); memory of
each form; encode time. Host bytes per batch are a MODEL computed from each batch's ids, not
a measurement: FBGEMM UVM reads every occurrence's whole row over PCIe (occurrences x row
bytes); ibp reads each distinct row of a feature once (index deduplication) at its stored
length (CompressedTable.row_lengths()) plus its offsets-index entries (an 8-byte block base
and two rel entries); no PCIe transaction granularity is modelled. Ratios against FBGEMM are
computed pair by pair in this run (ibp lookup / fbgemm TBE, ibp EBC / torchrec FusedEBC);
every configuration (table set x workload) carries ibp_vs_fbgemm_throughput_ratio (ibp
lookup W64 K1 against fbgemm TBE; null where FBGEMM has no kernel) and
ibp_vs_fbgemm_throughput_ratios (every pair). The issue's targets are printed as met / not
met with their numbers, never asserted.

Output: markdown tables on stdout (progress on stderr), benchmarks/results/lookup-<UTC
time>.json and benchmarks/results/lookup-<UTC time>.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import ibp_embed
from ibp_embed import _native, datasets
from ibp_embed.table import _lookup_many_checked

from . import common

FBGEMM = "fbgemm TBE"
TORCHREC = "torchrec FusedEBC"
TORCH_RAW = "torch embedding_bag"
IBP_VARIANTS = ((64, 1), (32, 1), (64, 4), (32, 4))  # (word bits, clusters asked)
HEADLINE = "ibp lookup W64 K1"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_SHORT = {v: k for k, v in DTYPES.items()}
INIT_LABEL = {"torchrec": "torchrec init", "trained": "trained-like", "dir": "trained (dir)"}
TRAINED_ALPHA = 1.05  # popularity skew of the trained-like tables
SMALL_TABLE_ROWS = 1000  # tables up to this size keep their cardinality when scaled
OFFSET_BYTES = 8  # per-row index entry charged to per-row codecs (as in benchmarks.codec)
BLOSC_CHUNK = 4 << 20
BLOSC_CLEVEL = 1


def lookup_name(w, k):
    return f"ibp lookup W{w} K{k}"


def ebc_name(w, k):
    return f"ibp EBC W{w} K{k}"


BATCHED = "ibp lookup_many W64 K1"  # every feature in one native call, as the TBE's forward


EBC_VARIANTS = ((64, 1), (64, 4))


def pair_of(system: str) -> str | None:
    """The FBGEMM-side system an ibp system is compared with."""
    if system.startswith("ibp lookup"):
        return FBGEMM
    if system.startswith("ibp EBC"):
        return TORCHREC
    return None


# ================================================================ workloads
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


# ================================================================ tables
def criteo_rows(scale: float) -> list[int]:
    """Criteo Kaggle cardinalities scaled: small tables keep their size (see module doc)."""
    return [max(int(round(n * scale)), min(n, SMALL_TABLE_ROWS)) for n in datasets.CRITEO_KAGGLE_CARDINALITIES]


@dataclasses.dataclass
class TableSet:
    name: str
    init: str  # torchrec / trained / dir
    dtype: torch.dtype
    dims: list[int]
    rows: list[int]
    source: str = "generated"
    tensors: list | None = None  # preloaded weights (--trained-tables)

    @property
    def label(self) -> str:
        d = self.dims[0] if len(set(self.dims)) == 1 else "mixed"
        return f"{DTYPE_SHORT[self.dtype]} d{d} {INIT_LABEL[self.init]}"

    @property
    def raw_bytes(self) -> int:
        return sum(n * d * self.dtype.itemsize for n, d in zip(self.rows, self.dims))

    def perm_seeds(self) -> list[int]:
        return list(range(len(self.rows)))

    def weights(self, t: int) -> torch.Tensor:
        if self.tensors is not None:
            return self.tensors[t]
        n, d = self.rows[t], self.dims[t]
        if self.init == "trained":
            return datasets.make_trained_like_table(n, d, self.dtype, alpha=TRAINED_ALPHA, seed=t, perm_seed=t)
        return datasets.make_table(n, d, self.dtype, init="torchrec", seed=t)


def _state_dict_tables(obj, prefix=""):
    """(key, tensor) of 2-D floating tensors with 'embedding' in the key, in nested dicts."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 2 and obj.is_floating_point() and "embedding" in prefix.lower():
            yield prefix, obj
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _state_dict_tables(v, f"{prefix}.{k}" if prefix else str(k))


def load_trained_tables(path) -> list[tuple[str, torch.Tensor]]:
    """Tables under `path` (a directory or one file): *.ibp files and *.pt/*.pth state_dicts."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    out = []
    for f in files:
        if f.suffix == ".ibp":
            out.append((str(f.relative_to(path) if path.is_dir() else f.name),
                        ibp_embed.load(f, mmap=False).decompress()))
        elif f.suffix in (".pt", ".pth"):
            obj = torch.load(f, map_location="cpu", weights_only=True)
            if isinstance(obj, torch.Tensor) and obj.dim() == 2 and obj.is_floating_point():
                out.append((f.name, obj))
                continue
            found = list(_state_dict_tables(obj))
            for k, v in found:
                out.append((f"{f.name}:{k}", v.detach().contiguous()))
    if not out:
        raise SystemExit(f"--trained-tables {path}: no .ibp file and no state_dict tensor with "
                         f"'embedding' in its key found")
    return out


def trained_table_sets(path) -> list[TableSet]:
    tables = load_trained_tables(path)
    sets = []
    for dtype in sorted({t.dtype for _, t in tables}, key=str):
        if dtype not in DTYPE_SHORT:
            print(f"# --trained-tables: skipping {dtype} tables (fp32/fp16/bf16 only)", file=sys.stderr)
            continue
        ts = [(k, t) for k, t in tables if t.dtype == dtype]
        sets.append(TableSet(name=f"dir-{DTYPE_SHORT[dtype]}", init="dir", dtype=dtype,
                             dims=[int(t.shape[1]) for _, t in ts], rows=[int(t.shape[0]) for _, t in ts],
                             source=f"{path}: " + ", ".join(k for k, _ in ts), tensors=[t for _, t in ts]))
    return sets


# ================================================================ FBGEMM / TorchRec
def fbgemm_precision(dtype: torch.dtype):
    """SparseType for FBGEMM's CPU kernel, or None where it has none (bf16 in FBGEMM 1.8)."""
    from fbgemm_gpu.split_embedding_configs import SparseType

    return {torch.float32: SparseType.FP32, torch.float16: SparseType.FP16}.get(dtype)


def build_tbe(rows, dims, dtype):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(n, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for n, d in zip(rows, dims)],
        optimizer=EmbOptimType.EXACT_SGD, pooling_mode=PoolingMode.SUM,
        weights_precision=fbgemm_precision(dtype), output_dtype=SparseType.FP32, device=torch.device("cpu"))


def torchrec_fused_ebc(tbe, dims):
    """TorchRec's FusedEmbeddingBagCollection whose forward runs on `tbe` (see module doc)."""
    from torchrec import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=d, num_embeddings=1, feature_names=[f"f{t}"])
               for t, d in enumerate(dims)]
    ebc = FusedEmbeddingBagCollection(configs, optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.01})
    assert len(ebc._emb_modules) == 1
    ebc._emb_modules[0]._emb_module = tbe
    return ebc


def ibp_ebc(tables, dims, dtype):
    from torchrec import EmbeddingBagConfig
    from torchrec.modules.embedding_configs import DataType

    from ibp_embed.torchrec import IBPEmbeddingBagCollection

    dt = {torch.float32: DataType.FP32, torch.float16: DataType.FP16, torch.bfloat16: DataType.BF16}[dtype]
    configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=d, num_embeddings=tab.shape[0],
                                  feature_names=[f"f{t}"], data_type=dt)
               for t, (d, tab) in enumerate(zip(dims, tables))]
    return IBPEmbeddingBagCollection(configs, _tables={f"t{t}": tab for t, tab in enumerate(tables)})


# ================================================================ size-only codecs
def per_row_codec_sizes(rows_u8: np.ndarray, sample: int, seed: int) -> dict:
    """zstd-3 and lz4 per row on a uniform sample of rows: estimated stored bytes of the table."""
    from .codec import PerRowStore

    n = rows_u8.shape[0]
    if n > sample:
        pick = np.sort(np.random.default_rng(seed).choice(n, sample, replace=False))
        sub = np.ascontiguousarray(rows_u8[pick])
    else:
        sub = rows_u8
    out = {}
    for codec in ("zstd", "lz4"):
        store = PerRowStore(sub, codec)
        out[codec] = {"nbytes": store.stored_bytes() * n / sub.shape[0],
                      "encode_s": store.encode_s * n / sub.shape[0], "sampled_rows": int(sub.shape[0])}
    return out


def blosc2_size(rows_u8: np.ndarray, typesize: int) -> dict:
    import blosc2

    t0 = time.perf_counter()
    sc = blosc2.SChunk(chunksize=BLOSC_CHUNK, data=rows_u8.reshape(-1),
                       cparams=blosc2.CParams(codec=blosc2.Codec.ZSTD, clevel=BLOSC_CLEVEL,
                                              filters=[blosc2.Filter.SHUFFLE], typesize=typesize,
                                              nthreads=torch.get_num_threads()))
    return {"nbytes": int(sc.cbytes), "encode_s": time.perf_counter() - t0}


def zipnn_available() -> str | None:
    """zipnn's version if it imports, else None."""
    import importlib

    try:
        importlib.import_module("zipnn")
    except Exception:  # noqa: BLE001 - absent or broken install
        return None
    try:
        from importlib.metadata import version

        return version("zipnn")
    except Exception:  # noqa: BLE001
        return "?"


def zipnn_size(rows_u8: np.ndarray, dtype: torch.dtype, verify: bool = True) -> dict:
    """zipnn on the whole table. zipnn rewrites its input buffer in place (its byte
    reordering), so it compresses a copy."""
    import zipnn

    name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    z = zipnn.ZipNN(input_format="byte", bytearray_dtype=name)
    buf = bytearray(rows_u8.tobytes())
    t0 = time.perf_counter()
    comp = z.compress(buf)
    enc = time.perf_counter() - t0
    res = {"nbytes": len(comp), "encode_s": enc}
    if verify:
        res["bit_exact"] = bytes(zipnn.ZipNN(input_format="byte", bytearray_dtype=name).decompress(comp)) \
            == rows_u8.tobytes()
    return res


# ================================================================ one table set
def reference_output(weights, batch: Batch) -> torch.Tensor:
    outs = []
    for w, (ids, off) in zip(weights, batch.features):
        ids_t = torch.from_numpy(ids)
        uniq, inv = torch.unique(ids_t, return_inverse=True)
        outs.append(F.embedding_bag(inv, w[uniq].float(), torch.from_numpy(off), mode="sum",
                                    include_last_offset=True))
    return torch.cat(outs, dim=1)


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
    tbe = fused = None
    if fbgemm_precision(ts.dtype) is not None:
        tbe = build_tbe(ts.rows, ts.dims, ts.dtype)
        weights = tbe.split_embedding_weights()
        with torch.no_grad():
            for t, w in enumerate(weights):
                w.copy_(ts.weights(t))
        fused = torchrec_fused_ebc(tbe, ts.dims)
    else:
        weights = [ts.weights(t).contiguous() for t in range(n_tables)]
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
        return lambda b: _lookup_many_checked([(tab, ids, off, None, "sum") for tab, (ids, off) in zip(tabs, b.features)],
                                     b.features[0][1].size - 1)

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
                                          for name, fn in systems.items()}, repeats=args.repeats, warmup=0)
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
            r = sysres[p]["batch_s"] / e["batch_s"] if p in sysres else None
            e["ibp_vs_fbgemm_throughput_ratio"] = r
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


# ================================================================ report
def _mlps(e):
    return "-" if e is None else f"{e['lookups_per_s'] / 1e6:.1f}"


def _ratio(x):
    return "-" if x is None else f"{x:.2f}"


def _paired(e):
    """M lookups/s of an ibp system and its ratio against its FBGEMM pair, when there is one."""
    r = e.get("ibp_vs_fbgemm_throughput_ratio")
    return _mlps(e) + ("" if r is None else f" ({r:.2f}x)")


def _mib(x):
    return "-" if x is None else f"{x / 2**20:.0f}"


def report(results, params) -> str:
    m = params["machine"]
    L = []
    L.append(f"## Lookup benchmark, {params['started_utc']}: {m['cpu_model']}, {m['cpus_usable']} usable CPUs; "
             f"timings on {params['threads']} thread(s) unless marked @N thr; load average "
             f"{params['load_average_start']} at start")
    L.append("")
    L.append(f"Commit {(m['git_commit'] or '?')[:10]}{' (dirty)' if m['git_dirty'] else ''}, libibp "
             f"{m['libibp_sha256_16']} ({m['ibp_isa']}), torch {m['versions']['torch']}, fbgemm_gpu "
             f"{m['versions']['fbgemm_gpu']}, torchrec {m['versions']['torchrec']}, zipnn "
             f"{params['zipnn_version'] or 'not installed'}. Tables: Criteo Kaggle cardinalities x "
             f"{params['scale']:g} (small tables kept), 26 tables, one feature each. Timings: median of "
             f"{params['repeats']} passes over {params['batches']} batches.")
    L.append("")
    # ---- sizes
    L.append("### Compression ratio (raw / stored, all metadata) and encode time")
    L.append("")
    L.append("zstd/lz4 per row: sampled rows, 8-byte offset per row, raw when not smaller; blosc2/zipnn: whole "
             "table, no random access. K4 `(kN)`: mean clusters kept per table. Encode: ibp W64 K1 / W64 K4, "
             "seconds for the whole set on all threads.")
    L.append("")
    has_zipnn = any("zipnn/table" in r["baselines"] for r in results)
    heads = ["table set", "raw MiB", "ibp W32 K1", "ibp W64 K1", "ibp W32 K4", "ibp W64 K4", "zstd-3/row",
             "lz4/row", "blosc2/table"] + (["zipnn/table"] if has_zipnn else []) + ["ibp MiB (W64 K1)", "encode s"]
    rows = []
    for r in results:
        ib, bl = r["ibp"], r["baselines"]

        def cell(v):
            k = np.mean(v["clusters_kept"])
            return f"{v['ratio']:.3f}" + (f" (k{k:.1f})" if v["clusters_asked"] > 1 else "")
        rows.append([r["label"], _mib(r["raw_bytes"]), cell(ib["W32 K1"]), cell(ib["W64 K1"]), cell(ib["W32 K4"]),
                     cell(ib["W64 K4"]), f"{bl['zstd/row']['ratio']:.3f}", f"{bl['lz4/row']['ratio']:.3f}",
                     f"{bl['blosc2/table']['ratio']:.3f}"]
                    + ([f"{bl['zipnn/table']['ratio']:.3f}" if "zipnn/table" in bl else "-"] if has_zipnn else [])
                    + [_mib(ib["W64 K1"]["nbytes"]),
                       f"{ib['W64 K1']['encode_s']:.1f} / {ib['W64 K4']['encode_s']:.1f}"])
    L += [common.markdown_table(heads, rows), ""]

    # ---- throughput per table set on the center and uniform workloads
    L.append("### Throughput per table set: M lookups/s (ratio vs its FBGEMM pair)")
    L.append("")
    L.append("ibp lookup = CompressedTable.lookup per feature, then torch.cat; ibp lookup_many = every feature in "
             "one native call (ibp_embed.lookup_many, as the TBE's forward); both paired with fbgemm TBE "
             "(HOST); ibp EBC = IBPEmbeddingBagCollection, paired with torchrec FusedEBC over the same TBE. `-`: "
             "FBGEMM has no CPU bf16 kernel.")
    L.append("")
    sys_cols = [FBGEMM, TORCHREC, TORCH_RAW, "ibp lookup W64 K1", "ibp lookup W32 K1", "ibp lookup W64 K4",
                BATCHED, "ibp EBC W64 K1"]
    heads = ["table set", "workload"] + sys_cols + ["pooled out GB/s (fbgemm / ibp W64 K1)"]
    rows = []
    for r in results:
        for w in r["workloads"]:
            if not (w["batch"] == 4096 and w["pooling"] == 20 and w["alpha"] in (1.05, None)):
                continue
            s = w["systems"]
            cells = []
            for c in sys_cols:
                e = s.get(c)
                if e is None:
                    cells.append("-")
                elif c in (FBGEMM, TORCHREC, TORCH_RAW):
                    cells.append(_mlps(e))
                else:
                    cells.append(_paired(e))
            fb, hl = s.get(FBGEMM), s.get(HEADLINE)
            rows.append([r["label"], w["workload"]] + cells +
                        [f"{fb['pooled_output_gbps']:.2f} / {hl['pooled_output_gbps']:.2f}" if fb else
                         f"- / {hl['pooled_output_gbps']:.2f}"])
    L += [common.markdown_table(heads, rows), ""]

    # ---- workload sweep
    for r in results:
        if len(r["workloads"]) <= 3:
            continue
        L.append(f"### Workload sweep on {r['label']} ({_mib(r['raw_bytes'])} MiB raw)")
        L.append("")
        L.append("Host bytes per batch: a MODEL computed from each batch's ids, not a measurement (the PCIe "
                 "traffic a GPU would see): FBGEMM UVM reads every occurrence's row; ibp reads each distinct row "
                 "once at its stored length plus its offsets-index entries. M lookups/s and ratio vs the pair.")
        L.append("")
        heads = ["workload", "distinct ids", "UVM MiB/batch", "ibp MiB/batch (W64 K1)", "UVM / ibp",
                 FBGEMM, "ibp lookup W64 K1", TORCHREC, "ibp EBC W64 K1", "out GB/s fbgemm / ibp"]
        rows = []
        for w in r["workloads"]:
            s, mo = w["systems"], w["host_bytes_per_batch_model"]
            fb = s.get(FBGEMM)

            def rc(name):
                e = s.get(name)
                return "-" if e is None else _paired(e)
            rows.append([w["workload"], f"{100 * mo['distinct_fraction']:.0f}%", f"{mo['fbgemm UVM'] / 2**20:.1f}",
                         f"{mo['ibp W64 K1'] / 2**20:.1f}", f"{mo['fbgemm UVM'] / mo['ibp W64 K1']:.2f}",
                         _mlps(fb), rc("ibp lookup W64 K1"), _mlps(s.get(TORCHREC)), rc("ibp EBC W64 K1"),
                         (f"{fb['pooled_output_gbps']:.2f} / " if fb else "- / ")
                         + f"{s['ibp lookup W64 K1']['pooled_output_gbps']:.2f}"])
        L += [common.markdown_table(heads, rows), ""]

    # ---- memory
    L.append("### Memory of the tables (MiB)")
    L.append("")
    heads = ["table set", "FBGEMM / TorchRec (raw)", "ibp W32 K1", "ibp W64 K1", "ibp W32 K4", "ibp W64 K4"]
    rows = [[r["label"], _mib(r["raw_bytes"])] + [_mib(r["memory_bytes"][f"ibp {v}"])
                                                  for v in ("W32 K1", "W64 K1", "W32 K4", "W64 K4")]
            for r in results]
    L += [common.markdown_table(heads, rows), ""]
    return "\n".join(L)


# ================================================================ targets
def check_targets(results, machine) -> dict:
    llc = max(machine.get("cache_bytes", {}).values() or [0])
    t1 = []
    for r in results:
        if r["dtype"] == "fp32" and set(r["dims"]) == {128}:
            for w in r["workloads"]:
                if w["workload"] == CENTER.name:
                    ratios = w["ibp_vs_fbgemm_throughput_ratios"]
                    best = max((k for k in ratios if ratios[k] is not None and k.startswith("ibp lookup")),
                               key=lambda k: ratios[k], default=None)
                    mt = next((x for x in r["workloads"] if x["workload"].startswith(CENTER.name + " @")), None)
                    t1.append({"table_set": r["label"], "llc_multiple": r["raw_bytes"] / llc if llc else None,
                               "threads": w["threads"], "headline": w["ibp_vs_fbgemm_throughput_ratio"],
                               "best_system": best, "best": ratios.get(best) if best else None,
                               "module_ratio": ratios.get("ibp EBC W64 K1"),
                               "all_threads": None if mt is None else {
                                   "threads": mt["threads"], "headline": mt["ibp_vs_fbgemm_throughput_ratio"],
                                   "module_ratio": mt["ibp_vs_fbgemm_throughput_ratios"].get("ibp EBC W64 K1")}})
    t2 = []
    for r in results:
        ratio = r["ibp"]["W64 K1"]["ratio"]
        by_work = {}
        works = [w for w in r["workloads"] if " @" not in w["workload"]]  # same batches as their 1-thread twin
        for w in works:
            mo = w["host_bytes_per_batch_model"]
            frac = mo["ibp W64 K1"] / mo["fbgemm UVM"]
            by_work[w["workload"]] = frac
            t2.append({"table_set": r["label"], "workload": w["workload"], "ibp_over_uvm": frac,
                       "one_over_ratio": 1 / ratio, "met": frac <= 1 / ratio})
        # Zipf lower still: each Zipf workload against the uniform one at the same batch and pooling
        for w in works:
            if w["alpha"] is None:
                continue
            twin = next((u for u in works if u["alpha"] is None and u["batch"] == w["batch"]
                         and u["pooling"] == w["pooling"]), None)
            if twin is not None:
                t2[-1].setdefault("zipf_checks", [])
                t2[-1]["zipf_checks"].append({"zipf": w["workload"], "uniform": twin["workload"],
                                              "zipf_frac": by_work[w["workload"]],
                                              "uniform_frac": by_work[twin["workload"]]})
    zipf_checks = [z for e in t2 for z in e.get("zipf_checks", [])]
    t3 = []
    for r in results:
        best_name = max(r["ibp"], key=lambda k: r["ibp"][k]["ratio"])
        best = r["ibp"][best_name]["ratio"]
        z, b = r["baselines"]["zstd/row"]["ratio"], r["baselines"]["blosc2/table"]["ratio"]
        small = [i for i, (x, y) in enumerate(zip(r["ibp"][best_name]["table_ratios"],
                                                  r["baselines"]["zstd/row"]["table_ratios"])) if x < y]
        t3.append({"table_set": r["label"], "ibp_best": best, "ibp_best_variant": best_name, "zstd_row": z,
                   "blosc2": b, "ge_zstd": best >= z, "within_10pct_blosc2": best >= 0.9 * b,
                   "tables_below_zstd_row": small, "tables": len(r["rows"]),
                   "rows_of_tables_below_zstd_row": [r["rows"][i] for i in small]})
    return {
        "lookup_ge_0.8x_fbgemm": {"met": all(e["headline"] is not None and e["headline"] >= 0.8 for e in t1)
                                  if t1 else None, "parity": all(e["headline"] >= 1.0 for e in t1) if t1 else None,
                                  "values": t1, "llc_bytes": llc},
        "host_bytes_le_uvm_over_ratio": {"met": all(e["met"] for e in t2) if t2 else None, "values": t2,
                                         "zipf_lower_than_uniform": all(z["zipf_frac"] < z["uniform_frac"]
                                                                        for z in zipf_checks)
                                         if zipf_checks else None, "zipf_checks": zipf_checks},
        "ratio_ge_zstd_row_and_within_10pct_blosc2": {
            "met_zstd": all(e["ge_zstd"] for e in t3), "met_blosc2": all(e["within_10pct_blosc2"] for e in t3),
            "met_zstd_every_single_table": all(not e["tables_below_zstd_row"] for e in t3), "values": t3},
    }


def format_targets(t) -> str:
    def yn(b):
        return "n/a (not in this run)" if b is None else "met" if b else "NOT met"

    a, b, c = (t["lookup_ge_0.8x_fbgemm"], t["host_bytes_le_uvm_over_ratio"],
               t["ratio_ge_zstd_row_and_within_10pct_blosc2"])
    L = ["### Targets (issue 5)", ""]
    vals = "; ".join(f"{e['table_set']} ({e['llc_multiple']:.0f}x LLC), {e['threads']} thread: {HEADLINE} "
                     f"{_ratio(e['headline'])}x, best {e['best_system']} {_ratio(e['best'])}x, ibp EBC W64 K1 / "
                     f"TorchRec FusedEBC {_ratio(e['module_ratio'])}x"
                     + (f"; on {e['all_threads']['threads']} threads {_ratio(e['all_threads']['headline'])}x and "
                        f"{_ratio(e['all_threads']['module_ratio'])}x" if e["all_threads"] else "")
                     for e in a["values"])
    L.append(f"- CPU pooled lookup, fp32 d128, B4096 P20 Zipf 1.05, >= 0.8x FBGEMM TBE HOST ({HEADLINE}): "
             f"{yn(a['met'])} (parity: {yn(a['parity'])}): {vals}")
    worst = max(b["values"], key=lambda e: e["ibp_over_uvm"] / e["one_over_ratio"]) if b["values"] else None
    best = min(b["values"], key=lambda e: e["ibp_over_uvm"]) if b["values"] else None
    L.append(f"- host bytes per batch (model) <= 1/ratio of FBGEMM UVM's: {yn(b['met'])} over "
             f"{len(b['values'])} (table set, workload) pairs"
             + (f"; closest: {worst['table_set']} {worst['workload']} ibp/UVM {worst['ibp_over_uvm']:.3f} vs "
                f"1/ratio {worst['one_over_ratio']:.3f}; lowest: {best['table_set']} {best['workload']} "
                f"{best['ibp_over_uvm']:.3f}" if worst else ""))
    zc = b["zipf_checks"]
    L.append(f"- lower still with Zipf ids than with uniform ids (same B, pooling): {yn(b['zipf_lower_than_uniform'])}"
             + (f" ({len(zc)} pairs; e.g. {zc[0]['zipf']} {zc[0]['zipf_frac']:.3f} vs {zc[0]['uniform']} "
                f"{zc[0]['uniform_frac']:.3f})" if zc else ""))
    L.append(f"- ratio (best ibp variant) >= zstd-3 per row on every table set: {yn(c['met_zstd'])}; within 10% of "
             f"blosc2 whole-table (ibp / blosc2 >= 0.900): {yn(c['met_blosc2'])}: "
             + "; ".join(f"{e['table_set']} ibp {e['ibp_best']:.3f} ({e['ibp_best_variant']}) / zstd "
                         f"{e['zstd_row']:.3f} / blosc2 {e['blosc2']:.3f} = {e['ibp_best'] / e['blosc2']:.3f}"
                         + ("" if e["within_10pct_blosc2"] else " (NOT within 10%)") for e in c["values"]))
    below = [e for e in c["values"] if e["tables_below_zstd_row"]]
    L.append(f"- the same on every single table: {yn(c['met_zstd_every_single_table'])}"
             + (": " + "; ".join(f"{e['table_set']} {len(e['tables_below_zstd_row'])} of {e['tables']} tables "
                                 f"(of {min(e['rows_of_tables_below_zstd_row'])}-"
                                 f"{max(e['rows_of_tables_below_zstd_row'])} rows)" for e in below)
                + " (in tables this small the masks outweigh the rows)" if below else ""))
    return "\n".join(L)


# ================================================================ plot
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
    labels, series = [], {s: [] for s in ("ibp lookup W64 K1", "ibp lookup W32 K1", "ibp EBC W64 K1")}
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
    sys_names = [s for s in (FBGEMM, TORCHREC, "ibp lookup W64 K1", "ibp EBC W64 K1")
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


# ================================================================ main
def plan(args) -> list[tuple[TableSet, list[Workload]]]:
    rows = criteo_rows(args.scale)
    sets = []
    if args.quick:
        combos = [("fp32", 128, "torchrec"), ("fp32", 128, "trained"), ("fp16", 64, "torchrec"),
                  ("bf16", 64, "trained")]
    else:
        combos = [(dt, d, init) for init in ("torchrec", "trained") for dt in ("fp32", "fp16", "bf16")
                  for d in (128, 64)]
    combos = [c for c in combos if c[0] in args.dtypes and c[1] in args.dims and c[2] in args.inits]
    for dt, d, init in combos:
        ts = TableSet(name=f"criteo-{dt}-d{d}-{init}", init=init, dtype=DTYPES[dt], dims=[d] * len(rows), rows=rows)
        works = [CENTER, UNIFORM]
        if dt == "fp32" and d == 128:
            if args.all_threads != args.threads and (init == "torchrec" or not args.quick):
                works.append(dataclasses.replace(CENTER, threads=args.all_threads))
            if not args.no_sweep and (init == "torchrec" or not args.quick):
                works += list(QUICK_SWEEP if args.quick else SWEEP)
        sets.append((ts, works))
    if args.trained_tables:
        for ts in trained_table_sets(args.trained_tables):
            sets.append((ts, [CENTER, UNIFORM]))
    return sets


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.lookup", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small subset (under 2 minutes on 2 cores)")
    p.add_argument("--scale", type=float, help="Criteo Kaggle cardinality scale (default 0.05; --quick 0.01)")
    p.add_argument("--dims", default="128,64")
    p.add_argument("--dtypes", default="fp32,fp16,bf16")
    p.add_argument("--inits", default="torchrec,trained")
    p.add_argument("--trained-tables", metavar="DIR", help="also benchmark the .ibp / .pt tables found here")
    p.add_argument("--no-sweep", action="store_true", help="center and uniform workloads only")
    p.add_argument("--batches", type=int, help="distinct batches per timed pass (default 2; --quick 1)")
    p.add_argument("--repeats", type=int, help="timed passes, median reported (default 5; --quick 3)")
    p.add_argument("--threads", type=int, default=1,
                   help="threads for torch and libibp in the timings (default 1; the fp32 d128 center "
                        "workload also runs on all usable CPUs)")
    p.add_argument("--codec-sample", type=int, help="rows per table sampled for per-row zstd/lz4 "
                   "(default 8192; --quick 2048)")
    p.add_argument("--no-zipnn", action="store_true", help="skip zipnn even if installed")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-json", action="store_true", help="write neither the JSON nor the PNG")
    a = p.parse_args(argv)
    a.scale = a.scale or (0.01 if a.quick else 0.03)
    a.batches = a.batches or (1 if a.quick else 2)
    a.repeats = a.repeats or (3 if a.quick else 5)
    a.codec_sample = a.codec_sample or (2048 if a.quick else 8192)
    a.all_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    a.dims = [int(x) for x in a.dims.split(",")]
    a.dtypes = a.dtypes.split(",")
    a.inits = a.inits.split(",")
    for x in a.dtypes:
        if x not in DTYPES:
            p.error(f"--dtypes: {x!r} is not one of {list(DTYPES)}")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    stamp = common.utc_stamp()
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    params = {k: v for k, v in vars(args).items() if k not in ("no_json",)}
    params.update(steady_allocations=common.steady_allocations(),
                  started_utc=stamp, machine=common.machine_info(), load_average_start=common.load_average(),
                  zipnn_version=None if args.no_zipnn else zipnn_available(),
                  workloads_center=CENTER.name, headline_pair=f"{HEADLINE} vs {FBGEMM}",
                  ibp_variants=[f"W{w} K{k}" for w, k in IBP_VARIANTS],
                  host_bytes_model="FBGEMM UVM: ids x raw row bytes; ibp: per feature, distinct ids x (stored "
                                   "row length + 8-byte block base + 2 rel entries); computed from the batches, "
                                   "not measured")
    if params["zipnn_version"] is None and not args.no_zipnn:
        log("zipnn does not import: its column is skipped (pip install zipnn)")
    sets = plan(args)
    log(f"{len(sets)} table sets, {sum(len(w) for _, w in sets)} (table set, workload) pairs, scale {args.scale:g}, "
        f"timings on {args.threads} thread(s), load average {params['load_average_start']}")
    results = []
    with common.threads(args.all_threads):  # encoding and codecs on all CPUs; each timing sets its own
        for i, (ts, works) in enumerate(sets, 1):
            log(f"[{i}/{len(sets)}] {ts.label}: {len(ts.rows)} tables, {sum(ts.rows):,} rows, "
                f"{ts.raw_bytes / 2**20:.0f} MiB raw")
            r = run_table_set(ts, works, args, log)
            gc.collect()
            log(f"  done in {r['wall_s']:.0f} s (" + ", ".join(f"{k} {v:.0f}" for k, v in r["phases_s"].items()) + ")")
            results.append(r)
    params["load_average_end"] = common.load_average()
    params["wall_s"] = time.perf_counter() - t_start
    targets = check_targets(results, params["machine"])
    text = report(results, params) + "\n" + format_targets(targets) + \
        f"\n\nWall time {params['wall_s']:.0f} s; load average at the end {params['load_average_end']}."
    print(text)
    if not args.no_json:
        path = common.write_json({"benchmark": "lookup", "params": params, "results": results, "targets": targets,
                                  "markdown": text}, "lookup", stamp)
        png = plot(results, common.RESULTS_DIR / f"lookup-{stamp}.png")
        print(f"\nresults: {path.relative_to(common.ROOT)}" +
              (f", plot: {png.relative_to(common.ROOT)}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
