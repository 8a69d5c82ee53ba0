"""Raw tables (format version 2): compress() stores a table's rows as they are, with no
masks, index or tail pad, where encoding would not make it smaller, so no table grows."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ibp_embed
from ibp_embed import CompressedTable, FormatError, io, ops
from ibp_embed import reference as ref
from ibp_embed.store import UpdatableTable
from ibp_embed.batched import _lookup_many_checked

from helpers import (ALL_DTYPES, LOOKUP_DTYPES, WORD_BITS, assert_bits_equal, assert_decodes, every_isa, random_bits,
                     structured, table_sections, to_bytes, write_ibp)


def _raw(n=9, dim=12, dtype=torch.float32, seed=0) -> tuple[torch.Tensor, CompressedTable]:
    """Finite values of scattered magnitudes: nothing for masks to share."""
    g = torch.Generator().manual_seed(seed)
    e = 4 if dtype == torch.float16 else 20
    w = ((torch.rand(n, dim, generator=g) - 0.5) * 10.0 ** torch.randint(-e, e, (n, dim), generator=g)).to(dtype)
    t = ibp_embed.compress(w)
    assert t.is_raw
    return w, t


# ---------------------------------------------------------------- never larger

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 150), dim=st.integers(1, 40), dtype=st.sampled_from(ALL_DTYPES),
       kind=st.sampled_from(["random", "structured"]), word_bits=st.sampled_from([None, *WORD_BITS]),
       clusters=st.integers(1, 4), seed=st.integers(0, 1000))
def test_compress_never_grows_a_table(n, dim, dtype, kind, word_bits, clusters, seed):
    w = random_bits(n, dim, dtype, seed) if kind == "random" or n == 0 else structured(n, dim, dtype, seed)
    t = ibp_embed.compress(w, word_bits=word_bits, clusters=clusters)
    encoded = ibp_embed.compress(w, word_bits=word_bits, clusters=clusters, allow_raw=False)
    assert t.nbytes == min(encoded.nbytes, t.raw_nbytes) <= t.raw_nbytes
    assert t.is_raw == (encoded.nbytes >= t.raw_nbytes)
    if t.is_raw:  # the rows themselves, and nothing else
        assert t.clusters == 0 and t.masks.shape == (0, encoded.masks.shape[1])
        assert t._payload.tobytes() == to_bytes(w).tobytes() and t._payload_bytes == t.raw_nbytes
        assert t._block_base.size == t._rel.size == 0 and t.ratio == 1.0
        assert (t.cluster_ids() == -1).all() and (t.row_lengths() == dim * w.element_size()).all()
    assert_bits_equal(t.decompress(), w)


@pytest.mark.parametrize("n", [30, 400])
def test_reference_size_rule(n):
    """reference.store_table picks raw by docs/format.md's nbytes, as compress does: a few
    rows are stored raw, many are encoded."""
    w = structured(n, 3, torch.float32, seed=1)
    rows = to_bytes(w)
    encoded = ibp_embed.compress(w, allow_raw=False)
    want = ref.store_table(rows, encoded.word_bits, encoded.masks, encoded.bitvals)
    assert ref.table_nbytes(encoded._payload_bytes, n, 12, encoded.word_bits, 1) == encoded.nbytes
    assert (want["n_clusters"] == 0) == (encoded.nbytes >= rows.size) == (n == 30)
    stored = ibp_embed.compress(w)
    assert stored.clusters == want["n_clusters"] and stored._payload[: stored._payload_bytes].tobytes() == want["payload"]
    masks = stored.masks if stored.is_raw else encoded.masks
    assert ref.decode_table(want["payload"], want["block_base"], want["rel"], n, 12, encoded.word_bits,
                            masks, encoded.bitvals).tobytes() == rows.tobytes()


# ---------------------------------------------------------------- reads

@pytest.mark.parametrize("dtype", LOOKUP_DTYPES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_raw_reads_on_every_kernel_set(dtype, mode):
    w, t = _raw(33, 12, dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 33, (200,), generator=g)
    off = torch.tensor([0, 0, 5, 60, 61, 200])
    psw = torch.rand(200, generator=g)
    want = torch.nn.functional.embedding_bag(ids, w.float(), off[:-1], mode=mode, per_sample_weights=None)
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[ids], ids)
        assert_bits_equal(t.gather(ids.reshape(20, 10)), w[ids].reshape(20, 10, 12))
        torch.testing.assert_close(t.lookup(ids, off, mode=mode), want, rtol=1e-6, atol=1e-6)
        weighted = t.lookup(ids, off, psw, mode="sum")
        encoded = ibp_embed.compress(w, allow_raw=False).lookup(ids, off, psw, mode="sum")
        assert torch.equal(weighted, encoded)  # the same pooling, whatever the storage


def test_raw_lookup_refuses_out_of_range_ids():
    _, t = _raw()
    for bad in (9, -1, 2**40):
        with pytest.raises(IndexError):
            t.lookup([0, bad], [0, 2])
        with pytest.raises(IndexError):
            t.gather([bad])
    jobs = [(t, np.array([3, 9], np.int64), np.array([0, 1, 2], np.int64), None, "sum")]
    with pytest.raises(IndexError, match="feature x"):
        _lookup_many_checked(jobs, 2, what=lambda k: "feature x")


def test_lookup_many_mixes_raw_and_encoded_tables():
    w_raw, raw = _raw(20, 8, seed=4)
    w_enc = structured(500, 16, torch.float32, seed=5)
    enc = ibp_embed.compress(w_enc)
    assert not enc.is_raw
    g = torch.Generator().manual_seed(6)
    ids_a, ids_b = torch.randint(0, 20, (64,), generator=g).numpy(), torch.randint(0, 500, (64,), generator=g).numpy()
    off = np.arange(0, 65, 4, dtype=np.int64)
    out = ibp_embed.lookup_many([raw, enc], [ids_a, ids_b], [off, off], mode=["sum", "mean"])
    assert_bits_equal(out[:, :8].contiguous(), raw.lookup(ids_a, off))
    assert_bits_equal(out[:, 8:].contiguous(), enc.lookup(ids_b, off, mode="mean"))


def test_raw_table_through_the_operators():
    """torch.ops.ibp take a raw table's tensors (empty index, no tail pad)."""
    w, t = _raw(15, 6, seed=7)
    tensors = ops.table_tensors(t)
    assert tensors["masks"].shape == (0, 3) and tensors["block_base"].numel() == tensors["rel"].numel() == 0
    assert tensors["payload"].numel() == 15 * 24
    ids, off = torch.tensor([1, 14, 14, 0]), torch.tensor([0, 3, 4])
    args = [tensors[k] for k in ops.TABLE_TENSORS] + [tensors["meta"], torch.float32]
    got = torch.ops.ibp.pooled_lookup(*args, ids, off, None, 0, "t")
    assert torch.equal(got, t.lookup(ids, off))
    assert_bits_equal(ops.table_from_tensors(tensors, tensors["meta"], torch.float32).decompress(), w)
    short = dict(tensors, payload=tensors["payload"][:-1])
    with pytest.raises(ValueError, match="do not fit"):
        torch.ops.ibp.pooled_lookup(*[short[k] for k in ops.TABLE_TENSORS], tensors["meta"], torch.float32,
                                    ids, off, None, 0, "t")


