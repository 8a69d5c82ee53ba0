"""The TorchRec GPU path: IBP tables on "cuda" in the module, the DMP kernel, the sharder
and the planner.

Without a GPU everything above the CUDA library runs under its host emulation
(ibp_embed.cuda.emulation(): the kernels' per-lane code on the host, CPU tensors
standing for device ones) and is compared with the CPU module: lookups, the HBM row
cache, KeyedTensor layout, training (row gradients reduced "on the device", steps on
the host), checkpoints. Tests marked `gpu` run the same on a real device
(benchmarks/gpu_check.sh) and are skipped here with the reason.
"""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig, \
    ShardedEmbeddingTable, ShardingType
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharding_spec import ShardMetadata

from ibp_embed import cuda
from ibp_embed.errors import NativeLibraryError
from ibp_embed.optim import SGD, Adagrad, RowWiseAdagrad
from ibp_embed.torchrec import IBP_COMPUTE_KERNEL, IBPEmbeddingBagCollection, IBPEmbeddingBagCollectionSharder
from ibp_embed.torchrec.device import reduce_row_gradients
from ibp_embed.torchrec.kernel import IBPBatchedEmbeddingBag

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
TW, CW, TWCW = ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value
RW, TWRW, DP = ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value, ShardingType.DATA_PARALLEL.value


@pytest.fixture(scope="module", autouse=True)
def cuda_library():
    try:
        cuda.load_library()
    except NativeLibraryError as e:
        pytest.skip(f"libibp_cuda is not built here ({e})")


@pytest.fixture
def emulated():
    with cuda.emulation():
        yield


def configs(data_type=DataType.FP32, pooling=PoolingType.SUM):
    return [EmbeddingBagConfig(name="t0", num_embeddings=3000, embedding_dim=16, feature_names=["f0", "f1"],
                               data_type=data_type, pooling=pooling),
            EmbeddingBagConfig(name="t1", num_embeddings=700, embedding_dim=8, feature_names=["f2"],
                               data_type=data_type, pooling=pooling)]


def batch(b=256, keys=("f0", "f1", "f2"), max_len=6, n_rows=700, weighted=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len, (len(keys) * b,), generator=g)
    lengths[::7] = 0  # empty bags
    n = int(lengths.sum())
    # skewed ids: repeats inside and across bags
    values = (torch.rand(n, generator=g) ** 3 * n_rows).long()
    weights = torch.rand(n, generator=g) if weighted else None
    return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths, weights=weights)


def cpu_and_cuda(cfgs, weighted=False, **kwargs):
    torch.manual_seed(0)
    cpu = IBPEmbeddingBagCollection(cfgs, is_weighted=weighted)
    dev = IBPEmbeddingBagCollection(cfgs, is_weighted=weighted, device="cuda", _tables=cpu.tables(), **kwargs)
    return cpu, dev


def close(a, b):
    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


# ---- the module on cuda ----

@no_gpu
def test_cuda_without_a_gpu_is_a_clear_error():
    with cuda.emulation(False):
        with pytest.raises(cuda.NoCudaDeviceError, match="no CUDA device"):
            IBPEmbeddingBagCollection(configs(), device="cuda")
        with pytest.raises(cuda.NoCudaDeviceError, match="no CUDA device"):
            IBPEmbeddingBagCollection.from_embedding_bag_collection(
                IBPEmbeddingBagCollection(configs()).to_embedding_bag_collection(), device="cuda")


