"""IBP storage as a sharding-plan option under TorchRec's DistributedModelParallel.

Users keep their model (a plain ``torchrec.EmbeddingBagCollection``) and choose, per
table, IBP storage by planning it with TorchRec's reserved ``customized_kernel``::

    constraints = ibp_constraints(["big_table"])            # the tables to compress
    planner = ibp_planner(topology, batch_size=B, constraints=constraints)
    sharders = [IBPEmbeddingBagCollectionSharder()]
    plan = planner.collective_plan(model, sharders, pg)     # a stock EmbeddingShardingPlanner
    model = DistributedModelParallel(model, env=..., device=cpu, plan=plan, sharders=sharders)

Tables planned with ``customized_kernel`` are compressed into IBP shards (one
:class:`ibp_embed.CompressedTable` per local shard) and looked up by the native
library; every other table keeps TorchRec's own kernels (``fused`` = FBGEMM TBE) in
the same ShardedEmbeddingBagCollection.

Plug-in chain (as NVIDIA's dynamicemb does): IBPEmbeddingBagCollectionSharder.shard()
-> IBPShardedEmbeddingBagCollection.create_embedding_bag_sharding() -> IBP table-wise /
column-wise shardings whose create_lookup() returns IBPGroupedPooledEmbeddingsLookup,
whose _create_embedding_kernel() builds IBPBatchedEmbeddingBag for customized tables.

Planning: the stock perf estimator has no bandwidth for ``customized_kernel`` and the
stock storage estimator counts raw bytes. :func:`ibp_estimators` returns the stock
estimators configured for it (IBPPerfEstimatorConfig: a bandwidth for the kernel;
IBPStorageEstimator: the shard's *compressed* size in host memory), and
:func:`ibp_planner` builds a stock ``EmbeddingShardingPlanner`` whose enumerator uses them.
DMP's own default planner (built when no ``plan=`` is given) uses the stock estimators and
so cannot cost the kernel: pass the plan.

Supported: table-wise, column-wise and table-column-wise sharding on CPU (gloo).
Not supported: row-wise / table-row-wise / grid (TorchRec offers them on CUDA only and
ibp_embed has no CUDA lookup yet), data-parallel (IBP tables are immutable), training
(IBP tables take no gradient and have no optimizer), VBE inputs.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import (
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    ShardingType,
)
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
    replace_placement_with_meta_device,
)
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator.config import EmbeddingPerfEstimatorConfig
from torchrec.distributed.planner.estimator.estimator import EmbeddingPerfEstimator
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import ParameterConstraints, ShardingOption, Storage
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.sharding.twcw_sharding import TwCwPooledEmbeddingSharding
from torchrec.modules.embedding_configs import EmbeddingBagConfig, data_type_to_dtype
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..table import CompressedTable
from .modules import (
    CUDA_MISSING,
    _Slot,
    check_codec_options,
    check_dedup,
    compress_weight,
    pooled_lookup,
    pooling_mode,
)

__all__ = [
    "IBP_COMPUTE_KERNEL",
    "IBP_SHARDING_TYPES",
    "IBPBatchedEmbeddingBag",
    "IBPGroupedPooledEmbeddingsLookup",
    "IBPShardedEmbeddingBagCollection",
    "IBPEmbeddingBagCollectionSharder",
    "IBPPerfEstimatorConfig",
    "IBPStorageEstimator",
    "ibp_constraints",
    "ibp_estimators",
    "ibp_planner",
]

IBP_COMPUTE_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
IBP_SHARDING_TYPES = (
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
)
# Planner bandwidth of the IBP CPU kernel relative to DDR bandwidth (FBGEMM's fused CPU
# kernel is 1.0). benchmarks/lookup.py measured 0.1-0.2x FBGEMM HOST TBE throughput on
# the development machine (AMD EPYC, 1 thread, Zipf ids); a rough figure.
DEFAULT_CPU_BANDWIDTH_FACTOR = 0.15


def _is_ibp(kernel) -> bool:
    return getattr(kernel, "value", kernel) == IBP_COMPUTE_KERNEL


# ---------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------

class IBPBatchedEmbeddingBag(BaseEmbedding):
    """The customized kernel: every table shard of one grouped config, IBP-compressed.

    forward(KJT) -> [B, sum of local dims], features in the config's order, as
    TorchRec's BatchedFusedEmbeddingBag returns them. Weights are loaded by
    IBPShardedEmbeddingBagCollection (load_shard); until then forward raises.
    """

    def __init__(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, dedup: str = "never") -> None:
        super().__init__()
        self.dedup = check_dedup(dedup)
        if device is not None and torch.device(device).type == "cuda":
            raise NotImplementedError(f"IBP customized_kernel on {device}: {CUDA_MISSING}")
        self._config = config
        self._pg = pg
        self._mode = pooling_mode(config.pooling)
        self._dtypes = []
        for t in config.embedding_tables:
            dtype = data_type_to_dtype(t.data_type)
            if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"IBP kernel: table {t.name!r} has data_type {t.data_type.value}; "
                                 f"FP32, FP16 or BF16 only")
            self._dtypes.append(dtype)
        self._tables: List[Optional[CompressedTable]] = [None] * len(config.embedding_tables)

    @property
    def config(self) -> GroupedEmbeddingConfig:
        return self._config

    def shard_info(self) -> List[Tuple[str, Any, torch.dtype]]:
        """(table name, ShardMetadata, dtype) of every local shard, in config order."""
        return [(t.name, t.local_metadata, d) for t, d in zip(self._config.embedding_tables, self._dtypes)]

    def load_shard(self, i: int, weight: torch.Tensor, codec_options: Dict[str, Any]) -> None:
        t = self._config.embedding_tables[i]
        if tuple(weight.shape) != (t.local_rows, t.local_cols):
            raise ValueError(f"table {t.name!r}: shard weight has shape {tuple(weight.shape)}, expected "
                             f"({t.local_rows}, {t.local_cols})")
        self._tables[i] = compress_weight(weight, self._dtypes[i], codec_options)

    def shard_weight(self, i: int) -> torch.Tensor:
        """Local shard i decompressed (for checkpoints)."""
        table = self._tables[i]
        if table is None:
            t = self._config.embedding_tables[i]
            raise RuntimeError(f"IBP table {t.name!r} has no weights loaded")
        return table.decompress()

    def compressed_tables(self) -> List[Optional[CompressedTable]]:
        return list(self._tables)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        slots = []
        for t, table in zip(self._config.embedding_tables, self._tables):
            if table is None:
                raise RuntimeError(f"IBP table {t.name!r} has no weights loaded")
            for f in t.feature_names:
                slots.append(_Slot(table, self._mode, t.local_cols, t.local_rows, f, t.name))
        if len(features.keys()) != len(slots):
            raise ValueError(f"IBP kernel: {len(features.keys())} input keys for {len(slots)} features")
        return pooled_lookup(features, slots, self._config.is_weighted, "IBP kernel", dedup=self.dedup)

    # Hooks TorchRec's lookup and sharded module call on every kernel.
    def named_parameters_by_table(self) -> Iterator[Tuple[str, Any]]:
        return iter(())

    def flush(self) -> None:
        pass

    def purge(self) -> None:
        pass

    def extra_repr(self) -> str:
        return ", ".join(f"{t.name}[{t.local_rows}x{t.local_cols}]" for t in self._config.embedding_tables)


class IBPGroupedPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's pooled lookup, building IBPBatchedEmbeddingBag for customized tables."""

    def _create_embedding_kernel(self, config: GroupedEmbeddingConfig, device, pg, sharding_type, env
                                 ) -> BaseEmbedding:
        if _is_ibp(config.compute_kernel):
            return IBPBatchedEmbeddingBag(config=config, pg=pg, device=device)
        return super()._create_embedding_kernel(config, device, pg, sharding_type, env)


