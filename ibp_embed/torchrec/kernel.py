"""The IBP compute kernel under DistributedModelParallel (``customized_kernel``).

IBPBatchedEmbeddingBag holds the local shards of one grouped config as compressed
tables and behaves like TorchRec's ``fused`` kernel (BatchedFusedEmbeddingBag over
FBGEMM's TBE): KJT in, pooled [B, sum of local dims] out, and, when autograd runs,
backward applies the sparse optimizer named by the plan's ``fused_params`` to the
rows the batch touched (no dense gradient). Its ``fused_optimizer`` (IBPFusedOptimizer) lays its
state out as TorchRec's EmbeddingFusedOptimizer does, so ``dmp.fused_optimizer``
state_dict / load_state_dict / learning-rate changes work as for ``fused`` tables.

Tables stay immutable CompressedTables until the first forward with grad enabled;
then they become UpdatableTables (libibp's store). Inference never pays for it.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig, ShardingType
from torchrec.modules.embedding_configs import data_type_to_dtype, pooling_type_to_pooling_mode
from torchrec.optim.fused import FusedOptimizer, FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..store import UpdatableTable
from ..table import CompressedTable
from .fused_optimizer import IBPFusedOptimizer, optimizer_from_fused_params
from .lookup import (
    CUDA_MISSING,
    Slot,
    check_dedup,
    compress_weight,
    concat_features,
    lookup_jobs,
    run_lookup_jobs,
    training_lookup,
)

DEFAULT_REPACK_DRIFT = 0.05


class IBPBatchedEmbeddingBag(BaseEmbedding, FusedOptimizerModule):
    """The customized kernel: every table shard of one grouped config, IBP-compressed.

    forward(KJT) -> [B, sum of local dims], features in the config's order, as
    TorchRec's BatchedFusedEmbeddingBag returns them. Weights are loaded by
    IBPShardedEmbeddingBagCollection (load_shard); until then forward raises.
    """

    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, sharding_type: Optional[ShardingType] = None,
                 dedup: str = "never") -> None:
        super().__init__()
        if device is not None and torch.device(device).type == "cuda":
            raise NotImplementedError(f"IBP customized_kernel on {device}: {CUDA_MISSING}")
        self.dedup = check_dedup(dedup)
        self._config = config
        self._pg = pg
        # TorchRec's rule: row-wise shards pool MEAN tables as SUM (the sharded module divides).
        self._mode = pooling_type_to_pooling_mode(config.pooling, sharding_type).name.lower()
        self._dtypes = []
        for t in config.embedding_tables:
            dtype = data_type_to_dtype(t.data_type)
            if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"IBP kernel: table {t.name!r} has data_type {t.data_type.value}; "
                                 f"FP32, FP16 or BF16 only")
            self._dtypes.append(dtype)
        self.optimizer = optimizer_from_fused_params(config.fused_params)
        self._tables: List[Optional[CompressedTable]] = [None] * len(config.embedding_tables)
        self._codec_options: Dict[str, Any] = {}
        self._states = [{k: v.to(t.local_metadata.placement.device()) for k, v in
                         self.optimizer.init_state(t.local_rows, t.local_cols).items()}
                        for t in config.embedding_tables]
        self._optim = IBPFusedOptimizer(config, self.optimizer, self._states, self._dtypes, pg)

    @property
    def config(self) -> GroupedEmbeddingConfig:
        return self._config

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optim

    def shard_info(self) -> List[Tuple[str, Any, torch.dtype]]:
        """(table name, ShardMetadata, dtype) of every local shard, in config order."""
        return [(t.name, t.local_metadata, d) for t, d in zip(self._config.embedding_tables, self._dtypes)]

    def set_codec_options(self, codec_options: Dict[str, Any]) -> None:
        self._codec_options = dict(codec_options)

    def load_shard(self, i: int, weight: torch.Tensor) -> None:
        """Compress `weight` into local shard i (optimizer state is kept, as TorchRec keeps
        a fused table's state when its weights are loaded)."""
        t = self._config.embedding_tables[i]
        if tuple(weight.shape) != (t.local_rows, t.local_cols):
            raise ValueError(f"table {t.name!r}: shard weight has shape {tuple(weight.shape)}, expected "
                             f"({t.local_rows}, {t.local_cols})")
        table = compress_weight(weight, self._dtypes[i], self._codec_options)
        if isinstance(self._tables[i], UpdatableTable):
            table = self._updatable(table)
        self._tables[i] = table

    def shard_weight(self, i: int) -> torch.Tensor:
        """Local shard i decompressed (for checkpoints); a meta tensor on the meta device."""
        t = self._config.embedding_tables[i]
        if t.local_metadata.placement.device().type == "meta":
            return torch.empty((t.local_rows, t.local_cols), dtype=self._dtypes[i], device="meta")
        return self._table(i).decompress()

    def compressed_tables(self) -> List[Optional[CompressedTable]]:
        return list(self._tables)

    def _table(self, i: int):
        table = self._tables[i]
        if table is None:
            raise RuntimeError(f"IBP table {self._config.embedding_tables[i].name!r} has no weights loaded")
        return table

    def _updatable(self, table: CompressedTable) -> UpdatableTable:
        return UpdatableTable(table, repack_drift=DEFAULT_REPACK_DRIFT, codec_options=self._codec_options)

    def _make_trainable(self) -> None:
        for i in range(len(self._tables)):
            if not isinstance(self._table(i), UpdatableTable):
                self._tables[i] = self._updatable(self._tables[i])

    def _slots(self) -> List[Slot]:
        return [Slot(self._table(i), self._mode, t.local_cols, t.local_rows, f, t.name)
                for i, t in enumerate(self._config.embedding_tables) for f in t.feature_names]

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        n_features = sum(len(t.feature_names) for t in self._config.embedding_tables)
        if len(features.keys()) != n_features:
            raise ValueError(f"IBP kernel: {len(features.keys())} input keys for {n_features} features")
        training = torch.is_grad_enabled() and features.values().device.type != "meta"
        if training:
            self._make_trainable()
        jobs, b = lookup_jobs(features, self._slots(), self._config.is_weighted, "IBP kernel")
        if jobs is None:
            return torch.empty((b, sum(t.local_cols * len(t.feature_names) for t in self._config.embedding_tables)),
                               dtype=torch.float32, device="meta")
        if training:
            return training_lookup(self, jobs, b, self.dedup)
        return run_lookup_jobs(jobs, b, self.dedup)

    def apply_sparse_update(self, jobs, b: int, grad_out: torch.Tensor) -> None:
        """Backward: per local shard, its rows' summed gradients and one optimizer step."""
        index = {id(t): i for i, t in enumerate(self._tables)}
        by_table: Dict[int, list] = {}
        col = 0
        for s, ids, bag_off, ws in jobs:
            i = index.get(id(s.table))
            if i is None:
                raise RuntimeError(f"IBP kernel: table {s.table_name!r} was replaced between forward and backward")
            by_table.setdefault(i, []).append((ids, bag_off, ws, col))
            col += s.dim
        for i, items in by_table.items():
            indices, offsets, weights, cols = concat_features(items)
            self._tables[i].apply_gradients(self.optimizer, self._states[i], indices, offsets, b, grad_out,
                                            cols, weights, self._mode)

    # Hooks TorchRec's lookup and sharded module call on every kernel.
    def named_parameters_by_table(self):
        return iter(())

    def flush(self) -> None:
        pass

    def purge(self) -> None:
        pass

    def extra_repr(self) -> str:
        return (", ".join(f"{t.name}[{t.local_rows}x{t.local_cols}]" for t in self._config.embedding_tables)
                + f", optimizer={self.optimizer!r}")
