"""IBP tables under TorchRec's planner and DistributedModelParallel (CPU, gloo, 2 ranks)."""
import os
import socket

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.distributed.embedding_types import ShardingType  # noqa: E402
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology  # noqa: E402
from torchrec.distributed.planner.types import ParameterConstraints  # noqa: E402
from torchrec.modules.embedding_configs import PoolingType  # noqa: E402

from ibp_embed.torchrec import (  # noqa: E402
    IBP_COMPUTE_KERNEL,
    IBPEmbeddingBagCollectionSharder,
    IBPStorageEstimator,
    ibp_constraints,
    ibp_planner,
)

WORLD = 2
B = 6  # local batch per rank
TW, CW = ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value
RW, TWRW = ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value


def tables():
    return [
        EmbeddingBagConfig(name="ibp_tw", embedding_dim=16, num_embeddings=400, feature_names=["f0", "f1"]),
        EmbeddingBagConfig(name="ibp_cw", embedding_dim=16, num_embeddings=300, feature_names=["f2"],
                           pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="ibp_tw2", embedding_dim=8, num_embeddings=50, feature_names=["f3"],
                           pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="fused_tw", embedding_dim=8, num_embeddings=200, feature_names=["f4", "f0"]),
        EmbeddingBagConfig(name="fused_cw", embedding_dim=16, num_embeddings=100, feature_names=["f5"]),
    ]


def wtables():
    return [
        EmbeddingBagConfig(name="w_ibp", embedding_dim=8, num_embeddings=120, feature_names=["g0", "g1"]),
        EmbeddingBagConfig(name="w_fused", embedding_dim=8, num_embeddings=90, feature_names=["g2"]),
    ]


def constraints():
    c = {}
    c.update(ibp_constraints(["ibp_tw", "ibp_tw2", "w_ibp"], sharding_types=[TW]))
    c.update(ibp_constraints(["ibp_cw"], sharding_types=[CW], min_partition=8))
    c["fused_tw"] = ParameterConstraints(sharding_types=[TW], compute_kernels=["fused"])
    c["fused_cw"] = ParameterConstraints(sharding_types=[CW], compute_kernels=["fused"], min_partition=8)
    c["w_fused"] = ParameterConstraints(sharding_types=[TW], compute_kernels=["fused"])
    return c


class Model(torch.nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables(), device=device)
        self.wbc = EmbeddingBagCollection(wtables(), is_weighted=True, device=device)
        self.dense = torch.nn.Linear(2, 2)

    def forward(self, kjt, wkjt):
        return self.ebc(kjt), self.wbc(wkjt)


def rows_of(configs):
    rows = {}
    for t in configs:
        for f in t.feature_names:
            rows[f] = min(rows.get(f, t.num_embeddings), t.num_embeddings)
    return rows


def batch(configs, rng, weighted=False):
    rows = rows_of(configs)
    values, lengths = [], []
    for k in rows:
        for _ in range(B):
            n = int(rng.integers(0, 5))
            ids = rng.zipf(1.3, n) % rows[k]
            if n > 1:
                ids[-1] = ids[0]
            values.extend(int(i) for i in ids)
            lengths.append(n)
    w = torch.from_numpy(rng.uniform(-1, 1, len(values)).astype(np.float32)) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=list(rows), values=torch.tensor(values, dtype=torch.int64),
                                               lengths=torch.tensor(lengths, dtype=torch.int64), weights=w)


def topology():
    return Topology(world_size=WORLD, compute_device="cpu", local_world_size=WORLD)


# ---- planner (one process) ----

def test_planner_mixes_ibp_and_fbgemm_tables():
    torch.manual_seed(0)
    model = Model()
    sharders = [IBPEmbeddingBagCollectionSharder()]
    planner = ibp_planner(topology(), batch_size=B, constraints=constraints())
    assert type(planner) is EmbeddingShardingPlanner  # the stock planner
    plan = planner.plan(model, sharders)
    ebc_plan, wbc_plan = plan.plan["ebc"], plan.plan["wbc"]
    kernels = {n: p.compute_kernel for n, p in {**ebc_plan, **wbc_plan}.items()}
    types = {n: p.sharding_type for n, p in {**ebc_plan, **wbc_plan}.items()}
    assert kernels == {"ibp_tw": IBP_COMPUTE_KERNEL, "ibp_cw": IBP_COMPUTE_KERNEL, "ibp_tw2": IBP_COMPUTE_KERNEL,
                       "w_ibp": IBP_COMPUTE_KERNEL, "fused_tw": "fused", "fused_cw": "fused", "w_fused": "fused"}
    assert types["ibp_cw"] == CW and types["ibp_tw"] == TW
    assert len(ebc_plan["ibp_cw"].sharding_spec.shards) == 2