def _ibp_create_lookup(self, device=None, fused_params=None, feature_processor=None):
    return IBPGroupedPooledEmbeddingsLookup(
        grouped_configs=self._grouped_embedding_configs,
        pg=self._pg,
        device=device if device is not None else self._device,
        feature_processor=feature_processor,
        env=self._env,
    )


class IBPTwPooledEmbeddingSharding(TwPooledEmbeddingSharding):
    create_lookup = _ibp_create_lookup


class IBPCwPooledEmbeddingSharding(CwPooledEmbeddingSharding):
    create_lookup = _ibp_create_lookup


class IBPTwCwPooledEmbeddingSharding(TwCwPooledEmbeddingSharding):
    create_lookup = _ibp_create_lookup


_IBP_SHARDINGS = {
    ShardingType.TABLE_WISE.value: IBPTwPooledEmbeddingSharding,
    ShardingType.COLUMN_WISE.value: IBPCwPooledEmbeddingSharding,
    ShardingType.TABLE_COLUMN_WISE.value: IBPTwCwPooledEmbeddingSharding,
}


# ---------------------------------------------------------------------------
# Sharded module and sharder
# ---------------------------------------------------------------------------

class IBPShardedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """ShardedEmbeddingBagCollection whose customized_kernel tables live in IBP shards.

    Initial IBP weights come from the unsharded module's tables (the local shard of
    each, compressed), or from each config's init_fn when the module is on the meta
    device. state_dict() adds ``embedding_bags.<table>.weight`` as a ShardedTensor of
    decompressed local shards (like TorchRec's other tables); load_state_dict accepts
    that or a full tensor and re-compresses the local shards.
    """

    def __init__(self, module: EmbeddingBagCollection, table_name_to_parameter_sharding, env,
                 fused_params=None, device=None, qcomm_codecs_registry=None, module_fqn=None,
                 sharded_module_order_overwrite=None, codec_options: Optional[Dict[str, Any]] = None,
                 dedup: str = "never"):
        for name, ps in table_name_to_parameter_sharding.items():
            if _is_ibp(ps.compute_kernel) and ps.sharding_type not in IBP_SHARDING_TYPES:
                if ps.sharding_type in (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value,
                                        ShardingType.GRID_SHARD.value):
                    raise NotImplementedError(
                        f"table {name!r}: {ps.sharding_type} sharding of an IBP (customized_kernel) table is "
                        f"not implemented: TorchRec offers row-wise sharding only on CUDA and ibp_embed has no "
                        f"CUDA lookup path yet; use table_wise or column_wise")
                raise NotImplementedError(
                    f"table {name!r}: {ps.sharding_type} sharding of an IBP (customized_kernel) table is not "
                    f"supported (IBP tables are immutable, inference-only); use table_wise or column_wise")
        super().__init__(module=module, table_name_to_parameter_sharding=table_name_to_parameter_sharding,
                         env=env, fused_params=fused_params, device=device,
                         qcomm_codecs_registry=qcomm_codecs_registry, module_fqn=module_fqn,
                         sharded_module_order_overwrite=sharded_module_order_overwrite)
        self._ibp_codec_options = check_codec_options(codec_options or {})
        for kernel in self.ibp_kernels():
            kernel.dedup = check_dedup(dedup)
        # table name -> [(kernel, index in kernel, ShardMetadata, dtype)]
        self._ibp_shards: Dict[str, List[Tuple[IBPBatchedEmbeddingBag, int, Any, torch.dtype]]] = {}
        for kernel in self.ibp_kernels():
            for i, (name, md, dtype) in enumerate(kernel.shard_info()):
                self._ibp_shards.setdefault(name, []).append((kernel, i, md, dtype))
        self._ibp_table_names = [
            c.name for c in self._embedding_bag_configs
            if _is_ibp(self.module_sharding_plan[c.name].compute_kernel)]
        self._init_ibp_weights(module)
        self._register_state_dict_hook(IBPShardedEmbeddingBagCollection._ibp_state_dict_hook)
        self.register_load_state_dict_pre_hook(IBPShardedEmbeddingBagCollection._ibp_load_hook)

    @classmethod
    def create_embedding_bag_sharding(cls, sharding_infos: List[EmbeddingShardingInfo], env, device=None,
                                      permute_embeddings: bool = False, qcomm_codecs_registry=None):
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        if sharding_type in _IBP_SHARDINGS and device is not None and device.type == "meta":
            replace_placement_with_meta_device(sharding_infos)
        if sharding_type == ShardingType.TABLE_WISE.value:
            return IBPTwPooledEmbeddingSharding(sharding_infos, env, device,
                                                qcomm_codecs_registry=qcomm_codecs_registry)
        if sharding_type == ShardingType.COLUMN_WISE.value:
            return IBPCwPooledEmbeddingSharding(sharding_infos, env, device, permute_embeddings=permute_embeddings,
                                                qcomm_codecs_registry=qcomm_codecs_registry)
        if sharding_type == ShardingType.TABLE_COLUMN_WISE.value:
            return IBPTwCwPooledEmbeddingSharding(sharding_infos, env, device,
                                                  permute_embeddings=permute_embeddings,
                                                  qcomm_codecs_registry=qcomm_codecs_registry)
        return super().create_embedding_bag_sharding(
            sharding_infos, env, device, permute_embeddings=permute_embeddings,
            qcomm_codecs_registry=qcomm_codecs_registry)

    def ibp_kernels(self) -> List[IBPBatchedEmbeddingBag]:
        out = []
        for lookup in self._lookups:
            while hasattr(lookup, "module") and not hasattr(lookup, "_emb_modules"):
                lookup = lookup.module  # DistributedDataParallel
            for k in getattr(lookup, "_emb_modules", []):
                if isinstance(k, IBPBatchedEmbeddingBag):
                    out.append(k)
        return out

    @property
    def ibp_compressed_nbytes(self) -> int:
        """Bytes of the IBP shards held by this rank."""
        return sum(t.nbytes for k in self.ibp_kernels() for t in k.compressed_tables() if t is not None)

    def reset_parameters(self) -> None:
        # TorchRec's version reads every table's registered weight; IBP tables have none.
        ibp = set(getattr(self, "_ibp_table_names", None) or [
            n for n, ps in self.module_sharding_plan.items() if _is_ibp(ps.compute_kernel)])
        configs = self._embedding_bag_configs
        try:
            self._embedding_bag_configs = [c for c in configs if c.name not in ibp]
            super().reset_parameters()
        finally:
            self._embedding_bag_configs = configs
        if hasattr(self, "_ibp_shards") and not (self._device and self._device.type == "meta"):
            self._init_ibp_weights(None)

    def _init_ibp_weights(self, module: Optional[nn.Module]) -> None:
        by_name = {c.name: c for c in self._embedding_bag_configs}
        for name, shards in self._ibp_shards.items():
            src = None
            if module is not None and hasattr(module, "embedding_bags") and name in module.embedding_bags:
                w = getattr(module.embedding_bags[name], "weight", None)
                if isinstance(w, torch.Tensor) and w.device.type != "meta":
                    src = w
            for kernel, i, md, dtype in shards:
                (r0, c0), (nr, nc) = md.shard_offsets, md.shard_sizes
                if src is not None:
                    local = src.detach()[r0:r0 + nr, c0:c0 + nc]
                else:
                    local = torch.empty((nr, nc), dtype=dtype)
                    init_fn = by_name[name].init_fn
                    with torch.no_grad():
                        out = init_fn(local) if init_fn is not None else None
                    if isinstance(out, torch.Tensor) and out.shape == local.shape:
                        local = out
                kernel.load_shard(i, local, self._ibp_codec_options)

    @staticmethod
    def _ibp_state_dict_hook(module: "IBPShardedEmbeddingBagCollection", destination, prefix, _local_metadata):
        pg = module._env.process_group
        for name in module._ibp_table_names:
            config = module._table_name_to_config[name]
            dtype = data_type_to_dtype(config.data_type)
            spec = module.module_sharding_plan[name].sharding_spec
            md = spec.build_metadata(tensor_sizes=torch.Size((config.num_embeddings, config.embedding_dim)),
                                     tensor_properties=TensorProperties(dtype=dtype))
            local = [Shard(tensor=kernel.shard_weight(i), metadata=smd)
                     for kernel, i, smd, _ in module._ibp_shards.get(name, [])]
            destination[f"{prefix}embedding_bags.{name}.weight"] = \
                ShardedTensor._init_from_local_shards_and_global_metadata(
                    local_shards=local, sharded_tensor_metadata=md, process_group=pg)

    @staticmethod
    def _ibp_load_hook(module: "IBPShardedEmbeddingBagCollection", state_dict, prefix, local_metadata, strict,
                       missing_keys, unexpected_keys, error_msgs):
        for name in module._ibp_table_names:
            key = f"{prefix}embedding_bags.{name}.weight"
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
                continue
            value = state_dict.pop(key)
            config = module._table_name_to_config[name]
            full = (config.num_embeddings, config.embedding_dim)
            for kernel, i, md, _ in module._ibp_shards.get(name, []):
                (r0, c0), (nr, nc) = md.shard_offsets, md.shard_sizes
                if isinstance(value, ShardedTensor):
                    if tuple(value.size()) != full:
                        raise RuntimeError(f"size mismatch for {key}: checkpoint {tuple(value.size())}, "
                                           f"model {full}")
                    match = [s.tensor for s in value.local_shards()
                             if list(s.metadata.shard_offsets) == [r0, c0]
                             and list(s.metadata.shard_sizes) == [nr, nc]]
                    if not match:
                        raise RuntimeError(f"{key}: the checkpoint's ShardedTensor has no local shard at "
                                           f"offsets {[r0, c0]} sizes {[nr, nc]} on this rank (resharding a "
                                           f"checkpoint needs a full tensor)")
                    local = match[0]
                elif isinstance(value, torch.Tensor) and type(value).__name__ != "DTensor":
                    if tuple(value.shape) != full:
                        raise RuntimeError(f"size mismatch for {key}: copying a param with shape "
                                           f"{tuple(value.shape)} from checkpoint, the shape in current "
                                           f"model is {full}.")
                    local = value[r0:r0 + nr, c0:c0 + nc]
                else:
                    raise RuntimeError(f"{key}: cannot load a {type(value).__name__} into an IBP table "
                                       f"(use a full tensor or a ShardedTensor)")
                if local.device.type == "meta":
                    raise RuntimeError(f"{key}: the checkpoint holds a meta tensor (no values)")
                kernel.load_shard(i, local, module._ibp_codec_options)


class IBPEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """EmbeddingBagCollectionSharder that also offers the IBP ``customized_kernel``.

    Give it to DistributedModelParallel (and the planner) in place of TorchRec's EBC
    sharder. Tables whose plan says ``customized_kernel`` get IBP storage; every other
    table is sharded exactly as TorchRec's own sharder would. Codec options
    (word_bits, clusters, threshold, sample_rows, seed) are passed to ibp_embed.compress.

    dedup ("auto", "always", "never") is the IBP kernels' lookup mode, as in
    IBPEmbeddingBagCollection. The kernel is offered on CPU only, for table-wise,
    column-wise and table-column-wise sharding (there is no CUDA lookup path yet).
    """

    def __init__(self, fused_params: Optional[Dict[str, Any]] = None, qcomm_codecs_registry=None,
                 sharded_module_order_overwrite=None, dedup: str = "never", **codec_options: Any) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry,
                         sharded_module_order_overwrite=sharded_module_order_overwrite)
        self._codec_options = check_codec_options(codec_options)
        self._dedup = check_dedup(dedup)

    @property
    def codec_options(self) -> Dict[str, Any]:
        return dict(self._codec_options)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        kernels = list(super().compute_kernels(sharding_type, compute_device_type))
        if compute_device_type == "cpu" and sharding_type in IBP_SHARDING_TYPES:
            kernels.append(IBP_COMPUTE_KERNEL)
        return kernels

    def shard(self, module: EmbeddingBagCollection, params, env, device: Optional[torch.device] = None,
              module_fqn: Optional[str] = None) -> IBPShardedEmbeddingBagCollection:
        if device is not None and device.type == "cuda" and any(_is_ibp(p.compute_kernel) for p in params.values()):
            raise NotImplementedError(f"IBP customized_kernel tables on {device}: {CUDA_MISSING}")
        return IBPShardedEmbeddingBagCollection(
            module=module, table_name_to_parameter_sharding=params, env=env, fused_params=self.fused_params,
            device=device, qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
            codec_options=self._codec_options, dedup=self._dedup)

    @property
    def sharded_module_type(self):
        return IBPShardedEmbeddingBagCollection


