"""Training IBP tables through DistributedModelParallel matches TorchRec's fused kernel.

Each rank builds the same model twice under DMP with the same hand-built plan, once with
every table on TorchRec's ``fused`` kernel (FBGEMM TBE, HOST) and once with every table
on the IBP kernel: row-wise (SUM and MEAN; a 3-row table stored raw), table-row-wise, table-wise (a table read by
two features), column-wise and table-column-wise tables, plain and weighted. Both train
on the same batches with the same fused optimizer (from the sharder's fused_params) and
must give bit-identical pooled outputs at every step (each carrying all earlier
updates), final tables and optimizer state, on 2 and on 3 gloo ranks: the reduction
order is TorchRec's in both (same all-to-alls, same reduce-scatter), and the kernels'
arithmetic is FBGEMM's.

Then torch.distributed.checkpoint: IBP tables and their fused optimizer state saved on
2 ranks load on 1 and on 3 ranks (resharded), and into the fused kernel too.
"""
import os
import socket
from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.modules.embedding_configs import PoolingType  # noqa: E402

STEPS = 5
B = 4  # per rank
TABLES = [  # name, rows, dim, features, pooling
    ("t_rw", 97, 8, ["a"], PoolingType.SUM),
    ("t_rw_mean", 61, 8, ["b"], PoolingType.MEAN),
    ("t_tw", 50, 4, ["c", "d"], PoolingType.SUM),
    ("t_cw", 40, 16, ["e"], PoolingType.SUM),
    ("t_twrw", 70, 8, ["f"], PoolingType.SUM),
    ("t_twcw", 30, 16, ["g"], PoolingType.MEAN),
    ("t_rw_tiny", 3, 8, ["h"], PoolingType.SUM),  # stored raw: too few rows for masks
]
WTABLES = [("w_rw", 45, 8, ["p"], PoolingType.SUM), ("w_tw", 33, 4, ["q", "r"], PoolingType.SUM)]


def configs(spec):
    return [EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=f, pooling=p)
            for n, r, d, f, p in spec]


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ebc = EmbeddingBagCollection(configs(TABLES), device=torch.device("meta"))
        self.wbc = EmbeddingBagCollection(configs(WTABLES), is_weighted=True, device=torch.device("meta"))
        dims = sum(d * len(f) for _, _, d, f, _ in TABLES + WTABLES)
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(dims, 1)

    def forward(self, kjt, wkjt):
        kt, wkt = self.ebc(kjt), self.wbc(wkjt)
        out = {**kt.to_dict(), **wkt.to_dict()}
        values = torch.cat([out[k] for k in sorted(out)], dim=1)  # a fixed order whatever the sharding
        return self.dense(values).sum(), out


def initial_state():
    g = torch.Generator().manual_seed(1)
    sd = {}
    for prefix, spec in (("ebc", TABLES), ("wbc", WTABLES)):
        for n, r, d, _, _ in spec:
            sd[f"{prefix}.embedding_bags.{n}.weight"] = torch.randn(r, d, generator=g) * 0.01
    return sd


def batch(step, rank):
    rng = np.random.default_rng(1000 * step + rank)

    def kjt(spec, weighted):
        keys, values, lengths = [], [], []
        for _, rows, _, feats, _ in spec:
            for f in feats:
                keys.append(f)
                for _ in range(B):
                    n = int(rng.integers(0, 5))
                    values.extend(int(i) for i in rng.zipf(1.2, n) % rows)
                    lengths.append(n)
        w = torch.from_numpy(rng.uniform(0.1, 2, len(values)).astype(np.float32)) if weighted else None
        return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.tensor(values, dtype=torch.int64),
                                                   lengths=torch.tensor(lengths, dtype=torch.int64), weights=w)

    return kjt(TABLES, False), kjt(WTABLES, True)