@pytest.mark.parametrize("data_type", [DataType.FP32, DataType.FP16, DataType.BF16])
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
def test_module_on_cuda_matches_cpu(emulated, data_type, pooling, weighted):
    cpu, dev = cpu_and_cuda(configs(data_type, pooling), weighted)
    assert dev.device == torch.device("cuda", 0)
    kjt = batch(weighted=weighted)
    want, got = cpu(kjt), dev(kjt)
    assert got.keys() == want.keys() and got.length_per_key() == want.length_per_key()
    assert got.values().device == cuda.storage_device("cuda")
    close(got.values(), want.values())
    assert all(b.device_table is not None for b in dev.embedding_bags.values())


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_module_cache_serves_the_same_rows(emulated, policy):
    cpu, dev = cpu_and_cuda(configs(), cache_load_factor=0.1, cache_policy=policy)
    for seed in range(4):  # the cache warms on earlier batches, serves later ones
        kjt = batch(seed=seed)
        close(dev(kjt).values(), cpu(kjt).values())
    stats = dev.cache_stats()
    assert set(stats) == {"t0", "t1"}
    assert 0.0 < stats["t0"]["hit_rate"] < 1.0 and stats["t0"]["inserts"] > 0
    cache = dev.embedding_bags["t0"].device_table.cache
    assert cache.capacity == 300
    stats = dev.memory_stats()
    assert stats["cache_bytes"] == sum(b.device_table.cache.nbytes for b in dev.embedding_bags.values())
    # the placed tables' codebooks and offsets indexes (2 bytes a row here) are device memory too
    assert stats["device_bytes"] > stats["cache_bytes"] + 2 * 3700
    with pytest.raises(ValueError, match="cache_load_factor"):
        IBPEmbeddingBagCollection(configs(), device="cuda", cache_load_factor=1.5)
    with pytest.raises(ValueError, match="cache_policy"):
        IBPEmbeddingBagCollection(configs(), device="cuda", cache_load_factor=0.1, cache_policy="fifo")


def test_module_on_cuda_errors_name_the_feature(emulated):
    _, dev = cpu_and_cuda(configs())
    kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.tensor([1, 2, 700]),
                            lengths=torch.tensor([1, 1, 1]))
    with pytest.raises(IndexError, match="feature 'f2'.*700"):
        dev(kjt)
    with pytest.raises(TypeError, match="integers"):
        dev(KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.tensor([1.0, 2.0, 3.0]),
                              lengths=torch.tensor([1, 1, 1])))


def test_moving_a_module_on_cuda_keeps_its_rows_on_the_host(emulated):
    """.to("cuda") of a placed module applies nothing to the packed buffers (they stay in
    host memory); another device index places the tables again."""
    cpu, dev = cpu_and_cuda(configs(), cache_load_factor=0.1)
    bag = dev.embedding_bags["t0"]
    placed, payload = bag.device_table, bag.payload

    class OnDevice:  # what a .to(device) fn returns for the probe (no CUDA tensors here)
        def __init__(self, index):
            self.device = torch.device("cuda", index)

    calls = []
    dev._apply(lambda t: calls.append(t) or OnDevice(0))
    assert all(c.numel() == 0 for c in calls)  # only the probes: no buffer was moved
    assert bag.device_table is placed and bag.payload is payload
    dev._apply(lambda t: OnDevice(1))
    assert bag.device_table is not placed and bag.device_table.device == torch.device("cuda", 1)
    assert bag.device_table.cache is not None and dev.device == torch.device("cuda", 1)
    close(dev(batch()).values(), cpu(batch()).values())


def test_graph_capture_on_cuda_is_a_clear_error(emulated):
    import torchrec.fx

    _, dev = cpu_and_cuda(configs())
    with pytest.raises(RuntimeError, match="cannot be traced"):
        torchrec.fx.symbolic_trace(dev)
    scripted = torch.jit.script(dev)
    with pytest.raises(Exception, match="is on cuda"):
        scripted(batch())


def test_module_on_cuda_checkpoints_and_copies(emulated, tmp_path):
    cpu, dev = cpu_and_cuda(configs(), cache_load_factor=0.2)
    kjt = batch()
    want = cpu(kjt).values()
    # state_dict tensors are on the host (a decompressed table may not fit in HBM)
    sd = dev.state_dict()
    assert sd["embedding_bags.t0.weight"].device.type == "cpu"
    other = IBPEmbeddingBagCollection(configs(), device="cuda")
    other.load_state_dict(sd)
    close(other(kjt).values(), want)
    for clone in (copy.deepcopy(dev), pickle.loads(pickle.dumps(dev))):
        assert clone.embedding_bags["t0"].device_table is not dev.embedding_bags["t0"].device_table
        close(clone(kjt).values(), want)
    dev.save_compressed(tmp_path / "ckpt")
    for mmap in (False, True):
        loaded = IBPEmbeddingBagCollection.load_compressed(tmp_path / "ckpt", mmap=mmap, device="cuda",
                                                           cache_load_factor=0.2)
        assert loaded.device.type == "cuda" and loaded.cache_stats().keys() == {"t0", "t1"}
        close(loaded(kjt).values(), want)
    ebc = cpu.to_embedding_bag_collection()
    from_ebc = IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc, device="cuda")
    close(from_ebc(kjt).values(), want)


