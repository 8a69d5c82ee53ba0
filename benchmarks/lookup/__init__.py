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
table; its hot rows are the rows the Zipf ids draw most). Full run: all 12 sets, or every
combination of --dtypes, --dims (any, e.g. 384) and --inits; quick: fp32 d128 torchrec /
trained-like, fp32 d64 and fp16 d64 torchrec, bf16 d64 trained-like (those of them the
three select).
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
batches (default 2, quick 1); the median pass is reported). Each round takes its own order,
drawn at random (common.round_orders, the same draw every run), and none starts with the
system the round before ended with: a fixed order timed each system after the same
neighbour every round, and the one after FBGEMM on the rows FBGEMM left in cache. Large
allocations come from a heap that stays mapped (common.steady_allocations): a batch's
54 MiB output was otherwise a fresh mapping, page-faulted at random, and FBGEMM's timings
swung 3x with it:
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
computed pair by pair in this run (ibp lookup / fbgemm TBE, ibp EBC / torchrec FusedEBC),
round by round: a round's ratio is the pair's two times in that round, and the ratio
reported is the median of the rounds' (ibp_vs_fbgemm_round_ratios holds them all; the
report prints their spread). On a host whose speed moves between rounds (a shared VM's
neighbours), the ratio of the two medians can pair a fast round of one with a slow round
of the other. Every configuration (table set x workload) carries
ibp_vs_fbgemm_throughput_ratio (ibp lookup W64 K1 against fbgemm TBE; null where FBGEMM
has no kernel) and ibp_vs_fbgemm_throughput_ratios (every pair). The issue's targets are
printed as met / not met with their numbers, never asserted.

Output: markdown tables on stdout (progress on stderr), benchmarks/results/lookup-<UTC
time>.json and benchmarks/results/lookup-<UTC time>.png.
"""
from ibp_embed import datasets  # re-exported: tests read L.datasets

from .cli import main, parse_args
from .names import FBGEMM, HEADLINE, TORCHREC
from .plot import plot
from .report import check_targets, format_targets, report
from .run import run_table_set
from .tables import TableSet, criteo_rows, load_trained_tables, trained_table_sets
from .workloads import CENTER, Workload, batch_host_bytes, index_bytes_per_row, make_batch

__all__ = ["CENTER", "FBGEMM", "HEADLINE", "TORCHREC", "TableSet", "Workload", "batch_host_bytes",
           "check_targets", "criteo_rows", "datasets", "format_targets", "index_bytes_per_row",
           "load_trained_tables", "main", "make_batch", "parse_args", "plot", "report", "run_table_set",
           "trained_table_sets"]
