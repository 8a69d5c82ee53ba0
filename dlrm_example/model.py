"""Model construction for both backends, from the same seed to the same weights.

* Tables: table f (feature ``cat_f``) is ``ibp_embed.datasets.make_table(rows, dim,
  seed=...)`` - TorchRec's default init, uniform(-sqrt(1/rows), +sqrt(1/rows)) - drawn
  from a generator seeded by (seed, f), independent of torch's global RNG.
* Dense layers: ``torch.manual_seed(seed)`` right before DLRM / DLRM_DCN is built around
  an embedding collection on the meta device (which consumes no randomness), so both
  backends get the same dense weights.

Both backends are the same TorchRec model under DistributedModelParallel, with the same
sharding plan (:func:`sharding_plan`): the large tables row-wise over all ranks, the
others table-wise (largest first, each on the least loaded rank). The sparse optimizer
is the sharder's ``fused_params`` (EXACT_SGD or EXACT_ROWWISE_ADAGRAD), fused into
backward; the dense part is data-parallel (DMP wraps it in DDP). The backends differ in
one thing: ``ibp`` plans the chosen tables (``--ibp-tables``, by default the large ones)
on the IBP kernel (``customized_kernel``, compressed tables) and the rest on TorchRec's
``fused`` kernel (FBGEMM TBE, HOST placement on the CPU); ``torchrec`` plans every table
on ``fused``. A process group is needed even on one process (the trainer makes one).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import PoolingType

from ibp_embed.datasets import make_table

from .data import FEATURE_NAMES, NUM_DENSE, _seed

BACKENDS = ("ibp", "torchrec")
MODELS = ("dlrm", "dcn")
OPTIMIZERS = ("sgd", "adagrad")
EPS = 1e-8


@dataclass
class ModelConfig:
    """Everything that fixes the parameter shapes (checkpoints must match it)."""

    model: str = "dlrm"
    cardinalities: List[int] = field(default_factory=list)
    embedding_dim: int = 16
    dense_arch: List[int] = field(default_factory=lambda: [64, 16])
    over_arch: List[int] = field(default_factory=lambda: [64, 32, 1])
    dcn_layers: int = 2
    dcn_low_rank: int = 16

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, not {self.model!r}")
        if self.embedding_dim < 1 or self.embedding_dim % 4:
            raise ValueError(f"embedding dim must be a positive multiple of 4 (FBGEMM), not {self.embedding_dim}")
        if not self.dense_arch or self.dense_arch[-1] != self.embedding_dim:
            raise ValueError(f"the dense arch must end with the embedding dim {self.embedding_dim}, "
                             f"got {self.dense_arch}")
        if not self.over_arch or self.over_arch[-1] != 1:
            raise ValueError(f"the over arch must end with 1, got {self.over_arch}")


def table_configs(cfg: ModelConfig) -> List[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"t_{f}", num_embeddings=n, embedding_dim=cfg.embedding_dim,
                               feature_names=[f], pooling=PoolingType.SUM)
            for f, n in zip(FEATURE_NAMES, cfg.cardinalities)]


def initial_table(cfg: ModelConfig, seed: int, i: int) -> torch.Tensor:
    return make_table(cfg.cardinalities[i], cfg.embedding_dim, seed=_seed(seed, "table", i) % (1 << 62))


def build_dlrm(cfg: ModelConfig, ebc: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if cfg.model == "dlrm":
        return DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                    dense_arch_layer_sizes=list(cfg.dense_arch), over_arch_layer_sizes=list(cfg.over_arch))
    return DLRM_DCN(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                    dense_arch_layer_sizes=list(cfg.dense_arch), over_arch_layer_sizes=list(cfg.over_arch),
                    dcn_num_layers=cfg.dcn_layers, dcn_low_rank_dim=cfg.dcn_low_rank)


def dense_optimizer(name: str, lr: float, params) -> torch.optim.Optimizer:
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.Adagrad(params, lr=lr, eps=EPS)


def dense_named_parameters(model: nn.Module):
    """(name, parameter) of every parameter outside the embedding collection, in a
    fixed order that both backends share."""
    return [(n, p) for n, p in model.named_parameters() if not n.startswith("sparse_arch.")]


def dense_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    out = {}
    for name, child in model.named_children():
        if name == "sparse_arch":
            continue
        for k, v in child.state_dict().items():
            out[f"{name}.{k}"] = v.detach().clone()
    return out


def load_dense_state(model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    children = dict(model.named_children())
    groups: Dict[str, dict] = {}
    for k, v in state.items():
        head, _, rest = k.partition(".")
        if head not in children or head == "sparse_arch":
            raise ValueError(f"checkpoint has dense parameter {k!r}, which this model lacks")
        groups.setdefault(head, {})[rest] = v
    for name, child in children.items():
        if name == "sparse_arch":
            continue
        child.load_state_dict(groups.get(name, {}), strict=True)


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------

class Built:
    """A model ready to train: `module` is the DMP to call, `model` the plain DLRM inside,
    `ebc` its sharded embedding collection, `ibp_tables` the tables on the IBP kernel."""

    def __init__(self, module, model, backend, ibp_tables):
        self.module, self.model, self.backend, self.ibp_tables = module, model, backend, ibp_tables

    @property
    def ebc(self):
        return self.model.sparse_arch.embedding_bag_collection


def large_tables(cfg: ModelConfig, share: float = 0.01) -> List[str]:
    """Tables holding at least `share` of all rows (the ones worth compressing)."""
    total = sum(cfg.cardinalities)
    return [c.name for c, n in zip(table_configs(cfg), cfg.cardinalities) if n >= share * total]


def resolve_ibp_tables(cfg: ModelConfig, spec: str) -> List[str]:
    """--ibp-tables: "large" (default), "all", or comma-separated table names."""
    names = [c.name for c in table_configs(cfg)]
    if spec == "large":
        return large_tables(cfg)
    if spec == "all":
        return names
    chosen = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in names]
    if unknown or not chosen:
        raise ValueError(f"--ibp-tables: unknown table(s) {unknown or spec!r}; the tables are "
                         f"{names[0]} .. {names[-1]}, or use 'large' / 'all'")
    return chosen


def sharding_plan(cfg: ModelConfig, world: int, sharder, kernels: Dict[str, str]):
    """The plan of both backends: large tables row-wise, the rest table-wise (largest
    first, each on the rank with the fewest rows so far); kernels[table] per table."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan

    large = set(large_tables(cfg))
    load = [0] * world
    per_param = {}
    for c, n in sorted(zip(table_configs(cfg), cfg.cardinalities), key=lambda x: -x[1]):
        if c.name in large:
            per_param[c.name] = row_wise(compute_kernel=kernels[c.name])
        else:
            rank = load.index(min(load))
            load[rank] += n
            per_param[c.name] = table_wise(rank=rank, compute_kernel=kernels[c.name])
    ebc = EmbeddingBagCollection(table_configs(cfg), device=torch.device("meta"))
    plan = construct_module_sharding_plan(ebc, per_param, sharder=sharder, local_size=world, world_size=world,
                                          device_type="cpu")
    return ShardingPlan({"sparse_arch.embedding_bag_collection": plan})


