"""IBP storage as a sharding-plan option under TorchRec's DistributedModelParallel.

Users keep their model (a plain ``torchrec.EmbeddingBagCollection``) and choose, per
table, IBP storage by planning it with TorchRec's reserved ``customized_kernel``::

    constraints = ibp_constraints(["big_table"])            # the tables to compress
    planner = ibp_planner(topology, batch_size=B, constraints=constraints)
    sharders = [IBPEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                               "learning_rate": 0.05})]
    plan = planner.collective_plan(model, sharders, pg)     # a stock EmbeddingShardingPlanner
    model = DistributedModelParallel(model, env=..., device=cpu, plan=plan, sharders=sharders)

Tables planned with ``customized_kernel`` are compressed into IBP shards and looked up
by the native library; they train in backward with the fused optimizer that
``fused_params`` (or ``apply_optimizer_in_backward``) names, exactly as ``fused``
tables do, and ``model.fused_optimizer`` covers both. Every other table keeps
TorchRec's own kernels in the same ShardedEmbeddingBagCollection.

Plug-in chain (as NVIDIA's dynamicemb does): IBPEmbeddingBagCollectionSharder.shard()
-> IBPShardedEmbeddingBagCollection.create_embedding_bag_sharding() -> IBP variants of
TorchRec's table-wise, column-wise, table-column-wise, row-wise and table-row-wise
shardings, whose create_lookup() returns IBPGroupedPooledEmbeddingsLookup, whose
_create_embedding_kernel() builds the IBP kernel (kernel.py) for customized tables.

Supported on CPU (gloo) and CUDA: table-wise, column-wise, table-column-wise, row-wise
and table-row-wise. On CUDA the shards stay compressed in host memory and are decoded
by the GPU, behind an optional HBM cache (``cache_load_factor`` in the plan's
cache_params or fused_params, as for fused_uvm_caching); see kernel.py. Not supported:
data-parallel (keep such tables on FBGEMM), grid sharding, VBE inputs.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig, ShardingType
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
    replace_placement_with_meta_device,
)
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.sharding.twcw_sharding import TwCwPooledEmbeddingSharding
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.modules.embedding_configs import data_type_to_dtype
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.fused import EmptyFusedOptimizer

from ..store import memory_stats
from .kernel import IBPBatchedEmbeddingBag
from .fused_optimizer import host_metadata, on_host
from .lookup import check_codec_options, warn_if_dedup
from .write_back import WriteBackTensor

__all__ = [
    "IBP_COMPUTE_KERNEL",
    "IBP_SHARDING_TYPES",
    "IBPGroupedPooledEmbeddingsLookup",
    "IBPShardedEmbeddingBagCollection",
    "IBPEmbeddingBagCollectionSharder",
]

IBP_COMPUTE_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
IBP_SHARDING_TYPES = (
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
)
# TorchRec's sharder lists these for CUDA only; its shardings run on CPU with gloo too,
# so on CPU the sharder adds them, for the IBP kernel alone.
_ROW_SHARDINGS = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)


def is_ibp(kernel) -> bool:
    return getattr(kernel, "value", kernel) == IBP_COMPUTE_KERNEL


# ---------------------------------------------------------------------------
# Lookup and shardings
# ---------------------------------------------------------------------------

class IBPGroupedPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's pooled lookup, building IBPBatchedEmbeddingBag for customized tables."""

    def _create_embedding_kernel(self, config: GroupedEmbeddingConfig, device, pg, sharding_type, env
                                 ) -> BaseEmbedding:
        if is_ibp(config.compute_kernel):
            return IBPBatchedEmbeddingBag(config=config, pg=pg, device=device, sharding_type=sharding_type)
        return super()._create_embedding_kernel(config, device, pg, sharding_type, env)


def _lookup_factory(sharding_type: Optional[ShardingType], per_rank: bool = False):
    def create_lookup(self, device=None, fused_params=None, feature_processor=None):
        configs = self._grouped_embedding_configs_per_rank[self._rank] if per_rank \
            else self._grouped_embedding_configs
        return IBPGroupedPooledEmbeddingsLookup(
            grouped_configs=configs, pg=self._pg, device=device if device is not None else self._device,
            feature_processor=feature_processor, sharding_type=sharding_type, env=self._env)
    return create_lookup


class IBPTwPooledEmbeddingSharding(TwPooledEmbeddingSharding):
    create_lookup = _lookup_factory(None)


class IBPCwPooledEmbeddingSharding(CwPooledEmbeddingSharding):
    create_lookup = _lookup_factory(None)


class IBPTwCwPooledEmbeddingSharding(TwCwPooledEmbeddingSharding):
    create_lookup = _lookup_factory(None)


class IBPRwPooledEmbeddingSharding(RwPooledEmbeddingSharding):
    create_lookup = _lookup_factory(ShardingType.ROW_WISE)


