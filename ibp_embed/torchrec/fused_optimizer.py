"""The fused optimizer of IBP tables under DMP: fused_params in, TorchRec's state layout out.

:func:`optimizer_from_fused_params` reads a plan's ``fused_params`` (FBGEMM's names,
as TorchRec passes them to its ``fused`` kernel, or as ``apply_optimizer_in_backward``
produces them). :class:`IBPFusedOptimizer` is what ``dmp.fused_optimizer`` holds for an
IBP kernel: a KeyedOptimizer whose params are ``<table>.weight`` and whose state is
``<table>.momentum1`` as ShardedTensors laid out as TorchRec's EmbeddingFusedOptimizer
lays them out (row-wise state sharded by rows; column shards' row-wise state side by
side, ordered by column offset; per-element state sharded as the table), so
state_dict / load_state_dict and torch.distributed.checkpoint resharding treat IBP
and FBGEMM tables alike.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorBase
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharding_spec import ShardMetadata
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.optim.fused import FusedOptimizer

from ..optim import SGD, Adagrad, RowWiseAdagrad, SparseOptimizer

# FBGEMM's TBE defaults: a fused table without fused_params trains with EXACT_SGD at 0.01.
DEFAULT_OPTIMIZER = "exact_sgd"
DEFAULT_LEARNING_RATE = 0.01

# fused_params keys that decide placement, caching or other optimizers' settings: not
# the optimizer's business (the kernel reads cache_load_factor and cache_algorithm),
# accepted so one sharder can serve both kernels.
_IGNORED_FUSED_PARAMS = {
    "cache_load_factor", "cache_sets", "cache_algorithm", "cache_reserved_memory", "cache_precision",
    "prefetch_pipeline", "bounds_check_mode", "uvm_non_rowwise_momentum", "use_experimental_tbe",
    "multipass_prefetch_config", "enforce_hbm", "stochastic_rounding", "momentum", "beta1", "beta2",
    "eta", "counter_halflife", "lazy_bag", "fp8_config",
}
# Keys that change the arithmetic: accepted at these values only.
_NEUTRAL_FUSED_PARAMS = {"gradient_clipping": False, "max_norm": 0.0}
_WEIGHT_DECAY_MODES = {0: "none", 1: "l2", 2: "decouple"}


def optimizer_from_fused_params(fused_params: Optional[Dict[str, Any]]) -> SparseOptimizer:
    """The sparse optimizer a plan's fused_params ask for, named as FBGEMM names it:
    optimizer (EmbOptimType or its value: exact_sgd, exact_adagrad,
    exact_row_wise_adagrad; default exact_sgd), learning_rate (default 0.01), eps,
    weight_decay, weight_decay_mode (WeightDecayMode NONE / L2 / DECOUPLE).
    Settings IBP does not implement raise ValueError."""
    fp = dict(fused_params or {})
    opt = fp.pop("optimizer", DEFAULT_OPTIMIZER)
    name = str(getattr(opt, "value", opt))
    lr = float(fp.pop("learning_rate", DEFAULT_LEARNING_RATE))
    eps = float(fp.pop("eps", 1e-8))
    wd = float(fp.pop("weight_decay", 0.0))
    mode = fp.pop("weight_decay_mode", 0)
    mode = _WEIGHT_DECAY_MODES.get(int(getattr(mode, "value", mode)))
    output_dtype = fp.pop("output_dtype", None)
    if output_dtype is not None and getattr(output_dtype, "name", str(output_dtype)).upper() not in ("FP32",
                                                                                                      "FLOAT32"):
        raise ValueError(f"IBP kernel: output_dtype {output_dtype} is not supported (pooled outputs are FP32)")
    for key, neutral in _NEUTRAL_FUSED_PARAMS.items():
        if key in fp and fp.pop(key) not in (neutral, None):
            raise ValueError(f"IBP kernel: fused_params {key!r} is not supported (only {neutral!r})")
    unknown = sorted(k for k in fp if k not in _IGNORED_FUSED_PARAMS)
    if unknown:
        raise ValueError(f"IBP kernel: unsupported fused_params {unknown}")
    if mode is None:
        raise ValueError("IBP kernel: weight_decay_mode must be NONE, L2 or DECOUPLE")
    if name == "exact_row_wise_adagrad":
        return RowWiseAdagrad(lr, eps=eps, weight_decay=wd, weight_decay_mode=mode if wd else "none")
    if wd and mode != "none":
        raise ValueError(f"IBP kernel: weight decay needs exact_row_wise_adagrad, not {name}")
    if name == "exact_sgd":
        return SGD(lr)
    if name == "exact_adagrad":
        return Adagrad(lr, eps=eps)
    raise ValueError(f"IBP kernel: optimizer {name!r} is not supported; use EmbOptimType.EXACT_SGD, "
                     f"EXACT_ADAGRAD or EXACT_ROWWISE_ADAGRAD")


def on_host(md: ShardMetadata) -> ShardMetadata:
    """`md` placed in its rank's host memory when it names a CUDA device: IBP shards,
    their decompressed state_dict copies and their optimizer state live on the host
    whatever the compute device (a decompressed shard may not fit in HBM)."""
    dev = md.placement.device() if md.placement is not None else None
    if dev is None or dev.type != "cuda":
        return md
    return ShardMetadata(shard_offsets=list(md.shard_offsets), shard_sizes=list(md.shard_sizes),
                         placement=f"rank:{md.placement.rank()}/cpu")


def host_metadata(md: ShardedTensorMetadata) -> ShardedTensorMetadata:
    return ShardedTensorMetadata([on_host(s) for s in md.shards_metadata], md.size, md.tensor_properties)


def _state_metadata(table_md: ShardedTensorMetadata, state: torch.Tensor, column_sharded: bool):
    """(table shard metadata -> state shard metadata, the state's global metadata),
    TorchRec's layout: per-element state is sharded as the table; row-wise state by
    rows, column shards' copies side by side in column-offset order."""
    props = TensorProperties(dtype=state.dtype, layout=state.layout, requires_grad=False)
    shards = table_md.shards_metadata
    if state.dim() == 2:
        mapping = {md: on_host(ShardMetadata(shard_sizes=md.shard_sizes, shard_offsets=md.shard_offsets,
                                             placement=md.placement)) for md in shards}
        return mapping, ShardedTensorMetadata(list(mapping.values()), table_md.size, props)
    if column_sharded:
        shards = sorted(shards, key=lambda md: md.shard_offsets[1])
    mapping = {}
    for i, md in enumerate(shards):
        offset = i * md.shard_sizes[0] if column_sharded else md.shard_offsets[0]
        mapping[md] = on_host(ShardMetadata(shard_sizes=[md.shard_sizes[0]], shard_offsets=[offset],
                                            placement=md.placement))
    rows = table_md.size[0] * (len(shards) if column_sharded else 1)
    return mapping, ShardedTensorMetadata(list(mapping.values()), torch.Size([rows]), props)


class IBPFusedOptimizer(FusedOptimizer):
    """KeyedOptimizer of one IBP kernel: lr and hyper-parameters of its SparseOptimizer,
    state in TorchRec's EmbeddingFusedOptimizer layout (live views of the kernel's
    state tensors). The ``<table>.weight`` params are placeholders (IBP tables hold no
    raw tensor; read weights through the module's state_dict)."""

    def __init__(self, config: GroupedEmbeddingConfig, optimizer: SparseOptimizer,
                 states: List[Dict[str, torch.Tensor]], dtypes: List[torch.dtype],
                 pg: Optional[dist.ProcessGroup] = None):
        self._optimizer = optimizer
        by_table: Dict[str, list] = {}
        for t, s, d in zip(config.embedding_tables, states, dtypes):
            by_table.setdefault(t.name, []).append((t, s, d))
        params, state = {}, {}
        for name, shards in by_table.items():
            t0 = shards[0][0]
            md = host_metadata(copy.deepcopy(t0.global_metadata))
            md.tensor_properties.dtype = shards[0][2]
            local_md = [on_host(t.local_metadata) for t, _, _ in shards]
            weight = ShardedTensorBase._init_from_local_shards_and_global_metadata(
                [Shard(torch.zeros((), dtype=d, device=lmd.placement.device()).expand(t.local_rows, t.local_cols),
                       lmd) for (t, _, d), lmd in zip(shards, local_md)], md)
            params[f"{name}.weight"] = weight
            state[weight] = {}
            column_sharded = t0.local_cols != t0.embedding_dim
            if column_sharded and t0.local_rows != t0.num_embeddings:
                raise NotImplementedError(f"IBP kernel: table {name!r} is sharded by rows and columns (grid)")
            for key in shards[0][1]:
                mapping, st_md = _state_metadata(t0.global_metadata, shards[0][1][key], column_sharded)
                local = [Shard(s[key], mapping[t.local_metadata]) for t, s, _ in shards]
                state[weight][f"{name}.{key}"] = ShardedTensor._init_from_local_shards_and_global_metadata(
                    local_shards=local, sharded_tensor_metadata=st_md, process_group=pg)
        super().__init__(params, state, [{"params": list(params.values()), "lr": optimizer.lr}])

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._optimizer.lr = float(self.param_groups[0]["lr"])

    def step(self, closure: Any = None) -> None:
        self._optimizer.lr = float(self.param_groups[0]["lr"])

    def set_optimizer_step(self, step: int) -> None:
        pass  # no supported optimizer depends on the step count

    def update_hyper_parameters(self, params: Dict[str, float]) -> None:
        for key, value in params.items():
            attr = "lr" if key in ("lr", "learning_rate") else key
            if not hasattr(self._optimizer, attr):
                raise ValueError(f"{type(self._optimizer).__name__} has no hyper-parameter {key!r}")
            setattr(self._optimizer, attr, float(value))
            if attr == "lr":
                self.param_groups[0]["lr"] = float(value)