def test_planner_counts_compressed_host_memory():
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

    torch.manual_seed(0)
    model = Model()
    cons = {"ibp_tw": ParameterConstraints(sharding_types=[TW], compute_kernels=[IBP_COMPUTE_KERNEL, "fused"])}
    topo = topology()
    storage = IBPStorageEstimator(topo, cons, is_inference=True)
    from ibp_embed.torchrec import ibp_estimators

    perf = ibp_estimators(topo, cons, is_inference=True)[0]
    enum = EmbeddingEnumerator(topo, B, cons, estimator=[perf, storage])
    opts = [o for o in enum.enumerate(model, [IBPEmbeddingBagCollectionSharder()]) if o.name == "ibp_tw"]
    by_kernel = {o.compute_kernel: o for o in opts}
    ibp, fused = by_kernel[IBP_COMPUTE_KERNEL], by_kernel["fused"]
    ratio = storage.ratio(ibp)
    assert ratio > 1.0  # measured on a sample of the real table
    raw = 400 * 16 * 4
    assert ibp.total_storage.ddr == pytest.approx(raw / ratio, abs=2)
    assert fused.total_storage.ddr == raw
    assert ibp.total_perf > 0 and fused.total_perf > 0
    # explicit ratios win over measuring
    s2 = IBPStorageEstimator(topo, cons, compression_ratios={"ibp_tw": 2.0}, is_inference=True)
    assert s2.ratio(ibp) == 2.0


def test_stock_estimators_cannot_cost_the_kernel():
    """Why ibp_planner exists: TorchRec's own estimators have no figure for customized_kernel."""
    torch.manual_seed(0)
    planner = EmbeddingShardingPlanner(topology=topology(), batch_size=B, constraints=constraints())
    with pytest.raises(Exception, match="customized_kernel"):
        planner.plan(Model(), [IBPEmbeddingBagCollectionSharder()])


def test_sharder_offers_the_ibp_kernel_for_five_sharding_types_on_cpu():
    with pytest.raises(ValueError, match="data_parallel"):
        ibp_constraints(["t"], sharding_types=["data_parallel"])
    assert ibp_constraints(["t"])["t"].sharding_types == [TW, CW, RW]
    sharder = IBPEmbeddingBagCollectionSharder()
    for st in (TW, CW, ShardingType.TABLE_COLUMN_WISE.value, RW, TWRW):
        assert st in sharder.sharding_types("cpu")
        assert IBP_COMPUTE_KERNEL in sharder.compute_kernels(st, "cpu")
    # TorchRec's own kernels keep TorchRec's offer: row-wise on CUDA only
    assert sharder.compute_kernels(RW, "cpu") == [IBP_COMPUTE_KERNEL]
    assert "fused" in sharder.compute_kernels(TW, "cpu")
    assert IBP_COMPUTE_KERNEL in sharder.compute_kernels(TW, "cuda") and "fused" in sharder.compute_kernels(TW, "cuda")
    assert IBP_COMPUTE_KERNEL not in sharder.compute_kernels(ShardingType.DATA_PARALLEL.value, "cpu")


