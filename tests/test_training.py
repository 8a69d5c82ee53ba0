"""Training through IBPEmbeddingBagCollection matches FBGEMM's fused TBE training.

The same model (embedding tables + a tiny dense head, BCE loss) is trained for 200
steps on the same data from the same initial weights twice:

(a) FBGEMM's SplitTableBatchedEmbeddingBagsCodegen (what TorchRec's ``fused`` kernel
    runs) on the CPU (HOST placement), fp32, EXACT_SGD / EXACT_ADAGRAD /
    EXACT_ROWWISE_ADAGRAD (with and without weight decay);
(b) IBPEmbeddingBagCollection(optimizer=ibp_embed.optim.SGD / Adagrad / RowWiseAdagrad),
    whose tables stay IBP-compressed the whole time (libibp's fused backward).

The loss curves, the final tables and the optimizer state must be bit-identical.
"""
import json

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")
fbgemm_training = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")

from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode  # noqa: E402
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.modules.embedding_configs import DataType, PoolingType  # noqa: E402

from ibp_embed import _native  # noqa: E402
from ibp_embed.datasets import zipf_ids  # noqa: E402
from ibp_embed.optim import SGD, Adagrad, RowWiseAdagrad  # noqa: E402
from ibp_embed.store import UpdatableTable  # noqa: E402
from ibp_embed.torchrec import IBPEmbeddingBagCollection  # noqa: E402
from helpers import every_isa  # noqa: E402

SplitTBE = fbgemm_training.SplitTableBatchedEmbeddingBagsCodegen
ComputeDevice = fbgemm_training.ComputeDevice
WeightDecayMode = fbgemm_training.WeightDecayMode

STEPS = 200
B = 32
LR = 0.05
EPS = 1e-8
# (name, rows, dim, features): t_shared is read by two features (FBGEMM's generic kernel).
TABLES = [("t0", 500, 16, ["f0"]), ("t1", 2000, 8, ["f1"]), ("t2", 50, 20, ["f2"]),
          ("t_shared", 300, 12, ["f3", "f4"])]