# ---------------------------------------------------------------------------
# Planner support
# ---------------------------------------------------------------------------

def ibp_constraints(tables: Iterable[Union[str, EmbeddingBagConfig]],
                    sharding_types: Sequence[str] = (ShardingType.TABLE_WISE.value,
                                                     ShardingType.COLUMN_WISE.value),
                    **constraint_kwargs: Any) -> Dict[str, ParameterConstraints]:
    """ParameterConstraints that put `tables` (names or configs) on IBP storage.

    Each gets ``compute_kernels=["customized_kernel"]`` and the allowed sharding types
    (table_wise and column_wise by default; table_column_wise is also supported).
    Other ParameterConstraints fields (pooling_factors, ...) pass through. Merge the
    result with constraints for your other tables and give it to the planner.
    """
    bad = [s for s in sharding_types if s not in IBP_SHARDING_TYPES]
    if bad:
        raise ValueError(f"IBP tables support sharding types {list(IBP_SHARDING_TYPES)}, not {bad}"
                         f"{' (row-wise needs CUDA)' if any('row' in b for b in bad) else ''}")
    out = {}
    for t in tables:
        name = t.name if isinstance(t, EmbeddingBagConfig) else str(t)
        out[name] = ParameterConstraints(sharding_types=list(sharding_types),
                                         compute_kernels=[IBP_COMPUTE_KERNEL], **constraint_kwargs)
    return out