# ---- training on cuda ----

@pytest.mark.parametrize("optimizer", [SGD(0.1), Adagrad(0.1), RowWiseAdagrad(0.1),
                                       RowWiseAdagrad(0.05, weight_decay=0.01, weight_decay_mode="decouple")],
                         ids=["sgd", "adagrad", "rowwise", "rowwise_wd"])
@pytest.mark.parametrize("pooling,weighted", [(PoolingType.SUM, False), (PoolingType.MEAN, True)])
def test_training_on_cuda_matches_cpu(emulated, optimizer, pooling, weighted):
    cfgs = configs(pooling=pooling)
    torch.manual_seed(0)
    base = IBPEmbeddingBagCollection(cfgs, is_weighted=weighted)
    cpu = IBPEmbeddingBagCollection(cfgs, is_weighted=weighted, optimizer=copy.deepcopy(optimizer),
                                    _tables=base.tables())
    dev = IBPEmbeddingBagCollection(cfgs, is_weighted=weighted, device="cuda", optimizer=copy.deepcopy(optimizer),
                                    cache_load_factor=0.2, _tables=base.tables())
    assert all(b.device_table is None for b in dev.embedding_bags.values())  # trainable: read on the host
    for step in range(3):
        kjt = batch(seed=step, weighted=weighted)
        for m in (cpu, dev):
            out = m(kjt).values()
            assert out.device == (torch.device("cpu") if m is cpu else cuda.storage_device("cuda"))
            (out * torch.linspace(-1, 1, out.shape[1])).pow(2).sum().backward()
    for name in ("t0", "t1"):
        close(dev.embedding_bags[name].weight, cpu.embedding_bags[name].weight)
        for k, v in cpu.embedding_bags[name].optimizer_state.items():
            close(dev.embedding_bags[name].optimizer_state[k], v)
    assert not torch.equal(dev.embedding_bags["t0"].weight, base.embedding_bags["t0"].weight)
    with torch.no_grad():  # inference of a trainable module: host lookups, outputs on the device
        close(dev(batch(seed=9, weighted=weighted)).values(), cpu(batch(seed=9, weighted=weighted)).values())


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_reduce_row_gradients_is_the_dense_gradient(mode):
    """Row gradients of pooled lookups (two features of one table, weights) equal the
    gradient autograd gives a dense table."""
    rng = np.random.default_rng(1)
    b, dim, n_rows = 32, 8, 50
    items, grads, col = [], [], 0
    weight = torch.randn(n_rows, dim, dtype=torch.float64, requires_grad=True)
    total = 0
    for _ in range(2):
        lengths = rng.integers(0, 5, b)
        off = np.concatenate([[0], np.cumsum(lengths)])
        ids = rng.integers(0, n_rows, off[-1])
        ws = rng.random(off[-1]).astype(np.float32)
        items.append((ids, off, ws, col))
        pooled = F.embedding_bag(torch.from_numpy(ids), weight, torch.from_numpy(off), mode="sum",
                                 per_sample_weights=torch.from_numpy(ws).double(), include_last_offset=True)
        if mode == "mean":
            pooled = pooled / torch.from_numpy(np.maximum(lengths, 1))[:, None]
        g = torch.randn(b, dim, dtype=torch.float64)
        total = total + (pooled * g).sum()
        grads.append(g)
        col += dim
    total.backward()
    grad_out = torch.cat(grads, dim=1).float()
    ids, rows = reduce_row_gradients(items, b, grad_out, mode, dim)
    touched = np.unique(np.concatenate([it[0] for it in items]))
    assert np.array_equal(ids, touched)
    torch.testing.assert_close(rows.double(), weight.grad[torch.from_numpy(ids)], rtol=1e-5, atol=1e-5)


