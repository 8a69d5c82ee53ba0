"""IBPEmbeddingBagCollection against torchrec.EmbeddingBagCollection holding the same weights."""
import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")

from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.modules.embedding_configs import DataType, PoolingType  # noqa: E402

from ibp_embed import CompressedTable  # noqa: E402
from ibp_embed.torchrec import FeatureKeyError, IBPEmbeddingBagCollection  # noqa: E402

SUM, MEAN = PoolingType.SUM, PoolingType.MEAN


def make_tables(pooling_mix=True):
    """Many features, two tables shared by several features, one feature read by two tables."""
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=300, feature_names=["f0", "f1", "f2"],
                           pooling=SUM),
        EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=50, feature_names=["f3"],
                           pooling=MEAN if pooling_mix else SUM),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=1000, feature_names=["f4", "f5"],
                           pooling=SUM),
        EmbeddingBagConfig(name="t3", embedding_dim=12, num_embeddings=7, feature_names=["f6", "f0"],
                           pooling=MEAN if pooling_mix else SUM),
        EmbeddingBagConfig(name="t4", embedding_dim=3, num_embeddings=2000, feature_names=["f7"], pooling=SUM),
    ]


def feature_rows(tables):
    rows = {}
    for t in tables:
        for f in t.feature_names:
            rows[f] = min(rows.get(f, t.num_embeddings), t.num_embeddings)
    return rows


def random_kjt(tables, batch, rng, weighted=False, max_len=6, keys=None):
    """Random bags: empty bags, duplicate ids within a bag, skewed ids."""
    rows = feature_rows(tables)
    keys = keys or list(rows)
    values, lengths = [], []
    for k in keys:
        for _ in range(batch):
            n = int(rng.integers(0, max_len + 1)) if rng.random() > 0.2 else 0
            ids = rng.zipf(1.3, n) % rows[k]
            if n > 1 and rng.random() < 0.5:
                ids[-1] = ids[0]  # duplicate id in one bag
            values.extend(int(i) for i in ids)
            lengths.append(n)
    v = torch.tensor(values, dtype=torch.int64)
    w = torch.from_numpy(rng.uniform(-2, 2, len(values)).astype(np.float32)) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=v, lengths=torch.tensor(lengths, dtype=torch.int64),
                                               weights=w)


def reference(tables, ebc, kjt, weighted):
    """fp64 pooled lookups (weighted MEAN = weighted sum / bag length, FBGEMM's semantics)."""
    d = kjt.to_dict()
    outs = []
    for t in tables:
        w = ebc.embedding_bags[t.name].weight.detach().double()
        for f in t.feature_names:
            jt = d[f]
            off = jt.offsets().tolist()
            vals = jt.values()
            ws = jt.weights().double() if weighted else None
            out = torch.zeros(len(off) - 1, t.embedding_dim, dtype=torch.float64)
            for b in range(len(off) - 1):
                lo, hi = off[b], off[b + 1]
                rows = w[vals[lo:hi]]
                if ws is not None:
                    rows = rows * ws[lo:hi, None]
                out[b] = rows.sum(0)
                if t.pooling == MEAN and hi > lo:
                    out[b] /= hi - lo
            outs.append(out)
    return torch.cat(outs, dim=1)


def assert_same_layout(kt, ref):
    assert kt.keys() == ref.keys()
    assert kt.length_per_key() == ref.length_per_key()
    assert kt.offset_per_key() == ref.offset_per_key()
    assert kt.values().shape == ref.values().shape
    assert kt.values().dtype == torch.float32




@pytest.mark.parametrize("seed", range(3))
def test_forward_matches_ebc_unweighted(seed):
    torch.manual_seed(seed)
    tables = make_tables()
    ebc = EmbeddingBagCollection(tables)
    ibp = IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc)
    rng = np.random.default_rng(seed)
    for batch in (1, 7, 33, 400):
        kjt = random_kjt(tables, batch, rng)
        ref, out = ebc(kjt), ibp(kjt)
        assert_same_layout(out, ref)
        off = ref.offset_per_key()
        for key, lo, hi in zip(ref.keys(), off[:-1], off[1:]):
            r, o = ref.values()[:, lo:hi], out.values()[:, lo:hi]
            table = next(t for t in tables if key.split("@")[0] in t.feature_names
                         and ("@" not in key or key.endswith("@" + t.name)))
            if table.pooling == SUM:
                assert torch.equal(o, r), key  # same summation order: bit-exact
            else:
                torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-9)