def test_bad_raw_tables_are_refused():
    w, t = _raw(10, 4)
    m = t.masks.shape[1]
    base = dict(shape=(10, 4), dtype=torch.float32, word_bits=64, masks=np.zeros((0, m), np.uint64),
                bitvals=np.zeros((0, m), np.uint64), block_base=np.zeros(0, np.uint64), rel=np.zeros(0, np.uint16),
                payload=to_bytes(w).reshape(-1).copy(), payload_bytes=160)
    CompressedTable(**base)
    with pytest.raises(FormatError, match="exactly 160 payload bytes, not 150"):
        CompressedTable(**dict(base, payload_bytes=150))
    with pytest.raises(FormatError, match="shorter"):
        CompressedTable(**dict(base, payload=base["payload"][:-1]))
    with pytest.raises(FormatError, match="161 given"):  # nbytes would count bytes the file cannot hold
        CompressedTable(**dict(base, payload=np.zeros(161, np.uint8)))
    with pytest.raises(FormatError):
        CompressedTable.raw(to_bytes(w), torch.float32, 4, word_bits=8)
    with pytest.raises(FormatError, match="index"):
        CompressedTable(**dict(base, block_base=np.zeros(1, np.uint64)))


# ---------------------------------------------------------------- files

def test_raw_file_layout(tmp_path):
    """A raw table's file (docs/format.md): version 2, four empty sections, its rows."""
    w, t = _raw(11, 5, torch.float16, seed=8)
    t.save(tmp_path / "r.ibp")
    data = (tmp_path / "r.ibp").read_bytes()
    version, hlen, hcrc, zero = struct.unpack_from("<IIII", data, 8)
    assert (version, zero) == (2, 0) and hcrc == io.crc32c(data[24:24 + hlen])
    h = json.loads(data[24:24 + hlen])
    assert h["clusters"] == 0 and h["payload_bytes"] == 110
    for s in h["sections"]:
        assert s["offset"] % 64 == 0
        if s["name"] == "payload":
            assert data[s["offset"]: s["offset"] + s["length"]] == to_bytes(w).tobytes()
            assert s["offset"] + s["length"] == len(data)
        else:
            assert (s["length"], s["crc32c"]) == (0, 0)
    header, secs = table_sections(t)  # written from the document alone: the same table
    write_ibp(tmp_path / "doc.ibp", header, secs, version=2)
    assert_bits_equal(ibp_embed.load(tmp_path / "doc.ibp").decompress(), w)
    for mmap in (True, False):
        u = ibp_embed.load(tmp_path / "r.ibp", mmap=mmap)
        assert u.is_raw and u.nbytes == 110
        assert_bits_equal(u.decompress(), w)


