"""IBPEmbeddingBagCollection as a drop-in for TorchRec's EBC: the torch.ops.ibp operators,
fx / compile / export / script on a DLRM, copies, pickling, the meta device, .weight."""
import copy
import pickle
import warnings

import pytest
import torch

pytest.importorskip("torchrec")

import torchrec.fx  # noqa: E402
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.modules.embedding_configs import DataType, PoolingType  # noqa: E402

import ibp_embed  # noqa: E402
from ibp_embed import ops  # noqa: E402
from ibp_embed.optim import RowWiseAdagrad  # noqa: E402
from ibp_embed.torchrec import IBPEmbeddingBagCollection  # noqa: E402


def tables():
    return [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=300, feature_names=["f0", "f1"]),
            EmbeddingBagConfig(name="t1", embedding_dim=16, num_embeddings=120, feature_names=["f2"],
                               pooling=PoolingType.MEAN),
            EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=50, feature_names=["f3"],
                               data_type=DataType.FP16)]


def kjt(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (4 * 3,), generator=g)
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2", "f3"], values=values, lengths=lengths)


@pytest.fixture
def pair():
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables())
    return ebc, IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc)


def same(a, b):
    assert a.keys() == b.keys() and torch.equal(a.values(), b.values())


def dlrm(ebc):
    torch.manual_seed(1)
    return DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[8, 8],
                over_arch_layer_sizes=[8, 1])


# ---- the operators ----

def test_operators_match_the_table_and_pass_opcheck():
    t = ibp_embed.compress(torch.randn(500, 12) * 0.01, clusters=3)
    tt = ops.table_tensors(t)
    args = [tt[k] for k in ops.TABLE_TENSORS] + [tt["meta"], torch.float32]
    ids = torch.tensor([3, 499, 3, 0, 7, 7, 7])
    off = torch.tensor([0, 2, 2, 7])
    w = torch.rand(7)
    for mode, name in ((0, "sum"), (1, "mean")):
        out = torch.ops.ibp.pooled_lookup(*args, ids, off, w, mode, "t")
        assert torch.equal(out, t.lookup(ids, off, w, mode=name))
    assert torch.equal(torch.ops.ibp.gather(*args, ids.view(7, 1), "t"), t.gather(ids.view(7, 1)))
    torch.library.opcheck(torch.ops.ibp.pooled_lookup.default, (*args, ids, off, w, 0, "t"))
    torch.library.opcheck(torch.ops.ibp.gather.default, (*args, ids.view(7, 1), "t"))
    with pytest.raises(IndexError, match="t: id 500 out of range for a table of 500 rows"):
        torch.ops.ibp.pooled_lookup(*args, torch.tensor([500]), torch.tensor([0, 1]), None, 0, "t")
    with pytest.raises(ValueError, match="offsets"):
        torch.ops.ibp.pooled_lookup(*args, ids, torch.tensor([0, 5, 2, 7]), None, 0, "t")
    with pytest.raises(ValueError, match="do not fit"):
        torch.ops.ibp.pooled_lookup(*args[:4], tt["payload"][:10], tt["meta"], torch.float32, ids, off, None, 0, "t")
    # round trip of the tensors back into a (validated) table
    again = ops.table_from_tensors(tt, tt["meta"], torch.float32)
    assert torch.equal(again.decompress(), t.decompress())


def test_operators_refuse_offsets_that_do_not_end_at_the_ids_and_non_integer_ids():
    """libibp's ibp_lookup takes the ids' count from the last offset, so the operator (the
    collection's forward, traced or not) checks that the offsets end at len(ids): ending
    past them pooled memory after the ids (a view's hidden rows, or a crash), short of
    them left ids out. Bool ids (a mask passed for ids) and complex or bool weights are
    refused as CompressedTable.lookup refuses them."""
    t = ibp_embed.compress(torch.randn(100, 8), allow_raw=False)
    tt = ops.table_tensors(t)
    args = [tt[k] for k in ops.TABLE_TENSORS] + [tt["meta"], torch.float32]
    base = torch.tensor([1, 2, 3, 4])
    for ids, off in ((base[:2], [0, 4]), (torch.tensor([1, 2, 3]), [0, 1]), (torch.tensor([1, 2, 3]), [0]),
                     (torch.zeros(1 << 20, dtype=torch.int64), [0, 1 << 21]), (torch.tensor([1, 2]), [1, 2])):
        with pytest.raises(ValueError, match=rf"t: offsets must start at 0 and end at len\(ids\) = {len(ids)},"):
            torch.ops.ibp.pooled_lookup(*args, ids, torch.tensor(off), None, 0, "t")
    with pytest.raises(TypeError, match="ids must be integers, got torch.bool"):
        torch.ops.ibp.pooled_lookup(*args, torch.tensor([True, False]), torch.tensor([0, 2]), None, 0, "t")
    with pytest.raises(TypeError, match="ids must be integers, got torch.bool"):
        torch.ops.ibp.gather(*args, torch.tensor([True, False]), "t")
    with pytest.raises(TypeError, match="offsets must be integers"):
        torch.ops.ibp.pooled_lookup(*args, base, torch.tensor([0.0, 4.0]), None, 0, "t")
    for w in (torch.ones(4, dtype=torch.complex64), torch.ones(4, dtype=torch.bool)):
        with pytest.raises(TypeError, match="per_sample_weights must be real numbers"):
            torch.ops.ibp.pooled_lookup(*args, base, torch.tensor([0, 4]), w, 0, "t")
    with pytest.raises(ValueError, match=r"per_sample_weights of shape \(1, 4\) for ids of shape \(4,\)"):
        torch.ops.ibp.pooled_lookup(*args, base, torch.tensor([0, 4]), torch.ones(1, 4), 0, "t")