# ---- the DMP kernel on cuda ----

def grouped_config(device="cuda:0", fused_params=None, weighted=False):
    tables = []
    for name, rows, dim, feats in (("t0", 3000, 16, ["f0", "f1"]), ("t1", 700, 8, ["f2"])):
        md = ShardMetadata(shard_offsets=[0, 0], shard_sizes=[rows, dim], placement=f"rank:0/{device}")
        tables.append(ShardedEmbeddingTable(
            num_embeddings=rows, embedding_dim=dim, name=name, feature_names=feats, data_type=DataType.FP32,
            pooling=PoolingType.SUM, is_weighted=weighted, compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL,
            local_rows=rows, local_cols=dim, local_metadata=md, fused_params=fused_params,
            global_metadata=ShardedTensorMetadata([md], torch.Size([rows, dim]),
                                                  TensorProperties(dtype=torch.float32))))
    return GroupedEmbeddingConfig(data_type=DataType.FP32, pooling=PoolingType.SUM, is_weighted=weighted,
                                  has_feature_processor=False, compute_kernel=EmbeddingComputeKernel.CUSTOMIZED_KERNEL,
                                  embedding_tables=tables, fused_params=fused_params)


def kernels(fused_params):
    torch.manual_seed(0)
    weights = [torch.randn(3000, 16) * 0.01, torch.randn(700, 8) * 0.01]
    out = []
    for dev in ("cpu", "cuda:0"):
        k = IBPBatchedEmbeddingBag(grouped_config(dev, fused_params), device=torch.device(dev))
        for i, w in enumerate(weights):
            k.load_shard(i, w)
        out.append(k)
    return out


def test_kernel_on_cuda_looks_up_on_the_device(emulated):
    cpu, dev = kernels({"cache_load_factor": 0.2, "cache_algorithm": "LFU"})
    assert dev.on_cuda and not cpu.on_cuda
    with torch.no_grad():
        for seed in range(3):
            kjt = batch(seed=seed)
            close(dev(kjt), cpu(kjt))
    stats = dev.cache_stats()
    assert stats.keys() == {"t0", "t1"} and stats["t0"]["hits"] > 0
    assert dev.device_tables()[0].cache.policy == "lfu"
    with pytest.raises(ValueError, match="cache_algorithm"):
        IBPBatchedEmbeddingBag(grouped_config(fused_params={"cache_algorithm": "FIFO"}), device=torch.device("cuda"))


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo group: the fused optimizer's state is ShardedTensors."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_kernel_on_cuda_trains_like_cpu(emulated, one_rank):
    fp = {"optimizer": "exact_row_wise_adagrad", "learning_rate": 0.1, "cache_load_factor": 0.2}
    cpu, dev = kernels(fp)
    for step in range(3):
        kjt = batch(seed=step)
        for k in (cpu, dev):
            k(kjt).pow(2).sum().backward()
    for i in range(2):
        close(dev.shard_weight(i), cpu.shard_weight(i))
        close(dev._states[i]["momentum1"], cpu._states[i]["momentum1"])
    # the fused optimizer's state is on the host, whatever the placement says
    state = dev.fused_optimizer.state
    st = next(v for s in state.values() for k, v in s.items() if k == "t0.momentum1")
    assert st.local_shards()[0].tensor.device.type == "cpu"
    assert str(st.local_shards()[0].metadata.placement) == "rank:0/cpu"


def test_kernel_on_cuda_in_eval_mode_stays_on_the_device(emulated):
    """eval() without no_grad() must not turn the tables into (host-read) training stores."""
    cpu, dev = kernels({"optimizer": "exact_sgd", "learning_rate": 0.1, "cache_load_factor": 0.2})
    dev.eval()
    kjt = batch()
    close(dev(kjt), cpu.eval()(kjt))
    assert all(d is not None for d in dev._device_tables)
    empty = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.zeros(0, dtype=torch.int64),
                              lengths=torch.zeros(0, dtype=torch.int64), stride=0)
    assert dev(empty).shape == (0, 40)


