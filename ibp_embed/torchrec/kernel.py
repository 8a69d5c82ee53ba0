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

On a CUDA device (the plan's compute device "cuda") the shards stay compressed in host
memory: inference lookups run on the GPU (ibp_embed.torchrec.device.DeviceTable, with an
HBM cache of hot rows when fused_params carry ``cache_load_factor``, evicting by
``cache_algorithm`` LRU or LFU); training reads the host store, reduces row gradients
on the GPU and steps on the host. Optimizer state is in host memory, beside the rows.
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

from .. import cuda
from ..store import UpdatableTable
from ..table import CompressedTable
from .device import DeviceTable, cache_options, check_device, device_pooled_lookup
from .fused_optimizer import IBPFusedOptimizer, optimizer_from_fused_params
from .lookup import (
    JobCache,
    Slot,
    apply_updates,
    compress_weight,
    lookup_jobs,
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
                 device: Optional[torch.device] = None, sharding_type: Optional[ShardingType] = None
                 ) -> None:
        super().__init__()
        self._device = None if device is None else torch.device(device)
        fp = config.fused_params or {}
        self._cache_options = cache_options(fp.get("cache_load_factor"), fp.get("cache_algorithm"))
        if self._device is not None and self._device.type == "cuda":
            self._device = check_device(self._device)
        self._device_tables: List[Optional[DeviceTable]] = [None] * len(config.embedding_tables)
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
        self._job_cache = JobCache()  # inference lookups' native jobs
        self._codec_options: Dict[str, Any] = {}
        # Optimizer state on the host, where the optimizer runs (meta on the meta device).
        self._states = [{k: v.to("meta" if t.local_metadata.placement.device().type == "meta" else "cpu")
                         for k, v in self.optimizer.init_state(t.local_rows, t.local_cols).items()}
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
        self._device_tables[i] = None  # placed again by the next inference forward

    def shard_weight(self, i: int) -> torch.Tensor:
        """Local shard i decompressed (for checkpoints); a meta tensor on the meta device."""
        t = self._config.embedding_tables[i]
        if t.local_metadata.placement.device().type == "meta":
            return torch.empty((t.local_rows, t.local_cols), dtype=self._dtypes[i], device="meta")
        return self._table(i).decompress()

    def compressed_tables(self) -> List[Optional[CompressedTable]]:
        return list(self._tables)

    @property
    def lookup_copy_nbytes(self) -> int:
        """Bytes of the decoded copies of its small shards that lookups made."""
        return sum(t.lookup_copy_nbytes for t in self._tables if isinstance(t, CompressedTable))

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
                self._device_tables[i] = None

    @property
    def on_cuda(self) -> bool:
        return self._device is not None and self._device.type == "cuda"

    def device_tables(self) -> List[DeviceTable]:
        """The shards placed on the CUDA device (placed now if needed; immutable tables only)."""
        for i in range(len(self._tables)):
            if self._device_tables[i] is None:
                table = self._table(i)
                if isinstance(table, UpdatableTable):
                    raise RuntimeError(f"IBP kernel: table {self._config.embedding_tables[i].name!r} is "
                                       f"trainable; its rows are read on the host")
                self._device_tables[i] = DeviceTable(table, self._device, **self._cache_options)
        return list(self._device_tables)

    def cache_stats(self) -> Dict[str, dict]:
        """Shard's table name -> its HBM RowCache's counters (cached shards only)."""
        return {t.name: d.cache_stats() for t, d in zip(self._config.embedding_tables, self._device_tables)
                if d is not None and d.cache is not None}

    def _slots(self) -> List[Slot]:
        return [Slot(self._table(i), self._mode, t.local_cols, t.local_rows, f, t.name)
                for i, t in enumerate(self._config.embedding_tables) for f in t.feature_names]

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        n_features = sum(len(t.feature_names) for t in self._config.embedding_tables)
        if len(features.keys()) != n_features:
            raise ValueError(f"IBP kernel: {len(features.keys())} input keys for {n_features} features")
        # Only a module in training mode becomes trainable (updatable stores, host lookups on
        # cuda): eval() without no_grad() keeps the immutable, device-decoded tables.
        training = self.training and torch.is_grad_enabled() and features.values().device.type != "meta"
        if training:
            self._make_trainable()
        elif self.on_cuda and not any(isinstance(t, UpdatableTable) for t in self._tables) \
                and features.values().device.type != "meta":
            return self._device_forward(features)
        out = cuda.storage_device(self._device) if self.on_cuda else torch.device("cpu")
        if training:
            jobs, b = lookup_jobs(features, self._slots(), self._config.is_weighted, "IBP kernel")
            return training_lookup(self, jobs, b, "IBP kernel", out)
        # keys are the shards' features in order (checked above)
        values = self._job_cache.lookup(features, tuple(self._tables), lambda keys: (self._slots(), range(len(keys))),
                                        self._config.is_weighted, "IBP kernel")
        return values if values.is_meta else values.to(out)

    def _device_forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        placed = self.device_tables()
        slots = [Slot(placed[i], self._mode, t.local_cols, t.local_rows, f, t.name)
                 for i, t in enumerate(self._config.embedding_tables) for f in t.feature_names]
        return device_pooled_lookup(features, slots, self._config.is_weighted, "IBP kernel")

    def apply_sparse_update(self, jobs, b: int, grad_out: torch.Tensor) -> None:
        """Backward: per local shard, its rows' summed gradients (reduced on the GPU for a
        kernel on cuda) and one optimizer step."""
        index = {id(t): i for i, t in enumerate(self._tables)}

        def key(s):
            i = index.get(id(s.table))
            if i is None:
                raise RuntimeError(f"IBP kernel: table {s.table_name!r} was replaced between forward and backward")
            return i

        apply_updates(jobs, b, grad_out, self.optimizer, key,
                      lambda i: (self._tables[i], self._states[i], self._mode), on_device=self.on_cuda)

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