def test_empty_raw_table_file(tmp_path):
    t = ibp_embed.compress(torch.empty(0, 7, dtype=torch.bfloat16))
    assert t.is_raw and t.nbytes == 0
    t.save(tmp_path / "z.ibp")
    u = ibp_embed.load(tmp_path / "z.ibp")
    assert u.shape == (0, 7) and u.is_raw and u.lookup([], [0, 0]).shape == (1, 7)


def test_versions(tmp_path):
    """Encoded tables keep version 1 (older readers open them) and load with a version 2
    prefix too; clusters 0 needs version 2."""
    w = structured(300, 8, torch.float32, seed=9)
    enc = ibp_embed.compress(w)
    enc.save(tmp_path / "e.ibp")
    assert struct.unpack_from("<I", (tmp_path / "e.ibp").read_bytes(), 8)[0] == 1
    header, secs = table_sections(enc)
    write_ibp(tmp_path / "e2.ibp", header, secs, version=2)
    assert_bits_equal(ibp_embed.load(tmp_path / "e2.ibp").decompress(), w)
    _, raw = _raw()
    header, secs = table_sections(raw)
    write_ibp(tmp_path / "r1.ibp", header, secs, version=1)
    with pytest.raises(FormatError, match="clusters 0 \\(a raw table\\) needs format version 2"):
        ibp_embed.load(tmp_path / "r1.ibp")


@pytest.mark.parametrize("change,match", [
    ({"payload_bytes": 9 * 48 - 1}, "a raw table has exactly 432"),
    ({"sections_masks": b"\0" * 48}, "section masks"),
    ({"sections_rel": b"\0" * 20}, "section rel"),
    ({"sections_payload": b"\0" * (9 * 48 + 1)}, "section payload"),
    ({"clusters": -1}, "clusters -1"),
])
def test_inconsistent_raw_headers(tmp_path, change, match):
    _, t = _raw(9, 12)
    header, secs = table_sections(t)
    for k, v in change.items():
        if k.startswith("sections_"):
            secs[k.removeprefix("sections_")] = v
        else:
            header[k] = v
    write_ibp(tmp_path / "bad.ibp", header, secs, version=2)
    with pytest.raises(FormatError, match=match):
        ibp_embed.load(tmp_path / "bad.ibp")


def test_raw_file_truncations_and_flips(tmp_path):
    w, t = _raw(6, 4, seed=10)
    t.save(tmp_path / "r.ibp")
    data = (tmp_path / "r.ibp").read_bytes()
    p = tmp_path / "cut.ibp"
    for n in range(len(data)):
        p.write_bytes(data[:n])
        with pytest.raises(FormatError):
            ibp_embed.load(p)
    h = io.read_header(tmp_path / "r.ibp")
    body_end = 24 + struct.unpack_from("<I", data, 12)[0]
    payload = next(s for s in h["sections"] if s["name"] == "payload")
    checked = [*range(body_end), *range(payload["offset"], payload["offset"] + payload["length"])]
    for pos in checked:
        bad = bytearray(data)
        bad[pos] ^= 0x41
        p.write_bytes(bytes(bad))
        with pytest.raises(FormatError):
            ibp_embed.load(p, verify=True)
    os.remove(p)


# ---------------------------------------------------------------- training