FEATURES = [f for t in TABLES for f in t[3]]


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny batches: intra-op threads only add contention (and the summation order of
    # every kernel involved does not depend on the thread count).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    _native.set_num_threads(1)
    yield
    torch.set_num_threads(n)
    _native.set_num_threads(n)


def initial_tables(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # normal(0, 0.01): most rows share exponent bits, so IBP really compresses them
    return [(torch.randn(n, d, generator=g) * 0.01).to(dtype) for _, n, d, _ in TABLES]


def make_batches(seed, weighted):
    g = torch.Generator().manual_seed(seed)
    rows = {f: n for _, n, _, fs in TABLES for f in fs}
    batches = []
    for step in range(STEPS):
        values, lengths = [], []
        for k, f in enumerate(FEATURES):
            lens = torch.randint(0, 6, (B,), generator=g)
            lengths.append(lens)
            values.append(zipf_ids(int(lens.sum()), rows[f], alpha=1.1, seed=seed * 100003 + step * 31 + k))
        values, lengths = torch.cat(values), torch.cat(lengths)
        weights = torch.rand(values.numel(), generator=g) if weighted else None
        labels = torch.randint(0, 2, (B,), generator=g).float()
        batches.append((values, lengths, weights, labels))
    return batches


def head(total_dim):
    torch.manual_seed(1)
    return torch.nn.Linear(total_dim, 1)


FB_OPT = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ADAGRAD,
          "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}
FB_WD = {"l2": WeightDecayMode.L2, "decouple": WeightDecayMode.DECOUPLE}


def train_fbgemm(opt_name, pooling, weighted, batches, wd=None, dtype=torch.float32):
    """FBGEMM's TBE on the same model. With weight decay every table gets an extra,
    always empty feature: FBGEMM's CPU fast path (tables read by one feature) drops
    weight decay, its generic path for shared tables applies it, and IBP applies it
    to every table the generic path's way."""
    extra = wd is not None
    feature_table_map, real = [], []
    for i, (_, _, _, fs) in enumerate(TABLES):
        for _ in fs:
            real.append(len(feature_table_map))
            feature_table_map.append(i)
        if extra and len(fs) == 1:
            feature_table_map.append(i)
    kw = {} if wd is None else {"weight_decay": wd[0], "weight_decay_mode": FB_WD[wd[1]]}
    tbe = SplitTBE([(n, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for _, n, d, _ in TABLES],
                   feature_table_map=feature_table_map, optimizer=FB_OPT[opt_name], learning_rate=LR, eps=EPS,
                   pooling_mode=PoolingMode.MEAN if pooling == "mean" else PoolingMode.SUM,
                   weights_precision=fbgemm_training.SparseType.FP16 if dtype == torch.float16
                   else fbgemm_training.SparseType.FP32, **kw)
    with torch.no_grad():
        for w, init in zip(tbe.split_embedding_weights(), initial_tables(dtype=dtype)):
            w.copy_(init)
    dims = [TABLES[t][2] for t in feature_table_map]
    cols = torch.cat([torch.arange(sum(dims[:f]), sum(dims[:f + 1])) for f in real])
    dense = head(int(cols.numel()))
    dense_opt = torch.optim.SGD(dense.parameters(), lr=LR)
    losses = []
    for values, lengths, weights, labels in batches:
        if extra:  # empty bags for the extra features
            full = torch.zeros(len(feature_table_map), B, dtype=lengths.dtype)
            full[real] = lengths.view(len(real), B)
            lengths = full.view(-1)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        pooled = tbe(values, offsets, weights)[:, cols].float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(dense(pooled).squeeze(1), labels)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        losses.append(loss.detach())
    tables = [w.detach().clone() for w in tbe.split_embedding_weights()]
    states = None
    if opt_name != "sgd":
        states = [s[0].detach().clone().reshape(n, -1).squeeze(1) if opt_name == "rowwise_adagrad"
                  else s[0].detach().clone().reshape(n, d)
                  for s, (_, n, d, _) in zip(tbe.split_optimizer_states(), TABLES)]
    return torch.stack(losses), tables, states


def train_ibp(optimizer, pooling, weighted, batches, dtype=torch.float32, allow_raw=False):
    """allow_raw=False: the tables (a few hundred rows) are encoded, not stored raw."""
    pool = PoolingType.MEAN if pooling == "mean" else PoolingType.SUM
    data_type = {torch.float32: DataType.FP32, torch.float16: DataType.FP16, torch.bfloat16: DataType.BF16}[dtype]
    configs = [EmbeddingBagConfig(name=name, num_embeddings=n, embedding_dim=d, feature_names=fs, pooling=pool,
                                  data_type=data_type) for name, n, d, fs in TABLES]
    ebc = IBPEmbeddingBagCollection(configs, is_weighted=weighted, device="meta", optimizer=optimizer,
                                    allow_raw=allow_raw)
    ebc.load_state_dict({f"embedding_bags.{name}.weight": w
                         for (name, *_), w in zip(TABLES, initial_tables(dtype=dtype))}, strict=False)
    total_dim = sum(d for _, _, d, fs in TABLES for _ in fs)
    dense = head(total_dim)
    dense_opt = torch.optim.SGD(dense.parameters(), lr=LR)
    losses = []
    for values, lengths, weights, labels in batches:
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=lengths, weights=weights)
        pooled = ebc(kjt).values()
        assert pooled.requires_grad
        loss = torch.nn.functional.binary_cross_entropy_with_logits(dense(pooled).squeeze(1), labels)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        losses.append(loss.detach())
    for bag in ebc.embedding_bags.values():
        assert isinstance(bag.table, UpdatableTable)  # stayed compressed throughout
    tables = [ebc.embedding_bags[name].weight for name, *_ in TABLES]
    states = None
    if not isinstance(optimizer, SGD):
        states = [ebc.embedding_bags[name].optimizer_state["momentum1"].clone() for name, *_ in TABLES]
    return torch.stack(losses), tables, states, ebc


CASES = [
    ("sgd", "sum", False, None),
    ("sgd", "mean", False, None),
    ("adagrad", "sum", False, None),
    ("adagrad", "mean", False, None),
    ("adagrad", "sum", True, None),
    ("rowwise_adagrad", "sum", False, None),
    ("rowwise_adagrad", "sum", True, None),
    ("rowwise_adagrad", "mean", False, None),
    ("rowwise_adagrad", "sum", False, (0.02, "l2")),
    ("rowwise_adagrad", "sum", True, (0.02, "decouple")),
]


def ibp_optimizer(name, wd):
    if name == "sgd":
        return SGD(LR)
    if name == "adagrad":
        return Adagrad(LR, eps=EPS)
    kw = {} if wd is None else {"weight_decay": wd[0], "weight_decay_mode": wd[1]}
    return RowWiseAdagrad(LR, eps=EPS, **kw)


@pytest.mark.parametrize("opt_name,pooling,weighted,wd,allow_raw", [(*c, False) for c in CASES] + [(*CASES[-1], True)])
def test_200_steps_match_fbgemm_bit_exact(opt_name, pooling, weighted, wd, allow_raw):
    batches = make_batches(seed=7, weighted=weighted)
    fb_losses, fb_tables, fb_states = train_fbgemm(opt_name, pooling, weighted, batches, wd)
    ibp_losses, ibp_tables, ibp_states, ebc = train_ibp(ibp_optimizer(opt_name, wd), pooling, weighted, batches,
                                                        allow_raw=allow_raw)
    # by default the smallest tables are stored raw, next to encoded ones
    assert [b.table.clusters == 0 for b in ebc.embedding_bags.values()] == [allow_raw and n * d <= 1000
                                                                            for _, n, d, _ in TABLES]

    # the model did train (rows moved), and in the same way
    assert not torch.equal(fb_tables[0], initial_tables()[0])
    assert torch.equal(ibp_losses, fb_losses), \
        f"loss curves differ first at step {int(torch.nonzero(ibp_losses != fb_losses)[0])}"
    for (name, *_), a, b in zip(TABLES, ibp_tables, fb_tables):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"table {name} differs"
    if fb_states is not None:
        for (name, *_), a, b in zip(TABLES, ibp_states, fb_states):
            assert torch.equal(a, b), f"momentum1 of {name} differs"

    stats = ebc.memory_stats()
    expected_state = sum(s.numel() * 4 for s in ibp_states) if ibp_states is not None else 0
    assert stats["optimizer_state_bytes"] == expected_state
    assert stats["raw_bytes"] == sum(n * d * 4 for _, n, d, _ in TABLES)
    assert stats["total_bytes"] == stats["compressed_bytes"] + expected_state
    assert 0 < stats["live_bytes"] <= stats["compressed_bytes"]


def test_fp16_rowwise_adagrad_matches_fbgemm_bit_exact():
    """FP16 tables: rows updated in fp32, rounded to nearest even; FBGEMM's CPU row-wise
    Adagrad does the same (its SGD and Adagrad round FP16 updates stochastically)."""
    batches = make_batches(seed=9, weighted=True)
    fb_losses, fb_tables, fb_states = train_fbgemm("rowwise_adagrad", "sum", True, batches, dtype=torch.float16)
    ibp_losses, ibp_tables, ibp_states, _ = train_ibp(ibp_optimizer("rowwise_adagrad", None), "sum", True, batches,
                                                      dtype=torch.float16)
    assert not torch.equal(fb_tables[1], initial_tables(dtype=torch.float16)[1])
    assert torch.equal(ibp_losses, fb_losses)
    for a, b in zip(ibp_tables, fb_tables):
        assert a.dtype == torch.float16 and torch.equal(a.view(torch.int16), b.view(torch.int16))
    for a, b in zip(ibp_states, fb_states):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_updates_round_to_nearest_on_every_isa(dtype):
    """One SGD step on rows with extreme values (subnormals, near the largest finite value,
    signed zeros): the result is the fp32 update rounded to nearest even, on every ISA."""
    import ibp_embed

    g = torch.Generator().manual_seed(4)
    n, d = 64, 16
    base = torch.randn(n, d, generator=g) * 1e-3
    base[0, :4] = torch.tensor([6e-8, -6e-8, 0.0, -0.0])          # fp16 subnormals, zeros
    base[1, :4] = torch.tensor([65000.0, -65000.0, 3e38, 1e-40])   # near and past fp16's range
    w = base.to(dtype)
    grad = torch.randn(n, d, generator=g)
    grad[1, :2] = torch.tensor([-1e6, 1e6])                        # overflow fp16 to +-inf
    lr = 0.125
    expected = (w.float().double() - lr * grad.double()).float().to(dtype)  # torch rounds to nearest even
    for isa in every_isa():
        t = UpdatableTable(ibp_embed.compress(w, allow_raw=False), repack_drift=None)
        ids = np.arange(n, dtype=np.int64)
        t.apply_gradients(SGD(lr), {}, ids, np.arange(n + 1, dtype=np.int64), n, grad, [0])
        got = t.decompress()
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), isa


def test_weighted_mean_gradient_is_w_over_l():
    """A weighted MEAN bag pools sum(w x) / L; its rows get w / L of the bag's gradient
    (FBGEMM's CPU backward drops the 1/L there; see ibp_embed.optim)."""
    configs = [EmbeddingBagConfig(name="t", num_embeddings=20, embedding_dim=4, feature_names=["f"],
                                  pooling=PoolingType.MEAN)]
    ebc = IBPEmbeddingBagCollection(configs, is_weighted=True, optimizer=SGD(1.0))
    before = ebc.embedding_bags["t"].weight
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([3, 5, 3, 7]),
                                              lengths=torch.tensor([3, 1]),
                                              weights=torch.tensor([0.5, 2.0, 0.25, 4.0]))
    out = ebc(kjt).values()
    expected = torch.stack([(0.5 * before[3] + 2.0 * before[5] + 0.25 * before[3]) / 3, 4.0 * before[7]])
    torch.testing.assert_close(out, expected)
    g = torch.tensor([[1.0, 2.0, 3.0, 4.0], [-1.0, 0.5, 0.0, 2.0]])
    out.backward(g)
    after = ebc.embedding_bags["t"].weight
    torch.testing.assert_close(after[3], before[3] - 0.75 / 3 * g[0])
    torch.testing.assert_close(after[5], before[5] - 2.0 / 3 * g[0])
    torch.testing.assert_close(after[7], before[7] - 4.0 * g[1])