class IBPPerfEstimatorConfig(EmbeddingPerfEstimatorConfig):
    """TorchRec's default perf model plus a bandwidth for the IBP customized_kernel.

    On CPU the kernel is costed like FBGEMM's fused kernel at cpu_bandwidth_factor x
    the topology's DDR bandwidth. Every other kernel is costed as by TorchRec.
    """

    def __init__(self, cpu_bandwidth_factor: float = DEFAULT_CPU_BANDWIDTH_FACTOR) -> None:
        super().__init__()
        if not cpu_bandwidth_factor > 0:
            raise ValueError("cpu_bandwidth_factor must be positive")
        self.cpu_bandwidth_factor = float(cpu_bandwidth_factor)

    def get_device_bw(self, compute_device, compute_kernel, hbm_mem_bw, ddr_mem_bw, ssd_mem_bw,
                      hbm_to_ddr_mem_bw, caching_ratio=None, prefetch_pipeline=False):
        if _is_ibp(compute_kernel):
            if compute_device.lower() == "cpu":
                return self.cpu_bandwidth_factor * ddr_mem_bw
            raise ValueError(f"IBP customized_kernel has no {compute_device} implementation to cost")
        return super().get_device_bw(compute_device, compute_kernel, hbm_mem_bw, ddr_mem_bw, ssd_mem_bw,
                                     hbm_to_ddr_mem_bw, caching_ratio, prefetch_pipeline)