def test_updatable_raw_table():
    """A raw table trains: rows are rewritten raw, checkpoints stay raw, a repack may encode."""
    w, t = _raw(40, 8, seed=11)
    u = UpdatableTable(t, repack_drift=None)
    assert u.clusters == 0 and u.packed_nbytes == u.raw_nbytes
    new = random_bits(3, 8, torch.float32, seed=12)
    ids = np.array([0, 17, 39])
    u.update(ids, new)
    want = w.clone()
    want[ids] = new
    assert_bits_equal(u.decompress(), want)
    packed = u.to_table()
    assert packed.is_raw and packed.nbytes == packed.raw_nbytes
    assert_bits_equal(packed.decompress(), want)
    smooth = structured(40, 8, torch.float32, seed=13) * 0 + 1.5  # now very compressible
    u.update(np.arange(40), smooth)
    u.repack()
    assert u.clusters >= 1 and u.to_table().nbytes < u.raw_nbytes
    assert_bits_equal(u.decompress(), smooth)


def test_trained_rows_checkpoint_raw_when_masks_no_longer_pay():
    """to_table() (checkpoints) stores the rows raw once training moved them off the masks."""
    w = structured(60, 16, torch.float32, seed=14)
    u = UpdatableTable(ibp_embed.compress(w), repack_drift=None)
    assert u.clusters >= 1 and u.to_table().nbytes < u.raw_nbytes
    noise = _raw(60, 16, seed=15)[0]
    u.update(np.arange(60), noise)
    packed = u.to_table()
    assert packed.is_raw and u.packed_nbytes == packed.nbytes == u.raw_nbytes
    assert_bits_equal(packed.decompress(), noise)


def test_raw_store_tries_encoding_again_after_a_tables_worth_of_writes():
    """A raw store cannot grow, so the drift trigger cannot fire: it repacks once as many
    rows as it has were written, and encodes when that pays."""
    _, t = _raw(50, 8, seed=16)
    u = UpdatableTable(t, repack_drift=0.05)
    smooth = (1.5 + torch.arange(50 * 8).reshape(50, 8) * 1e-6).float()
    u.update(np.arange(25), smooth[:25])
    assert u.clusters == 0  # half the table written: no repack yet
    u.update(np.arange(25, 50), smooth[25:])
    assert u.clusters >= 1 and u.to_table().nbytes < u.raw_nbytes
    assert_bits_equal(u.decompress(), smooth)


def test_embedding_bag_modules_keep_raw_and_empty_tables():
    """IBPEmbeddingBag over a raw table and over a 0-row one (raw: no bytes at all, as a
    row-wise shard with no rows is): forward, deepcopy and .to("cpu") keep them."""
    import copy

    from ibp_embed.torchrec.embedding_bag import IBPEmbeddingBag

    w, t = _raw(5, 8, seed=17)
    empty = ibp_embed.compress(torch.empty(0, 4))
    assert empty.is_raw and empty.nbytes == 0
    small = IBPEmbeddingBag(5, 8, torch.float32, "sum", t, {}, name="small")
    none = IBPEmbeddingBag(0, 4, torch.float32, "mean", empty, {}, name="none")
    ids, off = torch.tensor([0, 4, 4, 2]), torch.tensor([0, 2, 3, 4])
    want = torch.stack([w[[0, 4]].sum(0), w[4], w[2]])
    no_ids = torch.empty(0, dtype=torch.int64)
    for bag in (small, copy.deepcopy(small), small.to("cpu")):
        assert bag.table is not None and torch.equal(bag(ids, off), want)
    for bag in (none, copy.deepcopy(none), none.to("cpu")):
        assert bag.table is not None and bag.weight.shape == (0, 4) and bag.weight.device.type == "cpu"
        assert torch.equal(bag(no_ids, torch.zeros(4, dtype=torch.int64)), torch.zeros(3, 4))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_a_table_of_no_rows_takes_a_backward(optimizer):
    """A row-wise shard can have no rows (2 rows on 3 ranks): its optimizer state has no
    elements (a NULL pointer), and a backward of empty bags must still run. (FBGEMM's CPU
    kernel fails at random on such a shard, so the DMP comparison tests avoid it.)"""
    from ibp_embed.optim import make_optimizer

    opt = make_optimizer(optimizer, lr=0.1)
    u = UpdatableTable(ibp_embed.compress(torch.empty(0, 8)), repack_drift=0.05)
    state = opt.init_state(0, 8)
    u.apply_gradients(opt, state, np.empty(0, np.int64), np.zeros(5, np.int64), 4, torch.ones(4, 8), [0])
    assert u.decompress().shape == (0, 8)
    with pytest.raises(IndexError):
        u.apply_gradients(opt, state, np.zeros(1, np.int64), np.array([0, 1, 1, 1, 1]), 4, torch.ones(4, 8), [0])