def test_no_dense_gradient_and_inference_path_unchanged():
    configs = [EmbeddingBagConfig(name="t", num_embeddings=100, embedding_dim=8, feature_names=["f"])]
    torch.manual_seed(0)
    ebc = IBPEmbeddingBagCollection(configs, optimizer=SGD(0.1))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([1, 2, 2, 5]),
                                              lengths=torch.tensor([3, 1]))
    before = ebc.embedding_bags["t"].weight
    with torch.no_grad():  # no grad mode: a plain lookup, nothing to update
        out = ebc(kjt).values()
    assert not out.requires_grad
    assert list(ebc.parameters()) == []  # no dense table parameter, no dense gradient
    out = ebc(kjt).values()
    out.sum().backward()
    after = ebc.embedding_bags["t"].weight
    changed = torch.nonzero((after != before).any(1)).flatten().tolist()
    assert changed == [1, 2, 5]
    # row 2 occurs twice in bag 0: gradient 2, SGD step -0.1 * 2
    torch.testing.assert_close(after[2], before[2] - 0.2, rtol=0, atol=1e-7)


def test_update_that_compacts_replans_rows_written_in_place():
    """An update that compacts the arena must re-plan which blocks still fit their
    (trimmed) capacity before writing any in place."""
    import ibp_embed

    g = torch.Generator().manual_seed(3)
    n = 2000
    base = torch.randn(n, 16, generator=g) * 0.01
    t = UpdatableTable(ibp_embed.compress(base, word_bits=32), repack_drift=None)
    m = t._book.masks[0].astype(np.uint32)
    words = np.ascontiguousarray(base.numpy()).view(np.uint32)
    broken_words = np.flatnonzero(m)
    assert broken_words.size >= 8

    def broken(k):  # rows whose first k maskable words do not participate: longer rows
        w = words.copy()
        for j in broken_words[:k]:
            w[:, j] ^= m[j] & (~m[j] + np.uint32(1))  # flip the lowest invariant bit
        return torch.from_numpy(w.view(np.float32))

    ref = base.clone()

    def upd(ids, rows):  # rows: all n rows; rows `ids` of them are written
        t.update(ids, rows[ids])
        ref[ids] = rows[ids]

    a, c = torch.arange(0, 1200), torch.arange(1200, n)
    for k in (2, 4, 6, 8):  # A's rows grow and move four times: the arena fills with dead slots
        upd(a, broken(k))
    upd(a, base)  # back to short rows in blocks with room to spare
    # C grows past its slots (forcing compaction) while A gets rows that fit A's slots
    # before compaction but not after it
    rows = torch.cat([broken(4)[a], torch.rand(n - 1200, 16, generator=g) * 1e4 - 5e3])
    t.update(torch.cat([a, c]), rows)
    ref[:] = rows
    assert t.info()["compactions"] > 0
    assert torch.equal(t.decompress().view(torch.int32), ref.view(torch.int32))