class IBPStorageEstimator(EmbeddingStorageEstimator):
    """TorchRec's storage estimator, with IBP shards counted at their compressed size.

    An IBP shard costs host memory (DDR) of raw_bytes / ratio and no optimizer state.
    The ratio of a table is, in order: compression_ratios[name]; measured by
    compressing a sample of up to sample_rows rows when the planned tensor holds values;
    default_ratio (1.0 when nothing is known: conservative).
    """

    def __init__(self, topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 compression_ratios: Optional[Dict[str, float]] = None, default_ratio: float = 1.0,
                 sample_rows: int = 8192, codec_options: Optional[Dict[str, Any]] = None,
                 **kwargs: Any) -> None:
        super().__init__(topology=topology, constraints=constraints, **kwargs)
        self._ratios = dict(compression_ratios or {})
        self._default_ratio = float(default_ratio)
        self._sample_rows = int(sample_rows)
        self._codec_options = check_codec_options(codec_options or {})
        self._measured: Dict[Tuple[str, str], float] = {}

    def ratio(self, sharding_option: ShardingOption) -> float:
        name = sharding_option.name
        if name in self._ratios:
            return float(self._ratios[name])
        key = (sharding_option.path, name)
        if key not in self._measured:
            self._measured[key] = self._measure(sharding_option.tensor)
        return self._measured[key]

    def _measure(self, tensor: torch.Tensor) -> float:
        if tensor.device.type == "meta" or tensor.numel() == 0 or \
                tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return self._default_ratio
        from ..codec import compress

        n = tensor.shape[0]
        if n > self._sample_rows:
            rows = np.sort(np.random.default_rng(0).choice(n, self._sample_rows, replace=False))
            sample = tensor.detach()[torch.from_numpy(rows)]
        else:
            sample = tensor.detach()
        opts = {k: v for k, v in self._codec_options.items() if k != "progress"}
        t = compress(sample.cpu().contiguous(), progress=False, **opts)
        return max(t.ratio, 1e-6)

    def estimate(self, sharding_options: List[ShardingOption], sharder_data_map=None) -> None:
        super().estimate(sharding_options, sharder_data_map)
        for so in sharding_options:
            if not _is_ibp(so.compute_kernel):
                continue
            ratio = self.ratio(so)
            shape = so.tensor.shape
            tensor_bytes = so.tensor.numel() * so.tensor.element_size()
            try:
                from torchrec.distributed.planner.shard_estimators import _get_optimizer_multipler

                opt_mult = 0.0 if self._is_inference else _get_optimizer_multipler(
                    getattr(so.tensor, "_optimizer_classes", [None])[0], shape)
            except ImportError:  # pragma: no cover - private helper moved
                opt_mult = 0.0
            for shard in so.shards:
                if shard.storage is None:
                    continue
                raw = math.ceil(tensor_bytes * math.prod(shard.size) / math.prod(shape))
                stock = raw + math.ceil(raw * opt_mult)
                compressed = math.ceil(raw / ratio)
                if self._topology.compute_device == "cpu":
                    ddr = max(shard.storage.ddr - stock, 0) + compressed
                    shard.storage = Storage(hbm=shard.storage.hbm, ddr=ddr, ssd=shard.storage.ssd)
                else:  # host memory, whatever the compute device
                    hbm = max(shard.storage.hbm - stock, 0)
                    shard.storage = Storage(hbm=hbm, ddr=shard.storage.ddr + compressed, ssd=shard.storage.ssd)


