"""Model construction for both backends, from the same seed to the same weights.

* Tables: table f (feature ``cat_f``) is ``ibp_embed.datasets.make_table(rows, dim,
  seed=...)`` - TorchRec's default init, uniform(-sqrt(1/rows), +sqrt(1/rows)) - drawn
  from a generator seeded by (seed, f), independent of torch's global RNG.
* Dense layers: ``torch.manual_seed(seed)`` right before DLRM / DLRM_DCN is built around
  an embedding collection that consumes no global randomness, so both backends get
  the same dense weights.

Backends:

* ``torchrec``: a plain EmbeddingBagCollection (built on the meta device) under
  DistributedModelParallel, every table planned table-wise on the ``fused`` kernel
  (FBGEMM's TBE, HOST placement on the CPU) with the sparse optimizer fused into
  backward through ``apply_optimizer_in_backward`` (torch.optim.SGD -> EXACT_SGD,
  torchrec.optim.RowWiseAdagrad -> EXACT_ROWWISE_ADAGRAD). The dense part is
  data-parallel (DMP wraps it in DDP). Needs a process group (gloo; the trainer
  makes a one-process group when not launched by torchrun).
* ``ibp``: IBPEmbeddingBagCollection(optimizer=ibp_embed.optim.SGD/RowWiseAdagrad):
  compressed tables updated in backward. With several processes every rank holds all
  tables and backward all-gathers the ranks' ids and output gradients (replicas stay
  identical; the update is the one a table-wise sharded table gets), the dense part
  is wrapped in DDP.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import PoolingType

from ibp_embed.datasets import make_table
from ibp_embed.optim import SGD, RowWiseAdagrad, SparseOptimizer

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


def sparse_optimizer(name: str, lr: float) -> SparseOptimizer:
    return SGD(lr) if name == "sgd" else RowWiseAdagrad(lr, eps=EPS)


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
    """A model ready to train: `module` is what to call (possibly a DMP / DDP wrapper),
    `model` the plain DLRM inside, `ebc` its embedding collection (IBP module or
    TorchRec's sharded EBC)."""

    def __init__(self, module, model, backend, pg=None):
        self.module, self.model, self.backend, self.pg = module, model, backend, pg

    @property
    def ebc(self):
        return self.model.sparse_arch.embedding_bag_collection


def build_ibp(cfg: ModelConfig, seed: int, optimizer: Optional[SparseOptimizer], *, world: int = 1,
              load_tables: bool = True, codec_options: Optional[dict] = None):
    """The IBP model. optimizer None: an inference module (immutable tables)."""
    from ibp_embed.torchrec import IBPEmbeddingBagCollection
    import torch.distributed as dist

    pg = None
    if world > 1 and optimizer is not None:
        raise NotImplementedError("the ibp backend trains on several ranks through DMP (next commit)")
    ebc = IBPEmbeddingBagCollection(table_configs(cfg), device="meta", optimizer=optimizer,
                                    **(codec_options or {}))
    if load_tables:
        for i, c in enumerate(table_configs(cfg)):
            ebc.embedding_bags[c.name].load_weight(initial_table(cfg, seed, i))
            ebc.embedding_bags[c.name].reset_state()
    model = build_dlrm(cfg, ebc, seed)
    module = model
    if world > 1 and optimizer is not None:
        module = nn.parallel.DistributedDataParallel(model)
    return Built(module, model, "ibp", pg)


def build_torchrec(cfg: ModelConfig, seed: int, optimizer_name: str, lr: float, *, world: int = 1,
                   load_tables: bool = True):
    """TorchRec's EBC on the fused FBGEMM kernel under DistributedModelParallel (CPU, gloo)."""
    import torch.distributed as dist
    import torchrec.optim as trec_optim
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    configs = table_configs(cfg)
    ebc = EmbeddingBagCollection(configs, device=torch.device("meta"))
    model = build_dlrm(cfg, ebc, seed)
    if optimizer_name == "sgd":
        apply_optimizer_in_backward(torch.optim.SGD, model.sparse_arch.parameters(), {"lr": lr})
    else:
        apply_optimizer_in_backward(trec_optim.RowWiseAdagrad, model.sparse_arch.parameters(),
                                    {"lr": lr, "eps": EPS})
    topology = Topology(world_size=world, compute_device="cpu", local_world_size=world)
    constraints = {c.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
                   for c in configs}
    sharders = [EmbeddingBagCollectionSharder()]
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    built = Built(dmp, model, "torchrec")
    if load_tables:
        with torch.no_grad():
            for name, shard in local_table_shards(built):
                i = [c.name for c in configs].index(name)
                (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(initial_table(cfg, seed, i)[r0:r0 + nr, c0:c0 + nc])
            for name, key, shard in local_state_shards(built):
                shard.tensor.zero_()
    return built


def local_table_shards(built: Built):
    """(table name, Shard) for every table shard this rank holds (torchrec backend);
    the shard tensors are views of FBGEMM's weights."""
    prefix = "sparse_arch.embedding_bag_collection.embedding_bags."
    for k, v in built.model.state_dict().items():
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