# ---- graph capture ----

def test_fx_compile_export_and_script_on_a_dlrm():
    torch.manual_seed(0)
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=100 * (i + 1),
                                  feature_names=[f"f{i}"], pooling=PoolingType.MEAN if i == 2 else PoolingType.SUM)
               for i in range(4)]
    ibp = IBPEmbeddingBagCollection.from_embedding_bag_collection(EmbeddingBagCollection(configs))
    model = dlrm(ibp)
    dense, features = torch.randn(3, 4), kjt()
    ref = model(dense, features)
    gm = torchrec.fx.symbolic_trace(model)
    assert "ibp.pooled_lookup" in str(gm.graph)
    assert torch.equal(gm(dense, features), ref)
    assert torch.equal(torch.jit.script(model)(dense, features), ref)
    ep = torch.export.export(model, (dense, features), strict=False)
    assert torch.equal(ep.module()(dense, features), ref)
    # compile: the embedding output exactly, the dense arch up to its own reassociation
    same(torch.compile(ibp, fullgraph=True)(features), ibp(features))
    torch.testing.assert_close(torch.compile(model, fullgraph=True)(dense, features), ref)


# ---- EBC behaviour ----

def test_weight_parameters_buffers_and_state_dict(pair):
    ebc, ibp = pair
    for name, bag in ibp.embedding_bags.items():
        w = bag.weight
        assert isinstance(w, torch.Tensor) and torch.equal(w, ebc.embedding_bags[name].weight.detach())
        assert bag.weight is not w  # a decoded copy on every access
    assert list(ibp.parameters()) == []
    buffers = dict(ibp.named_buffers())
    assert {k.rsplit(".", 1)[1] for k in buffers} == set(ops.TABLE_TENSORS)  # the compressed tables
    assert sum(b.numel() * b.element_size() for b in buffers.values()) < ibp.raw_nbytes
    assert set(ibp.state_dict()) == set(ebc.state_dict())  # TorchRec's keys: the decoded weights


def test_deepcopy_and_pickle_copy_compressed_bytes(pair):
    _, ibp = pair
    features = kjt(3)
    for other in (copy.deepcopy(ibp), pickle.loads(pickle.dumps(ibp))):
        same(other(features), ibp(features))
        assert other.embedding_bags["t0"].table is not ibp.embedding_bags["t0"].table
    torch.manual_seed(0)
    big = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=32, num_embeddings=5000,
                                                     feature_names=["f"])])
    assert len(pickle.dumps(IBPEmbeddingBagCollection.from_embedding_bag_collection(big))) < \
        len(pickle.dumps(big))  # compressed bytes, not decoded tables
    trainable = IBPEmbeddingBagCollection(tables()[:2], optimizer=RowWiseAdagrad(0.1))  # fp32 tables
    trainable(features).values().sum().backward()
    twin = pickle.loads(pickle.dumps(trainable))
    assert twin.trainable and torch.equal(twin.embedding_bags["t0"].optimizer_state["momentum1"],
                                          trainable.embedding_bags["t0"].optimizer_state["momentum1"])
    for m in (trainable, twin):  # the copies train on independently, identically
        m(kjt(4)).values().sum().backward()
    assert torch.equal(twin.embedding_bags["t0"].weight, trainable.embedding_bags["t0"].weight)


def test_meta_construction_to_empty_and_load(pair):
    ebc, _ = pair
    with torch.device("meta"):
        m = IBPEmbeddingBagCollection(tables())
    assert m.device.type == "meta" and m.embedding_bags["t0"].table is None
    assert m(KeyedJaggedTensor(keys=["f0", "f1", "f2", "f3"], values=torch.tensor([1], device="meta"),
                               lengths=torch.tensor([1, 0, 0, 0], device="meta"), stride=1)).values().shape == (1, 40)
    m.to_empty(device="cpu")
    with pytest.raises(RuntimeError, match="load weights"):
        m(kjt())
    m.load_state_dict(ebc.state_dict())
    features = kjt(5)
    same(m(features), IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc)(features))
    m.to("meta")
    assert m.embedding_bags["t1"].table is None


