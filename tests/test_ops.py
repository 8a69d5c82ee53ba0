"""torch.ops.ibp beyond the lookups themselves: the tables the operators build from
tensors (read again after in-place changes, never kept alive by the operators), the
gradient of per_sample_weights, and pooled_lookup_many (a collection in one call)."""
import gc
import weakref

import numpy as np
import pytest
import torch

import ibp_embed
from ibp_embed import ops
from ibp_embed.dtypes import LOOKUP_DTYPES


def tensors_of(t):
    """A table's operator tensors, copied (memory of their own), and its meta."""
    tt = ops.table_tensors(t)
    return [tt[k].clone() for k in ops.TABLE_TENSORS], tt["meta"]


def same_layout_tables(n=20000):
    """Two W = 64 tables of fp32 d4 rows, every row of both 9 bytes (the same meta), whose
    words' variable bits differ: 48 + 16 in one, 16 + 48 in the other."""
    out = []
    for keep in ((0xFFFFFF, 0xFFFFFF, 0xFF, 0xFF), (0xFF, 0xFF, 0xFFFFFF, 0xFFFFFF)):
        u = np.random.default_rng(len(out)).integers(0, 2**32, (n, 4), dtype=np.uint64).astype(np.uint32)
        u = (u & np.array(keep, dtype=np.uint32)) | np.uint32(0x3F000000)
        out.append(ibp_embed.compress(torch.from_numpy(u.view(np.float32)), word_bits=64, clusters=1,
                                      allow_raw=False))
    assert ops.table_meta(out[0]) == ops.table_meta(out[1])
    return out


def test_tensors_written_in_place_are_read_again():
    """The operators keep the table they build from a set of tensors (its struct holds
    the bits each word varies by, read from the masks): a copy_ into those tensors
    (load_state_dict's way) must not leave them decoding with the old table's."""
    a, b = same_layout_tables()
    tensors, meta = tensors_of(a)
    ids = torch.arange(0, a.shape[0], 7)
    off = torch.tensor([0, 5, ids.numel()])
    assert torch.equal(torch.ops.ibp.gather(*tensors, meta, torch.float32, ids, "t"), a.gather(ids))
    for dst, src in zip(tensors, tensors_of(b)[0]):
        dst.copy_(src)
    assert torch.equal(torch.ops.ibp.gather(*tensors, meta, torch.float32, ids, "t").view(torch.int32),
                       b.gather(ids).view(torch.int32))
    assert torch.equal(torch.ops.ibp.pooled_lookup(*tensors, meta, torch.float32, ids, off, None, 0, "t"),
                       b.lookup(ids, off))
    many = torch.ops.ibp.pooled_lookup_many(*[[x] for x in tensors], meta, [0], ids, off, None, 2,
                                            1, [0], [0], ["t"])
    assert torch.equal(many, b.lookup(ids, off))


def test_tensors_moved_to_other_memory_or_made_in_inference_mode():
    """share_memory_ (as model.share_memory() or a torch.multiprocessing queue does) moves
    a tensor's memory and keeps its object and version: the operators must read the new
    memory. Tensors made under inference_mode keep no version counter."""
    t = ibp_embed.compress(torch.randn(3000, 16))
    ids, off = torch.tensor([1, 2, 2999]), torch.tensor([0, 1, 3])
    want = t.lookup(ids, off)
    tensors, meta = tensors_of(t)
    for _ in range(2):
        assert torch.equal(torch.ops.ibp.pooled_lookup(*tensors, meta, torch.float32, ids, off, None, 0, "t"), want)
        assert torch.equal(torch.ops.ibp.pooled_lookup_many(*[[x] for x in tensors], meta, [0], ids, off, None, 2,
                                                            1, [0], [0], ["t"]), want)
        for x in tensors:
            x.share_memory_()
    with torch.inference_mode():
        frozen, _ = tensors_of(t)
    assert torch.equal(torch.ops.ibp.pooled_lookup(*frozen, meta, torch.float32, ids, off, None, 0, "t"), want)
    assert torch.equal(torch.ops.ibp.pooled_lookup_many(*[[x] for x in frozen], meta, [0], ids, off, None, 2, 1,
                                                        [0], [0], ["t"]), want)
    w = torch.rand(3)
    assert torch.equal(torch.ops.ibp.pooled_lookup(*tensors, meta, torch.float32, ids, off, torch._neg_view(w), 0,
                                                   "t"), t.lookup(ids, off, -w))  # a negative-bit view
    zeros = torch._efficientzerotensor(3)  # no memory: the dispatcher materialises it
    assert torch.equal(torch.ops.ibp.pooled_lookup(*tensors, meta, torch.float32, ids, off, zeros, 0, "t"),
                       torch.zeros(2, 16))