def test_forward_all_sum_is_bit_exact_and_key_order_free():
    torch.manual_seed(0)
    tables = make_tables(pooling_mix=False)
    ebc = EmbeddingBagCollection(tables)
    ibp = IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc)
    rng = np.random.default_rng(1)
    keys = list(feature_rows(tables))[::-1]  # input keys in another order than the tables read them
    kjt = random_kjt(tables, 20, rng, keys=keys)
    ref, out = ebc(kjt), ibp(kjt)
    assert_same_layout(out, ref)
    assert torch.equal(out.values(), ref.values())


@pytest.mark.parametrize("seed", range(2))
def test_forward_weighted_sum_matches_ebc(seed):
    torch.manual_seed(seed)
    tables = make_tables(pooling_mix=False)  # nn.EmbeddingBag takes per-sample weights with SUM only
    ebc = EmbeddingBagCollection(tables, is_weighted=True)
    ibp = IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc)
    assert ibp.is_weighted()
    kjt = random_kjt(tables, 16, np.random.default_rng(seed), weighted=True)
    ref, out = ebc(kjt), ibp(kjt)
    assert_same_layout(out, ref)
    torch.testing.assert_close(out.values(), ref.values(), rtol=1e-6, atol=1e-6)


def test_forward_weighted_mean_matches_reference():
    torch.manual_seed(3)
    tables = make_tables(pooling_mix=True)
    ebc = EmbeddingBagCollection(tables, is_weighted=True)  # holds the weights; cannot run weighted MEAN
    ibp = IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc)
    kjt = random_kjt(tables, 16, np.random.default_rng(3), weighted=True)
    out = ibp(kjt).values()
    ref = reference(tables, ebc, kjt, weighted=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_fp16_tables():
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="h", embedding_dim=8, num_embeddings=100, feature_names=["a"],
                                 data_type=DataType.FP16)]
    ebc = EmbeddingBagCollection(tables)
    assert ebc.embedding_bags["h"].weight.dtype == torch.float16
    ibp = IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc)
    assert ibp.tables()["h"].dtype == torch.float16
    kjt = random_kjt(tables, 100, np.random.default_rng(0))
    ref = reference(tables, ebc, kjt, weighted=False)
    torch.testing.assert_close(ibp(kjt).values().double(), ref, rtol=1e-6, atol=1e-7)  # fp32 accumulation
    sd = ibp.state_dict()
    assert sd["embedding_bags.h.weight"].dtype == torch.float16
    assert torch.equal(sd["embedding_bags.h.weight"], ebc.embedding_bags["h"].weight.detach())


def test_empty_batch_and_all_empty_bags():
    torch.manual_seed(0)
    tables = make_tables()
    ebc = EmbeddingBagCollection(tables)
    ibp = IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc)
    keys = list(feature_rows(tables))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.empty(0, dtype=torch.int64),
                                              lengths=torch.zeros(len(keys) * 3, dtype=torch.int64))
    out = ibp(kjt)
    assert torch.equal(out.values(), torch.zeros(3, sum(out.length_per_key())))
    assert torch.equal(out.values(), ebc(kjt).values())


def test_int32_ids():
    torch.manual_seed(0)
    tables = make_tables()
    ebc = EmbeddingBagCollection(tables)
    ibp = IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc)
    kjt = random_kjt(tables, 5, np.random.default_rng(0))
    kjt32 = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=kjt.values().int(),
                                                lengths=kjt.lengths().int())
    assert torch.equal(ibp(kjt32).values(), ibp(kjt).values())


def test_forward_never_decompresses_whole_table(monkeypatch):
    torch.manual_seed(0)
    tables = make_tables()
    ibp = IBPEmbeddingBagCollection(tables)

    def boom(self):
        raise AssertionError("forward decompressed a whole table")

    monkeypatch.setattr(CompressedTable, "decompress", boom)
    ibp(random_kjt(tables, 300, np.random.default_rng(0)))