def ibp_estimators(topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None, *,
                   compression_ratios: Optional[Dict[str, float]] = None, default_ratio: float = 1.0,
                   cpu_bandwidth_factor: float = DEFAULT_CPU_BANDWIDTH_FACTOR, is_inference: bool = False,
                   codec_options: Optional[Dict[str, Any]] = None) -> list:
    """[perf, storage] estimators for EmbeddingEnumerator that can cost customized_kernel."""
    perf = EmbeddingPerfEstimator(topology=topology, constraints=constraints, is_inference=is_inference,
                                  config=IBPPerfEstimatorConfig(cpu_bandwidth_factor))
    storage = IBPStorageEstimator(topology=topology, constraints=constraints, is_inference=is_inference,
                                  compression_ratios=compression_ratios, default_ratio=default_ratio,
                                  codec_options=codec_options)
    return [perf, storage]


def ibp_planner(topology: Topology, batch_size: int = BATCH_SIZE,
                constraints: Optional[Dict[str, ParameterConstraints]] = None, **estimator_kwargs: Any
                ) -> EmbeddingShardingPlanner:
    """A stock EmbeddingShardingPlanner whose enumerator can cost IBP tables (see ibp_estimators)."""
    enumerator = EmbeddingEnumerator(topology=topology, batch_size=batch_size, constraints=constraints,
                                     estimator=ibp_estimators(topology, constraints, **estimator_kwargs))
    return EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, constraints=constraints,
                                    enumerator=enumerator)