# ---- 2 ranks ----

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _two_rank_checks(rank)
        import gc

        gc.collect()  # free the DMPs (their DDP reducers) before their process group
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _two_rank_checks(rank):
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    from ibp_embed.torchrec import IBPShardedEmbeddingBagCollection

    torch.manual_seed(0)  # same unsharded weights on every rank
    ref = Model()
    model = Model()
    model.load_state_dict(ref.state_dict())
    sharders = [IBPEmbeddingBagCollectionSharder()]
    planner = ibp_planner(topology(), batch_size=B, constraints=constraints())
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                   device=torch.device("cpu"), plan=plan, sharders=sharders)
    sebc = dmp.module.ebc
    assert isinstance(sebc, IBPShardedEmbeddingBagCollection)
    # IBP shards were compressed from the unsharded module's weights at sharding time
    full = ref.state_dict()
    n_checked = 0
    for m, prefix in ((dmp.module.ebc, "ebc"), (dmp.module.wbc, "wbc")):
        for name, shards in m._ibp_shards.items():
            for kernel, i, md, _ in shards:
                (r0, c0), (nr, nc) = md.shard_offsets, md.shard_sizes
                w = full[f"{prefix}.embedding_bags.{name}.weight"]
                assert torch.equal(kernel.shard_weight(i), w[r0:r0 + nr, c0:c0 + nc])
                n_checked += 1
    counts = [0] * WORLD
    dist.all_gather_object(counts, n_checked)
    assert sum(counts) == 5, counts  # ibp_tw, ibp_tw2, w_ibp + two column shards of ibp_cw
    # FBGEMM tables on CPU start from their own init: copy the reference weights in.
    # (IBP tables already hold the module's weights; the load re-compresses them.)
    dmp.load_state_dict(ref.state_dict())

    rng = np.random.default_rng(100 + rank)
    kjt, wkjt = batch(tables(), rng), batch(wtables(), rng, weighted=True)

    def check(dmp_, scale=None):
        out, wout = dmp_(kjt, wkjt)
        exp, wexp = ref(kjt, wkjt)
        for o, e in ((out, exp), (wout, wexp)):
            o = o.wait() if hasattr(o, "wait") else o
            # A sharded EBC groups its output keys by sharding type (TorchRec's own
            # behaviour, IBP or not): compare key by key.
            assert sorted(o.keys()) == sorted(e.keys()), (o.keys(), e.keys())
            od, ed = o.to_dict(), e.to_dict()
            for k in e.keys():
                ev = ed[k].detach()
                if scale is not None:
                    ev = ev * scale(k)
                torch.testing.assert_close(od[k].detach(), ev, rtol=1e-6, atol=1e-7, msg=k)

    with torch.no_grad():
        check(dmp)

    # state_dict: TorchRec keys; IBP tables as ShardedTensors of decompressed local shards
    sd = dmp.state_dict()
    for name in ("ibp_tw", "ibp_cw", "ibp_tw2"):
        key = f"ebc.embedding_bags.{name}.weight"
        st = sd[key]
        assert isinstance(st, ShardedTensor) and tuple(st.size()) == tuple(full[key].shape)
        for shard in st.local_shards():
            (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            assert torch.equal(shard.tensor, full[key][r0:r0 + nr, c0:c0 + nc])
    assert isinstance(sd["wbc.embedding_bags.w_ibp.weight"], ShardedTensor)
    assert isinstance(sd["ebc.embedding_bags.fused_tw.weight"], ShardedTensor)
    n_local = sum(len(sd[f"ebc.embedding_bags.{n}.weight"].local_shards()) for n in ("ibp_tw", "ibp_cw",
                                                                                    "ibp_tw2"))
    counts = [0] * WORLD
    dist.all_gather_object(counts, n_local)
    assert sum(counts) == 4  # ibp_tw, ibp_tw2 + two column shards of ibp_cw, spread over the ranks
    # the IBP tables run in the IBP kernel, the others in FBGEMM's fused TBE
    from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbeddingBag

    from ibp_embed.torchrec import IBPBatchedEmbeddingBag

    local = {"ibp": set(), "fused": set()}
    for m in (dmp.module.ebc, dmp.module.wbc):
        for lookup in m._lookups:
            for k in lookup._emb_modules:
                kind = "ibp" if isinstance(k, IBPBatchedEmbeddingBag) else \
                    "fused" if isinstance(k, BatchedFusedEmbeddingBag) else type(k).__name__
                local.setdefault(kind, set()).update(t.name for t in k.config.embedding_tables)
    everything = [None] * WORLD
    dist.all_gather_object(everything, local)
    ibp_all = set().union(*(e["ibp"] for e in everything))
    fused_all = set().union(*(e["fused"] for e in everything))
    assert ibp_all == {"ibp_tw", "ibp_cw", "ibp_tw2", "w_ibp"}, everything
    assert fused_all == {"fused_tw", "fused_cw", "w_fused"}, everything
    assert set().union(*(set(e) for e in everything)) == {"ibp", "fused"}, everything
    nbytes = [0] * WORLD
    dist.all_gather_object(nbytes, sebc.ibp_compressed_nbytes + dmp.module.wbc.ibp_compressed_nbytes)
    assert sum(nbytes) > 0

    # load a modified full checkpoint: IBP tables re-compress their local shards
    doubled = {k: v * 2 for k, v in full.items()}
    dmp.load_state_dict(doubled)
    with torch.no_grad():
        check(dmp, scale=lambda k: 2.0)
    # load the IBP tables' ShardedTensors of the first state_dict back (fresh copies; TorchRec's
    # own entries alias the live FBGEMM weights, so only the IBP part is a snapshot)
    ibp_keys = [k for k in sd if any(f".{n}.weight" in k for n in ("ibp_tw", "ibp_cw", "ibp_tw2", "w_ibp"))]
    res = dmp.load_state_dict({k: sd[k] for k in ibp_keys}, strict=False)
    assert not res.unexpected_keys
    ibp_features = {"f0@ibp_tw", "f1", "f2", "f3", "g0", "g1"}
    with torch.no_grad():
        check(dmp, scale=lambda k: 1.0 if k in ibp_features else 2.0)


def test_dmp_two_ranks_matches_unsharded():
    mp.spawn(_worker, args=(_free_port(),), nprocs=WORLD, join=True)


def test_unsupported_sharding_of_ibp_tables():
    from torchrec.distributed.types import ParameterSharding

    from ibp_embed.torchrec import IBPShardedEmbeddingBagCollection

    model = Model(device=torch.device("meta"))
    for st, msg in ((ShardingType.GRID_SHARD.value, "not supported"),
                    (ShardingType.DATA_PARALLEL.value, "stay on FBGEMM")):
        params = {"ibp_tw": ParameterSharding(sharding_type=st, compute_kernel=IBP_COMPUTE_KERNEL, ranks=[0])}
        with pytest.raises(NotImplementedError, match=msg):
            IBPShardedEmbeddingBagCollection(model.ebc, params, env=None)


# ---- training configuration ----

def test_fused_params_pick_the_sparse_optimizer():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    from ibp_embed.optim import SGD, Adagrad, RowWiseAdagrad
    from ibp_embed.torchrec import optimizer_from_fused_params as parse

    assert parse(None) == SGD(0.01)  # FBGEMM's TBE defaults
    assert parse({"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.2, "eps": 1e-6}) == Adagrad(0.2, 1e-6)
    rw = parse({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "weight_decay": 0.01,
                "weight_decay_mode": WeightDecayMode.DECOUPLE, "cache_load_factor": 0.2,
                "prefetch_pipeline": False, "gradient_clipping": False})
    assert rw == RowWiseAdagrad(0.1, weight_decay=0.01, weight_decay_mode="decouple")
    assert parse({"optimizer": "exact_sgd", "learning_rate": 0.3}) == SGD(0.3)
    for bad, msg in (({"optimizer": EmbOptimType.ADAM}, "not supported"),
                     ({"optimizer": EmbOptimType.EXACT_SGD, "weight_decay": 0.1, "weight_decay_mode": 1},
                      "weight decay needs"),
                     ({"weight_decay_mode": WeightDecayMode.COUNTER}, "NONE, L2 or DECOUPLE"),
                     ({"gradient_clipping": True}, "gradient_clipping"),
                     ({"learning_rate_schedule": 1}, "unsupported fused_params")):
        with pytest.raises(ValueError, match=msg):
            parse(bad)


def _optimizer_in_backward_worker(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    try:
        _optimizer_in_backward_checks()
        import gc

        gc.collect()
    finally:
        dist.destroy_process_group()


def _optimizer_in_backward_checks():
    import torchrec.optim as trec_optim
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from ibp_embed.optim import RowWiseAdagrad
    from ibp_embed.torchrec import IBPBatchedEmbeddingBag

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=64,
                                                     feature_names=["f"])])
    apply_optimizer_in_backward(trec_optim.RowWiseAdagrad, ebc.parameters(), {"lr": 0.5, "eps": 1e-6})
    sharder = IBPEmbeddingBagCollectionSharder()
    plan = construct_module_sharding_plan(ebc, {"t": row_wise(compute_kernel=IBP_COMPUTE_KERNEL)},
                                          sharder=sharder, local_size=1, world_size=1, device_type="cpu")
    dmp = DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                   device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder])
    kernels = [k for lk in dmp.module._lookups for k in lk._emb_modules]
    assert isinstance(kernels[0], IBPBatchedEmbeddingBag)
    assert kernels[0].optimizer == RowWiseAdagrad(0.5, eps=1e-6)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([3, 7, 3]),
                                              lengths=torch.tensor([2, 1]))

    def weight():
        return dmp.state_dict()["embedding_bags.t.weight"].local_shards()[0].tensor

    before = weight()
    dmp(kjt).wait().values().sum().backward()
    after = weight()
    assert not torch.equal(after[3], before[3]) and torch.equal(after[5], before[5])
    state = dmp.fused_optimizer.state_dict()["state"]["embedding_bags.t.weight"]["t.momentum1"]
    assert state.local_shards()[0].tensor[3] > 0
    # a learning-rate change through the KeyedOptimizer applies from its next step()
    dmp.fused_optimizer.param_groups[0]["lr"] = 0.0
    dmp.fused_optimizer.step()
    dmp(kjt).wait().values().sum().backward()
    assert torch.equal(weight(), after)


def test_apply_optimizer_in_backward_configures_the_ibp_kernel():
    mp.spawn(_optimizer_in_backward_worker, args=(_free_port(),), nprocs=1, join=True)


def test_planner_costs_row_wise_ibp_tables_on_cpu():
    torch.manual_seed(0)
    model = Model()
    cons = constraints()
    cons.update(ibp_constraints(["ibp_tw"], sharding_types=[RW]))
    plan = ibp_planner(topology(), batch_size=B, constraints=cons).plan(model, [IBPEmbeddingBagCollectionSharder()])
    ps = plan.plan["ebc"]["ibp_tw"]
    assert (ps.sharding_type, ps.compute_kernel) == (RW, IBP_COMPUTE_KERNEL)
    assert len(ps.sharding_spec.shards) == WORLD