def test_init_from_configs_follows_torchrec_init():
    torch.manual_seed(0)
    tables = make_tables()
    ibp = IBPEmbeddingBagCollection(tables)
    assert ibp.device == torch.device("cpu")
    sd = ibp.state_dict()
    for t in tables:
        w = sd[f"embedding_bags.{t.name}.weight"]
        assert w.shape == (t.num_embeddings, t.embedding_dim) and w.dtype == torch.float32
        bound = math.sqrt(1 / t.num_embeddings)
        assert w.min() >= -bound and w.max() <= bound and w.std() > bound / 4
    custom = [EmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=10, feature_names=["x"],
                                 init_fn=lambda w: torch.nn.init.constant_(w, 0.25))]
    m = IBPEmbeddingBagCollection(custom)
    assert torch.equal(m.state_dict()["embedding_bags.c.weight"], torch.full((10, 4), 0.25))
    assert m.embedding_bag_configs() is custom


def test_dedup_is_deprecated_and_ignored():
    """dedup (of earlier versions) warns and changes nothing: libibp deduplicates a
    batch's ids by itself."""
    from ibp_embed.torchrec import IBPEmbeddingBagCollectionSharder

    torch.manual_seed(0)
    tables = make_tables()
    ebc = EmbeddingBagCollection(tables)
    kjt = random_kjt(tables, 16, np.random.default_rng(7))
    plain = IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc)(kjt).values()
    for dedup in ("always", "never"):
        with pytest.warns(FutureWarning, match="dedup is deprecated"):
            m = IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc, dedup=dedup)
        assert torch.equal(m(kjt).values(), plain)
    with pytest.warns(FutureWarning, match="dedup is deprecated"):
        IBPEmbeddingBagCollectionSharder(dedup="auto")


def test_codec_options_are_used():
    torch.manual_seed(0)
    tables = make_tables()
    ibp = IBPEmbeddingBagCollection(tables, word_bits=32, clusters=2)
    assert {t.word_bits for t in ibp.tables().values()} == {32}
    with pytest.raises(TypeError, match="codec option"):
        IBPEmbeddingBagCollection(tables, bogus=1)


def test_state_dict_round_trip():
    torch.manual_seed(0)
    tables = make_tables()
    ebc = EmbeddingBagCollection(tables)
    ibp = IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc)
    sd = ibp.state_dict()
    ref_sd = ebc.state_dict()
    assert list(sd) == list(ref_sd)  # TorchRec's keys, same order
    for k in sd:
        assert torch.equal(sd[k], ref_sd[k])
    # into a fresh module (cpu and meta)
    kjt = random_kjt(tables, 9, np.random.default_rng(5))
    expected = ibp(kjt).values()
    for device in ("cpu", "meta"):
        other = IBPEmbeddingBagCollection(make_tables(), device=device)
        res = other.load_state_dict(ebc.state_dict())
        assert not res.missing_keys and not res.unexpected_keys
        assert torch.equal(other(kjt).values(), expected)
    # and back into TorchRec
    ebc2 = EmbeddingBagCollection(make_tables())
    ebc2.load_state_dict(ibp.state_dict())
    assert torch.equal(ebc2(kjt).values(), ebc(kjt).values())
    assert torch.equal(ibp.to_embedding_bag_collection()(kjt).values(), ebc(kjt).values())