# ---- graph capture: the collection as one operator ----

def weighted_pair():
    torch.manual_seed(2)
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8 * (i + 1), num_embeddings=60 * (i + 1),
                                  feature_names=[f"f{i}"] + (["shared"] if i == 1 else []))
               for i in range(3)]
    ebc = EmbeddingBagCollection(configs, is_weighted=True)
    return ebc, IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc)


def weighted_kjt(keys, seed, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (len(keys) * 3,), generator=g)
    values = torch.randint(0, 60, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.shape, generator=g).requires_grad_(requires_grad)
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths, weights=weights)


def test_captured_collections_run_one_operator_that_follows_the_input_keys():
    """fx, TorchScript, export and compile see the whole collection as one
    ibp.pooled_lookup_many (TorchRec runs one TBE op): the same output as eager, for
    any order of the input's keys (a feature read by two tables, keys no table reads),
    and the eager errors for a missing feature or an id out of range."""
    _, ibp = weighted_pair()
    gm = torchrec.fx.symbolic_trace(ibp)
    assert [n.target for n in gm.graph.nodes].count(torch.ops.ibp.pooled_lookup_many) == 1
    script = torch.jit.script(ibp)
    features = weighted_kjt(["f0", "f1", "shared", "f2"], 0)
    ep = torch.export.export(ibp, (features,), strict=False)
    compiled = torch.compile(ibp, fullgraph=True)
    for keys in (["f0", "f1", "shared", "f2"], ["f2", "extra", "shared", "f1", "f0"],
                 ["f0", "f1", "shared", "f2", "f0"]):  # a repeated key: its last copy, as eager
        x = weighted_kjt(keys, 1)
        want = ibp(x)
        for m in (gm, script, compiled):
            same(m(x), want)
    same(ep.module()(features), ibp(features))
    missing = weighted_kjt(["f0", "f1", "f2"], 2)
    for m in (gm, script):
        with pytest.raises(Exception, match="input lacks feature 'shared'"):
            m(missing)
    bad = weighted_kjt(["f0", "f1", "shared", "f2"], 3)
    bad = KeyedJaggedTensor(keys=bad.keys(), values=torch.full_like(bad.values(), 119), lengths=bad.lengths(),
                            weights=bad.weights())
    with pytest.raises(IndexError, match="feature 'f0' of table 't0'.*119 out of range"):
        gm(bad)


def test_per_sample_weights_get_their_gradient_as_in_torchrec():
    """Learned per-id weights (a position-weighted feature processor) get the gradient
    TorchRec's EBC gives them, eager and traced; the tables themselves stay frozen."""
    ebc, ibp = weighted_pair()
    gm = torchrec.fx.symbolic_trace(ibp)
    keys = ["f0", "f1", "shared", "f2"]
    x = weighted_kjt(keys, 4, requires_grad=True)
    g = torch.randn(3, sum(8 * (i + 1) for i in (0, 1, 1, 2)))
    ebc(x).values().backward(g)
    want = x.weights().grad.clone()
    for m in (ibp, gm):
        x.weights().grad = None
        out = m(x).values()
        assert out.requires_grad
        out.backward(g)
        torch.testing.assert_close(x.weights().grad, want, rtol=1e-5, atol=1e-6)


def test_weights_that_lose_their_gradient_say_so():
    """Paths that give per-sample weights no gradient (trainable tables, the sharded
    kernel, tables on cuda) warn instead of dropping it silently."""
    ebc, _ = weighted_pair()
    trainable = IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc, optimizer=RowWiseAdagrad(0.1))
    x = weighted_kjt(["f0", "f1", "shared", "f2"], 5, requires_grad=True)
    with pytest.warns(UserWarning, match="weights require grad, but this lookup .* gives them no gradient"):
        trainable(x)
    with torch.no_grad(), warnings.catch_warnings():  # no gradient asked for: no warning
        warnings.filterwarnings("error", message=".*gives them no gradient")
        trainable(x)


def test_a_collection_pickled_before_the_one_operator_still_captures(pair):
    """Collections pickled by earlier versions lack the slot lists the captured forward
    passes: unpickling makes them."""
    _, ibp = pair
    for missing in (("_slot_features", "_distinct_slot_features", "_slot_what"), ("_distinct_slot_features",)):
        old = IBPEmbeddingBagCollection.__new__(IBPEmbeddingBagCollection)
        old.__setstate__({k: v for k, v in ibp.__dict__.items() if k not in missing})
        same(torch.jit.script(old)(kjt(6)), ibp(kjt(6)))