def plan(world, kernel):
    """One plan for both kernels: the fused plan with every compute_kernel swapped."""
    from torchrec.distributed.sharding_plan import (
        column_wise, construct_module_sharding_plan, row_wise, table_row_wise, table_wise)
    from torchrec.distributed.types import ShardingPlan

    from ibp_embed.torchrec import IBPEmbeddingBagCollectionSharder

    model = Model()
    last = world - 1
    col_ranks = [0, 0] if world == 1 else [0, 1]
    per = {"ebc": {"t_rw": row_wise(), "t_rw_mean": row_wise(), "t_tw": table_wise(rank=last),
                   "t_cw": column_wise(ranks=col_ranks), "t_twrw": table_row_wise(host_index=0),
                   "t_twcw": column_wise(ranks=col_ranks), "t_rw_tiny": row_wise()},  # t_twcw: table_column_wise below
           "wbc": {"w_rw": row_wise(), "w_tw": table_wise(rank=0)}}
    out = {}
    for name, ps in per.items():
        p = construct_module_sharding_plan(getattr(model, name), ps, sharder=IBPEmbeddingBagCollectionSharder(),
                                           local_size=world, world_size=world, device_type="cpu")
        out[name] = {t: replace(s, compute_kernel=kernel) for t, s in p.items()}
    # one host: a table's column shards side by side are table-column-wise
    out["ebc"]["t_twcw"] = replace(out["ebc"]["t_twcw"], sharding_type="table_column_wise")
    return ShardingPlan(out)


def build(world, kernel, fused_params):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    from ibp_embed.torchrec import IBPEmbeddingBagCollectionSharder

    sharders = [IBPEmbeddingBagCollectionSharder(fused_params=dict(fused_params))]
    dmp = DistributedModelParallel(Model(), env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                   device=torch.device("cpu"), plan=plan(world, kernel), sharders=sharders)
    return dmp


def train_step(dmp, dense_opt, step, rank):
    kjt, wkjt = batch(step, rank)
    loss, out = dmp(kjt, wkjt)
    dense_opt.zero_grad()
    loss.backward()
    dense_opt.step()
    return {k: v.detach() for k, v in out.items()}


def local_shards(sd):
    """{key: [(offsets, tensor)]} of a state_dict's ShardedTensors."""
    out = {}
    for k, v in sd.items():
        if hasattr(v, "local_shards"):
            out[k] = sorted((tuple(s.metadata.shard_offsets), s.tensor) for s in v.local_shards())
    return out


def assert_same_sharded(a, b, what):
    sa, sb = local_shards(a), local_shards(b)
    assert sorted(sa) == sorted(sb), (what, sorted(sa), sorted(sb))
    for k in sa:
        assert [o for o, _ in sa[k]] == [o for o, _ in sb[k]], (what, k)
        for (_, x), (_, y) in zip(sa[k], sb[k]):
            assert torch.equal(x, y), f"{what} {k} differs"
    for k in a:
        if hasattr(a[k], "metadata"):
            assert a[k].metadata().shards_metadata == b[k].metadata().shards_metadata, (what, k)
            assert a[k].size() == b[k].size(), (what, k)