def test_load_state_dict_errors():
    tables = make_tables()
    ibp = IBPEmbeddingBagCollection(tables)
    sd = ibp.state_dict()
    bad = {k: v + 1 for k, v in sd.items()}
    bad["embedding_bags.t3.weight"] = torch.zeros(7, 11)
    with pytest.raises(RuntimeError, match=r"size mismatch for embedding_bags.t3.weight"):
        ibp.load_state_dict(bad)
    for k, v in ibp.state_dict().items():  # nothing was loaded
        assert torch.equal(v, sd[k])
    missing = dict(sd)
    del missing["embedding_bags.t1.weight"]
    with pytest.raises(RuntimeError, match="Missing key"):
        ibp.load_state_dict(missing)
    assert ibp.load_state_dict(missing, strict=False).missing_keys == ["embedding_bags.t1.weight"]
    extra = dict(sd)
    extra["embedding_bags.t0.bias"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        ibp.load_state_dict(extra)


def test_save_load_compressed_round_trip(tmp_path):
    torch.manual_seed(0)
    tables = make_tables()
    ebc = EmbeddingBagCollection(tables, is_weighted=True)
    ibp = IBPEmbeddingBagCollection.from_embedding_bag_collection(ebc, word_bits=64)
    ibp.save_compressed(tmp_path / "ckpt")
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "manifest.json" in files and sum(f.endswith(".ibp") for f in files) == len(tables)
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert [e["name"] for e in manifest["tables"]] == [t.name for t in tables]
    kjt = random_kjt(tables, 11, np.random.default_rng(2), weighted=True)
    expected = ibp(kjt)
    for mmap in (False, True):
        back = IBPEmbeddingBagCollection.load_compressed(tmp_path / "ckpt", mmap=mmap)
        assert back.is_weighted()
        assert [c.name for c in back.embedding_bag_configs()] == [t.name for t in tables]
        assert [c.pooling for c in back.embedding_bag_configs()] == [t.pooling for t in tables]
        out = back(kjt)
        assert out.keys() == expected.keys() and torch.equal(out.values(), expected.values())
        assert back.compressed_nbytes == ibp.compressed_nbytes
        del back
    # saving again replaces the checkpoint and removes the old table files
    ibp.save_compressed(tmp_path / "ckpt")
    files2 = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert sum(f.endswith(".ibp") for f in files2) == len(tables) and set(files2) != set(files)
    assert not any(f.endswith(".tmp") for f in files2)
    with pytest.raises(FileNotFoundError, match="manifest"):
        IBPEmbeddingBagCollection.load_compressed(tmp_path / "nothing")


def test_memory_is_compressed():
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="big", embedding_dim=64, num_embeddings=20000, feature_names=["a"])]
    ibp = IBPEmbeddingBagCollection(tables)
    assert ibp.raw_nbytes == 20000 * 64 * 4
    assert ibp.compressed_nbytes < ibp.raw_nbytes


# ---- bad input ----

@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["a", "b"])]
    return tables, IBPEmbeddingBagCollection(tables)


def kjt_of(keys, values, lengths, weights=None):
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.tensor(values),
                                               lengths=torch.tensor(lengths), weights=weights)


def test_id_out_of_range(small):
    _, m = small
    with pytest.raises(IndexError, match=r"feature 'b' of table 't': id 10 out of range for a table of 10 rows"):
        m(kjt_of(["a", "b"], [1, 2, 10], [1, 1, 1, 0]))
    with pytest.raises(IndexError, match="id -1"):
        m(kjt_of(["a", "b"], [-1], [1, 0, 0, 0]))


def test_id_out_of_range_while_training_changes_nothing(small):
    """libibp refuses the id (the module does not range-check in Python): the error
    names it, and no table row moves."""
    from ibp_embed.optim import SGD

    tables, _ = small
    m = IBPEmbeddingBagCollection(tables, optimizer=SGD(lr=0.1))
    before = m.state_dict()["embedding_bags.t.weight"].clone()
    with pytest.raises(IndexError, match=r"feature 'a' of table 't': id 12 out of range"):
        m(kjt_of(["a", "b"], [3, 12, 4], [2, 1, 0, 0])).values().sum().backward()
    assert torch.equal(m.state_dict()["embedding_bags.t.weight"], before)