@no_gpu
def test_kernel_on_cuda_without_a_gpu_is_a_clear_error():
    with cuda.emulation(False), pytest.raises(cuda.NoCudaDeviceError, match="no CUDA device"):
        IBPBatchedEmbeddingBag(grouped_config(), device=torch.device("cuda"))


# ---- sharder and planner ----

def test_sharder_offers_the_kernel_on_cuda():
    sharder = IBPEmbeddingBagCollectionSharder()
    for st in (TW, CW, TWCW, RW, TWRW):
        assert st in sharder.sharding_types("cuda")
        kernels_ = sharder.compute_kernels(st, "cuda")
        assert IBP_COMPUTE_KERNEL in kernels_
        assert EmbeddingComputeKernel.FUSED_UVM_CACHING.value in kernels_  # TorchRec's own stay
    assert IBP_COMPUTE_KERNEL not in sharder.compute_kernels(DP, "cuda")


def test_planner_costs_the_kernel_on_cuda():
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import CacheParams

    from ibp_embed.torchrec import IBPPerfEstimatorConfig, ibp_planner

    hbm, ddr, pcie = 900.0, 50.0, 32.0
    cfg = IBPPerfEstimatorConfig(cpu_bandwidth_factor=0.4, cuda_bandwidth_factor=1.2, is_inference=True)
    uvm_caching = cfg.get_device_bw("cuda", EmbeddingComputeKernel.FUSED_UVM_CACHING.value, hbm, ddr, 0, pcie, 0.2)
    ibp_cached = cfg.get_device_bw("cuda", IBP_COMPUTE_KERNEL, hbm, ddr, 0, pcie, 0.2)
    assert ibp_cached == pytest.approx((0.2 * hbm + 0.8 * 1.2 * pcie) / 10) and ibp_cached > uvm_caching
    assert cfg.get_device_bw("cuda", IBP_COMPUTE_KERNEL, hbm, ddr, 0, pcie) == pytest.approx(1.2 * pcie / 10)
    training = IBPPerfEstimatorConfig(cpu_bandwidth_factor=0.4, cuda_bandwidth_factor=1.2)
    # training on cuda looks rows up on the host, cache or not: costed as the CPU kernel
    assert training.get_device_bw("cuda", IBP_COMPUTE_KERNEL, hbm, ddr, 0, pcie, 0.2) == pytest.approx(0.4 * ddr)

    tables = [EmbeddingBagConfig(name=f"t{i}", num_embeddings=100_000, embedding_dim=64, feature_names=[f"f{i}"])
              for i in range(2)]
    ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))
    constraints = {
        "t0": ParameterConstraints(sharding_types=[RW], compute_kernels=[IBP_COMPUTE_KERNEL],
                                   cache_params=CacheParams(load_factor=0.1)),
        "t1": ParameterConstraints(sharding_types=[TW], compute_kernels=[IBP_COMPUTE_KERNEL]),
    }
    topology = Topology(world_size=2, compute_device="cuda")
    ratios = {"t0": 1.25, "t1": 1.25}
    raw_shard, t1_raw = 50_000 * 64 * 4, 100_000 * 64 * 4
    index = 2.125  # bytes a row of the offsets index placed on the device (16-bit entries here)

    def storages(is_inference, sharder):
        planner = ibp_planner(topology, batch_size=512, constraints=constraints, compression_ratios=ratios,
                              is_inference=is_inference)
        plan = planner.plan(ebc, [sharder]).plan[""]
        assert plan["t0"].compute_kernel == plan["t1"].compute_kernel == IBP_COMPUTE_KERNEL
        assert plan["t0"].sharding_type == RW and plan["t1"].sharding_type == TW
        return {o.name: o.shards[0].storage for o in planner._enumerator.enumerate(ebc, [sharder])
                if o.compute_kernel == IBP_COMPUTE_KERNEL and o.sharding_type in (RW, TW)}

    # inference: compressed rows in host memory; index, cache and its bookkeeping in HBM
    st = storages(True, IBPEmbeddingBagCollectionSharder())
    assert raw_shard / 1.25 <= st["t0"].ddr < raw_shard
    cached = 5_000
    t0_device = raw_shard * 0.1 + 4 * 50_000 + 24 * cached + index * 50_000
    assert t0_device <= st["t0"].hbm < t0_device + 0.01 * raw_shard
    t1_device = index * 100_000
    assert t1_device <= st["t1"].hbm < t1_device + 0.02 * t1_raw  # no cache: the index and batch I/O
    # a cache asked for in the sharder's fused_params (LFU) counts as one in cache_params
    st = storages(True, IBPEmbeddingBagCollectionSharder(fused_params={"cache_load_factor": 0.2,
                                                                        "cache_algorithm": "LFU"}))
    assert st["t0"].hbm >= t0_device  # cache_params (0.1) wins over fused_params, as in TorchRec
    assert st["t1"].hbm >= t1_raw * 0.2 + 12 * 100_000 + 24 * 20_000 + t1_device
    # training: nothing placed on the device; the optimizer state (default SGD: none) on the host
    st = storages(False, IBPEmbeddingBagCollectionSharder())
    assert st["t0"].hbm < 0.05 * raw_shard and st["t1"].hbm < 0.05 * t1_raw  # batch I/O only
    assert raw_shard / 1.25 <= st["t0"].ddr < raw_shard