def optimizer_state(dmp):
    return {f"{p}/{k}": v for p, entry in dmp.fused_optimizer.state_dict()["state"].items()
            for k, v in entry.items()}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_group(rank, world, port, body, *args):
    """Run body(rank, world, *args) in a gloo group. The models body builds are freed
    before the group is destroyed: a DDP reducer outliving its group can abort the
    process at exit."""
    import gc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        body(rank, world, *args)
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _equivalence(rank, world, fused_params):
    from ibp_embed.torchrec import IBPBatchedEmbeddingBag

    fused, ibp = build(world, "fused", fused_params), build(world, "customized_kernel", fused_params)
    kernels = [k for m in (ibp.module.ebc, ibp.module.wbc) for lk in m._lookups for k in lk._emb_modules]
    assert kernels and all(isinstance(k, IBPBatchedEmbeddingBag) for k in kernels)
    for dmp in (fused, ibp):
        dmp.load_state_dict(initial_state(), strict=False)
    opts = [torch.optim.SGD(dmp.module.dense.parameters(), lr=0.1) for dmp in (fused, ibp)]
    for step in range(STEPS):
        a = train_step(fused, opts[0], step, rank)
        b = train_step(ibp, opts[1], step, rank)
        assert sorted(a) == sorted(b)
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {step}: pooled {k} differs"
    assert_same_sharded(fused.state_dict(), ibp.state_dict(), "tables")
    assert_same_sharded(optimizer_state(fused), optimizer_state(ibp), "optimizer state")
    shard = ibp.state_dict()["ebc.embedding_bags.t_rw.weight"].local_shards()[0]
    (r0, _), (nr, _) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
    assert not torch.equal(shard.tensor, initial_state()["ebc.embedding_bags.t_rw.weight"][r0:r0 + nr]), \
        "the tables did not train"


ROWWISE = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-8}
ADAGRAD = {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8}


@pytest.mark.parametrize("world,fused_params", [(2, ROWWISE), (3, ADAGRAD)])
def test_ibp_kernel_trains_bit_for_bit_as_fused_kernel(world, fused_params):
    mp.spawn(_in_group, args=(world, _free_port(), _equivalence, fused_params), nprocs=world, join=True)


def _gathered(dmp, rank):
    """{key: full tensor} of every table and optimizer state, assembled from all ranks."""
    mine = {k.split("/")[-1]: (tuple(v.size()), [(s.metadata.shard_offsets, s.tensor.clone())
                                                  for s in v.local_shards()])
            for k, v in {**dmp.state_dict(), **optimizer_state(dmp)}.items() if hasattr(v, "local_shards")}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out = {}
    for part in parts:
        for k, (size, shards) in part.items():
            full = out.setdefault(k, torch.full(size, float("nan")))
            for offsets, t in shards:
                full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))] = t
    return out


def _save(rank, world, path):
    import torch.distributed.checkpoint as dcp

    dmp = build(world, "customized_kernel", ROWWISE)
    dmp.load_state_dict(initial_state(), strict=False)
    opt = torch.optim.SGD(dmp.module.dense.parameters(), lr=0.1)
    for step in range(3):
        train_step(dmp, opt, step, rank)
    dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=path)
    full = _gathered(dmp, rank)
    if rank == 0:
        torch.save(full, f"{path}/expected.pt")


def _load(rank, world, path):
    import gc

    import torch.distributed.checkpoint as dcp

    outs = []
    for kernel in ("customized_kernel", "fused"):
        dmp = build(world, kernel, ROWWISE)
        state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
        dcp.load(state, checkpoint_id=path)
        dmp.load_state_dict(state["model"])
        dmp.fused_optimizer.load_state_dict(state["optim"])
        full = _gathered(dmp, rank)
        if rank == 0:
            expected = torch.load(f"{path}/expected.pt")
            assert sorted(full) == sorted(expected)
            for k in expected:
                assert torch.equal(full[k], expected[k]), f"{kernel}: {k} differs after loading"
        opt = torch.optim.SGD(dmp.module.dense.parameters(), lr=0.1)
        outs.append([train_step(dmp, opt, step, rank) for step in (3, 4)])
        # free this model (its DDP reducer, its comm state) on every rank before the next is built
        del dmp, state, opt
        gc.collect()
        dist.barrier()
    for a, b in zip(*outs):  # resumed training: the IBP and fused kernels agree
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_checkpoint_saved_on_two_ranks_loads_on_one_and_three(tmp_path):
    path = str(tmp_path / "ckpt")
    mp.spawn(_in_group, args=(2, _free_port(), _save, path), nprocs=2, join=True)
    for world in (1, 3):
        mp.spawn(_in_group, args=(world, _free_port(), _load, path), nprocs=world, join=True)