class IBPTwRwPooledEmbeddingSharding(TwRwPooledEmbeddingSharding):
    create_lookup = _lookup_factory(ShardingType.TABLE_ROW_WISE, per_rank=True)


_IBP_SHARDINGS = {
    ShardingType.TABLE_WISE.value: IBPTwPooledEmbeddingSharding,
    ShardingType.COLUMN_WISE.value: IBPCwPooledEmbeddingSharding,
    ShardingType.TABLE_COLUMN_WISE.value: IBPTwCwPooledEmbeddingSharding,
    ShardingType.ROW_WISE.value: IBPRwPooledEmbeddingSharding,
    ShardingType.TABLE_ROW_WISE.value: IBPTwRwPooledEmbeddingSharding,
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
    that or a full tensor and re-compresses the local shards. The fused optimizer's
    state of IBP tables is in ``fused_optimizer`` under TorchRec's keys.
    """

    def __init__(self, module: EmbeddingBagCollection, table_name_to_parameter_sharding, env,
                 fused_params=None, device=None, qcomm_codecs_registry=None, module_fqn=None,
                 sharded_module_order_overwrite=None, codec_options: Optional[Dict[str, Any]] = None):
        for name, ps in table_name_to_parameter_sharding.items():
            if is_ibp(ps.compute_kernel) and ps.sharding_type not in IBP_SHARDING_TYPES:
                raise NotImplementedError(
                    f"table {name!r}: {ps.sharding_type} sharding of an IBP (customized_kernel) table is not "
                    f"supported; use one of {list(IBP_SHARDING_TYPES)} (data-parallel tables stay on FBGEMM)")
        super().__init__(module=module, table_name_to_parameter_sharding=table_name_to_parameter_sharding,
                         env=env, fused_params=fused_params, device=device,
                         qcomm_codecs_registry=qcomm_codecs_registry, module_fqn=module_fqn,
                         sharded_module_order_overwrite=sharded_module_order_overwrite)
        codec_options = check_codec_options(codec_options or {})
        # table name -> [(kernel, index in kernel, ShardMetadata, dtype)]
        self._ibp_shards: Dict[str, List[Tuple[IBPBatchedEmbeddingBag, int, Any, torch.dtype]]] = {}
        for kernel in self.ibp_kernels():
            kernel.set_codec_options(codec_options)
            for i, (name, md, dtype) in enumerate(kernel.shard_info()):
                self._ibp_shards.setdefault(name, []).append((kernel, i, md, dtype))
        self._ibp_table_names = [
            c.name for c in self._embedding_bag_configs
            if is_ibp(self.module_sharding_plan[c.name].compute_kernel)]
        for name in self._ibp_table_names:
            # An empty, fused `weight`, as TorchRec registers for a table a rank holds no
            # shard of: state_dict keys stay parameters (the values come from the hook).
            if "weight" not in self.embedding_bags[name]._parameters:
                weight = nn.Parameter(torch.empty(0, device=device))
                weight._in_backward_optimizers = [EmptyFusedOptimizer()]
                self.embedding_bags[name].register_parameter("weight", weight)
        self._init_ibp_weights(module)
        self._register_state_dict_hook(IBPShardedEmbeddingBagCollection._ibp_state_dict_hook)
        self.register_load_state_dict_pre_hook(IBPShardedEmbeddingBagCollection._ibp_load_hook)

    @classmethod
    def create_embedding_bag_sharding(cls, sharding_infos: List[EmbeddingShardingInfo], env, device=None,
                                      permute_embeddings: bool = False, qcomm_codecs_registry=None):
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        sharding = _IBP_SHARDINGS.get(sharding_type)
        if sharding is None:
            return super().create_embedding_bag_sharding(
                sharding_infos, env, device, permute_embeddings=permute_embeddings,
                qcomm_codecs_registry=qcomm_codecs_registry)
        if device is not None and device.type == "meta":
            replace_placement_with_meta_device(sharding_infos)
        kwargs = {"qcomm_codecs_registry": qcomm_codecs_registry}
        if sharding_type in (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value):
            kwargs["permute_embeddings"] = permute_embeddings
        return sharding(sharding_infos, env, device, **kwargs)

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
        return self.ibp_memory_stats()["compressed_bytes"]

    def ibp_memory_stats(self) -> Dict[str, int]:
        """This rank's IBP shards: ibp_embed.store.memory_stats figures, plus the fused
        optimizer state (optimizer_state_bytes) and the decoded copies of small shards
        that lookups of few ids a row read (lookup_copy_bytes, ibp_embed.packed_jobs)."""
        kernels = self.ibp_kernels()
        stats = memory_stats(t for k in kernels for t in k.compressed_tables() if t is not None)
        stats["optimizer_state_bytes"] = sum(v.numel() * v.element_size() for k in kernels
                                             for s in k._states for v in s.values())
        stats["lookup_copy_bytes"] = sum(k.lookup_copy_nbytes for k in kernels)
        return stats

    def reset_parameters(self) -> None:
        # TorchRec's version reads every table's registered weight; IBP tables have none.
        ibp = set(getattr(self, "_ibp_table_names", None) or [
            n for n, ps in self.module_sharding_plan.items() if is_ibp(ps.compute_kernel)])
        configs = self._embedding_bag_configs
        try:
            self._embedding_bag_configs = [c for c in configs if c.name not in ibp]
            super().reset_parameters()
        finally:
            self._embedding_bag_configs = configs
        if hasattr(self, "_ibp_shards") and not (self._device and self._device.type == "meta"):
            self._init_ibp_weights(None)

    def _init_ibp_weights(self, module: Optional[nn.Module]) -> None:
        if self._device is not None and self._device.type == "meta":
            return  # no storage on the meta device: weights come with load_state_dict
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
                kernel.load_shard(i, local)

    @staticmethod
    def _ibp_state_dict_hook(module: "IBPShardedEmbeddingBagCollection", destination, prefix, _local_metadata):
        pg = module._env.process_group
        for name in module._ibp_table_names:
            config = module._table_name_to_config[name]
            dtype = data_type_to_dtype(config.data_type)
            spec = module.module_sharding_plan[name].sharding_spec
            md = host_metadata(spec.build_metadata(
                tensor_sizes=torch.Size((config.num_embeddings, config.embedding_dim)),
                tensor_properties=TensorProperties(dtype=dtype)))
            local = [Shard(tensor=_write_back(kernel.shard_weight(i), kernel, i), metadata=on_host(smd))
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
            value = state_dict[key]
            state_dict[key] = module.embedding_bags[name].weight  # the empty placeholder loads itself
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
                kernel.load_shard(i, local)


def _write_back(weight: torch.Tensor, kernel: IBPBatchedEmbeddingBag, i: int) -> torch.Tensor:
    """A decoded shard whose in-place changes re-compress shard i of kernel."""
    return weight if weight.device.type == "meta" else WriteBackTensor(weight, kernel, "load_shard", i)


class IBPEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """EmbeddingBagCollectionSharder that also offers the IBP ``customized_kernel``.

    Give it to DistributedModelParallel (and the planner) in place of TorchRec's EBC
    sharder. Tables whose plan says ``customized_kernel`` get IBP storage; every other
    table is sharded exactly as TorchRec's own sharder would. Codec options
    (word_bits, clusters, threshold, sample_rows, seed) are passed to ibp_embed.compress.

    fused_params are TorchRec's: the sparse optimizer of the sharded tables (IBP ones
    included; see ibp_embed.torchrec.kernel.optimizer_from_fused_params). dedup is
    deprecated and ignored, as in IBPEmbeddingBagCollection. The kernel is offered on CPU and CUDA for table-wise,
    column-wise, table-column-wise, row-wise and table-row-wise sharding; TorchRec's
    own kernels keep TorchRec's offer (row-wise on CUDA only).
    """

    def __init__(self, fused_params: Optional[Dict[str, Any]] = None, qcomm_codecs_registry=None,
                 sharded_module_order_overwrite=None, dedup: Optional[str] = None, **codec_options: Any) -> None:
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry,
                         sharded_module_order_overwrite=sharded_module_order_overwrite)
        self._codec_options = check_codec_options(codec_options)
        warn_if_dedup(dedup)

    @property
    def codec_options(self) -> Dict[str, Any]:
        return dict(self._codec_options)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        types = list(super().sharding_types(compute_device_type))
        if compute_device_type == "cpu":
            types += [t for t in _ROW_SHARDINGS if t not in types]
        return types

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        if compute_device_type not in ("cpu", "cuda"):
            return list(super().compute_kernels(sharding_type, compute_device_type))
        if compute_device_type == "cpu" and sharding_type in _ROW_SHARDINGS:
            stock = []  # TorchRec shards by rows on CUDA only
        else:
            stock = list(super().compute_kernels(sharding_type, compute_device_type))
        return stock + [IBP_COMPUTE_KERNEL] if sharding_type in IBP_SHARDING_TYPES else stock

    def shard(self, module: EmbeddingBagCollection, params, env, device: Optional[torch.device] = None,
              module_fqn: Optional[str] = None) -> IBPShardedEmbeddingBagCollection:
        return IBPShardedEmbeddingBagCollection(
            module=module, table_name_to_parameter_sharding=params, env=env, fused_params=self.fused_params,
            device=device, qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
            codec_options=self._codec_options)

    @property
    def sharded_module_type(self):
        return IBPShardedEmbeddingBagCollection