# ---- on a real GPU (benchmarks/gpu_check.sh) ----

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cache", [None, 0.1])
def test_gpu_module_matches_cpu(cache):
    with cuda.emulation(False):
        cpu, dev = cpu_and_cuda(configs(), cache_load_factor=cache)
        for seed in range(3):
            kjt = batch(seed=seed)
            got = dev(kjt.to(torch.device("cuda")))
            assert got.values().device.type == "cuda"
            close(got.values().cpu(), cpu(kjt).values())
        moved = copy.deepcopy(cpu).to("cuda")  # .to("cuda"): rows stay in host memory
        assert moved.device.type == "cuda" and moved.embedding_bags["t0"].payload.device.type == "cpu"
        close(moved(kjt.to(torch.device("cuda"))).values().cpu(), cpu(kjt).values())
        assert moved.cpu().device.type == "cpu"


@pytest.mark.gpu
@needs_gpu
def test_gpu_training_matches_cpu():
    with cuda.emulation(False):
        torch.manual_seed(0)
        base = IBPEmbeddingBagCollection(configs())
        cpu = IBPEmbeddingBagCollection(configs(), optimizer=RowWiseAdagrad(0.1), _tables=base.tables())
        dev = IBPEmbeddingBagCollection(configs(), device="cuda", optimizer=RowWiseAdagrad(0.1),
                                        _tables=base.tables())
        for step in range(3):
            kjt = batch(seed=step)
            cpu(kjt).values().pow(2).sum().backward()
            dev(kjt.to(torch.device("cuda"))).values().pow(2).sum().backward()
        for name in ("t0", "t1"):
            close(dev.embedding_bags[name].weight, cpu.embedding_bags[name].weight)


@pytest.mark.gpu
@needs_gpu
def test_gpu_kernel_matches_cpu():
    with cuda.emulation(False):
        cpu, dev = kernels({"cache_load_factor": 0.2})
        with torch.no_grad():
            for seed in range(3):
                kjt = batch(seed=seed)
                out = dev(kjt.to(torch.device("cuda")))
                assert out.device.type == "cuda"
                close(out.cpu(), cpu(kjt))


def test_weights_that_require_grad_get_a_warning_on_cuda(emulated):
    """A collection on cuda gives per-sample weights no gradient: it says so."""
    _, dev = cpu_and_cuda(configs(), weighted=True)
    x = batch(8, weighted=True)
    x.weights().requires_grad_()
    with pytest.warns(UserWarning, match="weights require grad, but this lookup .* gives them no gradient"):
        dev(x)