def test_missing_and_unknown_keys(small):
    tables, m = small
    with pytest.raises(FeatureKeyError, match=r"lacks feature\(s\) \['b'\]"):
        m(kjt_of(["a"], [1], [1]))
    # keys no table reads are ignored, as TorchRec's EBC ignores them
    out = m(kjt_of(["zzz", "a", "b"], [3, 1, 2], [1, 1, 1]))
    assert torch.equal(out.values(), m(kjt_of(["a", "b"], [1, 2], [1, 1])).values())
    strict = IBPEmbeddingBagCollection(tables, strict_features=True)
    strict.load_state_dict(m.state_dict())
    with pytest.raises(FeatureKeyError, match=r"strict_features"):
        strict(kjt_of(["a", "b", "zzz"], [1, 2, 3], [1, 1, 1]))
    # keys that passed are not checked again: other keys are, after them
    for module, bad in ((m, ["a"]), (strict, ["a", "b", "zzz"]), (strict, ["a", "b", "a"])):
        module(kjt_of(["a", "b"], [1, 2], [1, 1]))
        for _ in range(2):
            with pytest.raises(FeatureKeyError):
                module(kjt_of(bad, [1, 2, 3][:len(bad)], [1] * len(bad)))


def test_weights_and_weightedness(small):
    tables, m = small
    # an unweighted module ignores weights, as TorchRec's EBC does
    weighted_input = m(kjt_of(["a", "b"], [1, 2], [1, 1], weights=torch.full((2,), 3.0)))
    assert torch.equal(weighted_input.values(), m(kjt_of(["a", "b"], [1, 2], [1, 1])).values())
    w = IBPEmbeddingBagCollection(tables, is_weighted=True)
    with pytest.raises(ValueError, match="no weights"):
        w(kjt_of(["a", "b"], [1, 2], [1, 1]))
    with pytest.raises(TypeError, match="per_sample_weights must be real numbers, got torch.complex64"):
        w(kjt_of(["a", "b"], [1, 2], [1, 1], weights=torch.ones(2, dtype=torch.complex64)))


def test_bad_ids_dtype(small):
    _, m = small
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.tensor([1.0, 2.0]), lengths=torch.tensor([1, 1]))
    with pytest.raises(TypeError, match="integers"):
        m(kjt)


def test_devices():
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["a"])]
    if not torch.cuda.is_available():  # the cuda path itself: tests/test_torchrec_cuda.py
        from ibp_embed import cuda

        with cuda.emulation(False), pytest.raises(cuda.NoCudaDeviceError, match="no CUDA device"):
            IBPEmbeddingBagCollection(tables, device="cuda")
    meta = IBPEmbeddingBagCollection(tables, device=torch.device("meta"))
    assert meta.device.type == "meta" and meta.tables()["t"] is None
    with pytest.raises(RuntimeError, match="meta device"):
        meta(kjt_of(["a"], [1], [1]))
    mkjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([1], device="meta"),
                             lengths=torch.tensor([1], device="meta"), stride=1)
    assert meta(mkjt).values().shape == (1, 4)
    assert meta.state_dict()["embedding_bags.t.weight"].device.type == "meta"
    with pytest.raises(RuntimeError, match="meta"):
        meta.save_compressed("/nonexistent/never")


def test_config_errors():
    with pytest.raises(ValueError, match="Duplicate table name"):
        IBPEmbeddingBagCollection([
            EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["a"]),
            EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["b"])])
    with pytest.raises(ValueError, match="data_type"):
        IBPEmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
                                                      feature_names=["a"], data_type=DataType.INT8)])
    with pytest.raises(TypeError, match="EmbeddingBagCollection"):
        IBPEmbeddingBagCollection.from_embedding_bag_collection(torch.nn.Linear(2, 2))
    meta_ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
                                                          feature_names=["a"])], device=torch.device("meta"))
    with pytest.raises(ValueError, match="meta"):
        IBPEmbeddingBagCollection.from_embedding_bag_collection(meta_ebc)


def test_manifest_entries_cannot_name_files_outside_the_directory(tmp_path):
    """A tampered manifest must not make save_compressed delete, or load_compressed
    read, a file outside the checkpoint directory."""
    tables = make_tables()
    ibp = IBPEmbeddingBagCollection.from_embedding_bag_collection(EmbeddingBagCollection(tables))
    ckpt = tmp_path / "ckpt"
    ibp.save_compressed(ckpt)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["tables"][0]["file"] = str(victim)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="plain file name"):
        IBPEmbeddingBagCollection.load_compressed(ckpt)
    ibp.save_compressed(ckpt)  # replaces the tampered manifest
    assert victim.read_text() == "keep me"
    IBPEmbeddingBagCollection.load_compressed(ckpt)