def test_operators_keep_no_table_alive():
    """The tables (and native jobs) the operators keep for a set of tensors hold no
    reference to them, and go when they die: a dropped model's tables are freed."""
    t = ibp_embed.compress(torch.randn(3000, 16))
    tensors, meta = tensors_of(t)
    ids, off = torch.tensor([1, 2, 2999]), torch.tensor([0, 1, 3])
    torch.ops.ibp.pooled_lookup(*tensors, meta, torch.float32, ids, off, None, 0, "t")
    torch.ops.ibp.pooled_lookup_many(*[[x] for x in tensors], meta, [0], ids, off, None, 2, 1, [0], [0],
                                     ["t"])
    refs = [weakref.ref(x) for x in tensors]
    gc.collect()  # earlier tests' garbage first: then only these tensors' entries may go
    kept = len(ops._TABLES), len(ops._JOBS)
    del tensors
    gc.collect()
    assert all(r() is None for r in refs)
    assert (len(ops._TABLES), len(ops._JOBS)) == (kept[0] - 1, kept[1] - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_sample_weights_get_their_gradient(dtype):
    """d out[b] / d w[i] = row(ids[i]) (over the bag's length for MEAN), as
    nn.functional.embedding_bag gives it, through both operators."""
    t = ibp_embed.compress((torch.randn(400, 12) * 0.1).to(dtype), clusters=3)
    tensors, meta = tensors_of(t)
    rows = t.decompress().float()
    ids = torch.tensor([3, 399, 3, 0, 7, 7, 7, 11])
    off = torch.tensor([0, 2, 2, 8])
    lengths = (off[1:] - off[:-1]).clamp(min=1).unsqueeze(1).float()
    g = torch.randn(3, 12)
    for mode in (0, 1):
        want_w = torch.rand(8, requires_grad=True)
        want = torch.nn.functional.embedding_bag(ids, rows, off[:-1], per_sample_weights=want_w, mode="sum")
        (want / lengths if mode else want).backward(g)
        w = want_w.detach().clone().requires_grad_()
        out = torch.ops.ibp.pooled_lookup(*tensors, meta, dtype, ids, off, w, mode, "t")
        out.backward(g)
        torch.testing.assert_close(w.grad, want_w.grad)
        w2 = want_w.detach().clone().requires_grad_()  # two jobs reading key 0, one key 1
        kjt_ids, kjt_off = torch.cat([ids, ids[:2]]), torch.cat([off, torch.tensor([9, 10, 10])])
        w_all = torch.cat([w2, torch.ones(2)])
        many = torch.ops.ibp.pooled_lookup_many(*[[x, x, x] for x in tensors], meta * 3, [LOOKUP_DTYPES[dtype]] * 3,
                                                kjt_ids, kjt_off, w_all, 3, 2, [0, 1, 0], [mode] * 3, ["a", "b", "c"])
        many[:, :12].backward(g, retain_graph=True)
        many[:, 24:].backward(g)
        torch.testing.assert_close(w2.grad, 2 * want_w.grad)
    w = torch.rand(8, requires_grad=True)
    torch.library.opcheck(torch.ops.ibp.pooled_lookup.default, (*tensors, meta, dtype, ids, off, w, 1, "t"))
    with torch.no_grad():  # no graph where autograd is off
        assert not torch.ops.ibp.pooled_lookup(*tensors, meta, dtype, ids, off, w, 0, "t").requires_grad


def test_pooled_lookup_many_matches_lookup_many_and_checks_its_inputs():
    ts = [ibp_embed.compress(torch.randn(n, d), clusters=2) for n, d in ((300, 8), (50, 16), (1000, 4))]
    args = [[tensors_of(t)[0][k] for t in ts] for k in range(5)]
    metas = [m for t in ts for m in ops.table_meta(t)]
    ids = torch.tensor([1, 2, 3, 4, 5, 999, 49, 0, 7])  # keys k0, k1, k2 of 3 ids each; B = 2
    off = torch.tensor([0, 1, 3, 3, 6, 8, 9])
    # job j pools key [0, 2, 1][j] from table j
    want = ibp_embed.lookup_many(ts, [ids[0:3], ids[6:9], ids[3:6]], [off[0:3], off[4:7] - 6, off[2:5] - 3])
    call = lambda *over: torch.ops.ibp.pooled_lookup_many(  # noqa: E731
        *args, metas, [0] * 3, *over, 3, [0, 2, 1], [0, 0, 0], ["a", "b", "c"])
    assert torch.equal(call(ids, off, None, 2), want)
    torch.library.opcheck(torch.ops.ibp.pooled_lookup_many.default,
                          (*args, metas, [0] * 3, ids, off, None, 2, 3, [0, 2, 1], [0, 0, 0],
                           ["a", "b", "c"]))
    with pytest.raises(IndexError, match="b: .*999 out of range"):  # job 1 (table 1, 50 rows) pools key 1
        torch.ops.ibp.pooled_lookup_many(*args, metas, [0] * 3, ids, off, None, 2, 3, [0, 1, 2],
                                         [0, 0, 0], ["a", "b", "c"])
    with pytest.raises(ValueError, match="offsets must run from 0 to len"):
        call(ids, torch.tensor([0, 1, 3, 3, 6, 8, 8]), None, 2)
    with pytest.raises(ValueError, match="offsets must run from 0 to len"):
        call(ids, torch.tensor([0, 4, 3, 3, 6, 8, 9]), None, 2)
    with pytest.raises(ValueError, match=r"offsets have 7 entries, expected 3 keys x batch 3 \+ 1 = 10"):
        call(ids, off, None, 3)
    with pytest.raises(TypeError, match="ids must be integers"):
        call(ids.float(), off, None, 2)
    with pytest.raises(ValueError, match=r"per_sample_weights of shape \(1, 9\) for values of shape \(9,\)"):
        call(ids, off, torch.ones(1, 9), 2)
    with pytest.raises(ValueError, match="3 jobs need as many"):
        torch.ops.ibp.pooled_lookup_many(*args, metas[:8], [0] * 3, ids, off, None, 2, 3, [0, 2, 1],
                                         [0, 0, 0], ["a", "b", "c"])
    with pytest.raises(ValueError, match="b: the table tensors do not fit"):
        bad = [list(a) for a in args]
        bad[4][1] = bad[4][1][:10]
        torch.ops.ibp.pooled_lookup_many(*bad, metas, [0] * 3, ids, off, None, 2, 3, [0, 2, 1],
                                         [0, 0, 0], ["a", "b", "c"])


def test_a_table_description_of_the_wrong_form_is_refused():
    t = ibp_embed.compress(torch.randn(100, 8))
    tensors, meta = tensors_of(t)
    ids, off = torch.tensor([1, 2]), torch.tensor([0, 2])
    for bad, match in (([100], "meta must be"), (meta[:3] + [-1], "bad table description"),
                       (meta[:2] + [8] + meta[3:], "bad table description")):
        with pytest.raises(ValueError, match=match):
            torch.ops.ibp.pooled_lookup(*tensors, bad, torch.float32, ids, off, None, 0, "t")
        with pytest.raises(ValueError, match=match):
            torch.ops.ibp.gather(*tensors, bad, torch.float32, ids, "t")