def _tiny(optimizer=None, **kw):
    configs = [EmbeddingBagConfig(name="a", num_embeddings=64, embedding_dim=8, feature_names=["fa"]),
               EmbeddingBagConfig(name="b", num_embeddings=32, embedding_dim=4, feature_names=["fb", "fc"])]
    torch.manual_seed(0)
    kw.setdefault("allow_raw", False)  # encoded, though masks outweigh these few rows
    return IBPEmbeddingBagCollection(configs, optimizer=optimizer, **kw)


def _kjt(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (3 * 5,), generator=g)
    values = torch.cat([torch.randint(0, 32, (int(lengths[i * 5:(i + 1) * 5].sum()),), generator=g)
                        for i in range(3)])
    return KeyedJaggedTensor.from_lengths_sync(keys=["fa", "fb", "fc"], values=values, lengths=lengths)


def _train(ebc, steps=5, start=0):
    for s in range(start, start + steps):
        ebc(_kjt(s)).values().pow(2).sum().backward()


def test_optimizer_state_in_state_dict_and_compressed_checkpoints(tmp_path):
    ebc = _tiny(RowWiseAdagrad(0.1))
    _train(ebc)
    sd = ebc.state_dict()
    assert set(sd) == {"embedding_bags.a.weight", "embedding_bags.a.momentum1",
                       "embedding_bags.b.weight", "embedding_bags.b.momentum1"}
    assert sd["embedding_bags.a.momentum1"].shape == (64,) and sd["embedding_bags.a.momentum1"].any()
    # state_dict round trip into a fresh trainable module continues identically
    other = _tiny(RowWiseAdagrad(0.1))
    other.load_state_dict(sd)
    # save_compressed / load_compressed keep tables and optimizer state
    ebc.save_compressed(tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["optimizer"] == {"name": "rowwise_adagrad", "params": {"lr": 0.1, "eps": 1e-8}}
    loaded = IBPEmbeddingBagCollection.load_compressed(tmp_path / "ck", optimizer="saved")
    assert loaded.optimizer == RowWiseAdagrad(0.1)
    for m in (other, loaded):
        for name, bag in ebc.embedding_bags.items():
            assert torch.equal(m.embedding_bags[name].weight, bag.weight)
            assert torch.equal(m.embedding_bags[name].optimizer_state["momentum1"], bag.optimizer_state["momentum1"])
    for m in (ebc, other, loaded):
        _train(m, 3, start=5)
    for m in (other, loaded):
        for name, bag in ebc.embedding_bags.items():
            assert torch.equal(m.embedding_bags[name].weight, bag.weight)
    # an inference load of the same checkpoint ignores the state; another optimizer kind is refused
    inf = IBPEmbeddingBagCollection.load_compressed(tmp_path / "ck")
    assert not inf.trainable and inf.memory_stats()["optimizer_state_bytes"] == 0
    with pytest.raises(ValueError, match="rowwise_adagrad"):
        IBPEmbeddingBagCollection.load_compressed(tmp_path / "ck", optimizer=SGD(0.1))
    # a plain TorchRec EBC round trip drops the optimizer state
    plain = loaded.to_embedding_bag_collection()
    assert set(plain.state_dict()) == {"embedding_bags.a.weight", "embedding_bags.b.weight"}
    fresh = IBPEmbeddingBagCollection.from_embedding_bag_collection(plain, optimizer=SGD(0.5))
    assert fresh.trainable and fresh.memory_stats()["optimizer_state_bytes"] == 0
    assert torch.equal(fresh.embedding_bags["a"].weight, loaded.embedding_bags["a"].weight)


def test_memory_figures_and_trainable_checks():
    ebc = _tiny(RowWiseAdagrad(0.1))
    _train(ebc)
    s = ebc.memory_stats()
    assert s["raw_bytes"] == 64 * 8 * 4 + 32 * 4 * 4
    assert s["optimizer_state_bytes"] == (64 + 32) * 4 == ebc.optimizer_state_nbytes
    assert s["compressed_bytes"] == ebc.compressed_nbytes
    assert s["total_bytes"] == s["compressed_bytes"] + s["optimizer_state_bytes"]
    assert s["index_bytes"] == (64 + 1) * 2 + 2 * 16 + (32 + 1) * 2 + 2 * 16  # 2 B a row, 16 a block
    arena = s["live_bytes"] + s["slack_bytes"] + s["dead_bytes"] + s["free_bytes"]
    assert s["compressed_bytes"] > arena + s["index_bytes"]
    expected = ebc.embedding_bags["a"].table.packed_nbytes
    assert ebc.embedding_bags["a"].table.to_table().nbytes == expected
    inference = _tiny()
    assert inference.memory_stats()["optimizer_state_bytes"] == 0 and not inference.trainable
    out = inference(_kjt(0)).values()
    assert not out.requires_grad  # the inference path is unchanged
    with pytest.raises(TypeError, match="SparseOptimizer"):
        _tiny(torch.optim.SGD)
    out = ebc(_kjt(1)).values().sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.backward()