def fused_params(optimizer_name: str, lr: float) -> dict:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    if optimizer_name == "sgd":
        return {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr}
    return {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": lr, "eps": EPS}


def build(cfg: ModelConfig, seed: int, backend: str, optimizer_name: str, lr: float, *, world: int = 1,
          ibp_tables: Optional[List[str]] = None, load_tables: bool = True) -> Built:
    """DLRM / DLRM_DCN under DistributedModelParallel (CPU, gloo) on either backend."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from ibp_embed.torchrec import IBP_COMPUTE_KERNEL, IBPEmbeddingBagCollectionSharder

    chosen = (large_tables(cfg) if ibp_tables is None else list(ibp_tables)) if backend == "ibp" else []
    params = fused_params(optimizer_name, lr)
    sharder = IBPEmbeddingBagCollectionSharder(fused_params=params) if backend == "ibp" \
        else EmbeddingBagCollectionSharder(fused_params=params)
    kernels = {c.name: IBP_COMPUTE_KERNEL if c.name in chosen else "fused" for c in table_configs(cfg)}
    model = build_dlrm(cfg, EmbeddingBagCollection(table_configs(cfg), device=torch.device("meta")), seed)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=sharding_plan(cfg, world, sharder, kernels),
                                   sharders=[sharder])
    built = Built(dmp, model, backend, chosen)
    if load_tables:
        prefix = "sparse_arch.embedding_bag_collection.embedding_bags."
        for i, c in enumerate(table_configs(cfg)):  # one table at a time: bounded memory
            dmp.load_state_dict({f"{prefix}{c.name}.weight": initial_table(cfg, seed, i)}, strict=False)
    return built


def table_memory(built: Built) -> Dict[str, int]:
    """This rank's table memory in bytes: raw (uncompressed shards), ibp (IBP shards as
    held now), ibp_packed, fbgemm (TorchRec fused tables' shards), optimizer_state."""
    import torch.distributed as dist

    ebc = built.ebc
    ibp = ebc.ibp_memory_stats() if hasattr(ebc, "ibp_memory_stats") else None
    rank = dist.get_rank()
    fbgemm = sum(math.prod(md.shard_sizes) * 4 for name, ps in ebc.module_sharding_plan.items()
                 if name not in built.ibp_tables for md in ps.sharding_spec.shards if md.placement.rank() == rank)
    state = sum(s.tensor.numel() * s.tensor.element_size() for *_, s in local_state_shards(built))
    return {"raw": fbgemm + (ibp["raw_bytes"] if ibp else 0), "fbgemm": fbgemm,
            "ibp": ibp["compressed_bytes"] if ibp else 0, "ibp_raw": ibp["raw_bytes"] if ibp else 0,
            "ibp_packed": ibp["packed_bytes"] if ibp else 0, "optimizer_state": state,
            **({f"ibp_{k}": v for k, v in ibp.items() if k.endswith("_bytes")} if ibp else {})}


def local_table_shards(built: Built):
    """(table name, Shard) for every table shard this rank holds; the shards of fused
    tables are views of FBGEMM's weights, those of IBP tables decompressed copies."""
    prefix = "sparse_arch.embedding_bag_collection.embedding_bags."
    for k, v in built.module.state_dict().items():
        if k.startswith(prefix) and k.endswith(".weight"):
            name = k[len(prefix):-len(".weight")]
            for shard in v.local_shards():
                yield name, shard


def local_state_shards(built: Built):
    """(table name, state name, Shard) of the fused optimizer state on this rank."""
    state = built.module.fused_optimizer.state_dict()["state"]
    prefix = "sparse_arch.embedding_bag_collection.embedding_bags."
    for param_key, entries in state.items():
        name = param_key[len(prefix):-len(".weight")] if param_key.startswith(prefix) else param_key
        for key, value in entries.items():
            short = key.split(".", 1)[1] if key.startswith(name + ".") else key
            if hasattr(value, "local_shards"):
                for shard in value.local_shards():
                    yield name, short, shard
