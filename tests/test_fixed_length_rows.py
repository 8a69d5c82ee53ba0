"""Tables whose rows all encode to one length L (one cluster, every word participating,
as float tables of one exponent range): libibp reads row i at i * L, its index unread
(ibp_table.fixed_len, from ibp_fixed_row_bytes). Every path must decode and pool what
the index says, bit for bit, and a fixed_len the index does not bear out is refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ibp_embed
from ibp_embed import CompressedTable, ops
from ibp_embed._native import ffi, lib
from ibp_embed.datasets import uniform_ids, zipf_ids

from helpers import assert_decodes, every_isa


def _one_exponent(n_rows: int, dim: int, seed: int = 0) -> torch.Tensor:
    """fp16 values in [1, 2): every word keeps the same invariant bits."""
    g = torch.Generator().manual_seed(seed)
    return (1 + 0.99 * torch.rand(n_rows, dim, generator=g)).half()


def _with_index(t: CompressedTable) -> CompressedTable:
    """The same table, read through its index (fixed_len cleared)."""
    c = CompressedTable(shape=t.shape, dtype=t.dtype, word_bits=t.word_bits, masks=t._masks, bitvals=t._bitvals,
                        block_base=t._block_base, rel=t._rel, payload=t._payload, payload_bytes=t._payload_bytes)
    c._c.fixed_len = 0
    return c


@pytest.mark.parametrize("word_bits", [16, 32, 64])
def test_fixed_length_is_found_only_where_every_row_has_it(word_bits):
    w = _one_exponent(300, 64)
    t = ibp_embed.compress(w, word_bits=word_bits)
    lengths = t.row_lengths()
    assert np.all(lengths == lengths[0]) and lengths[0] < 128
    assert t._c.fixed_len == lengths[0]
    w[123, 5] = 1e4  # another exponent: that word does not participate, its row is longer
    v = ibp_embed.compress(w, word_bits=word_bits)
    assert v.row_lengths()[123] > v.row_lengths()[0] and v._c.fixed_len == 0
    L = int(lengths[0])
    one = CompressedTable(shape=(1, 64), dtype=w.dtype, word_bits=word_bits, masks=t._masks, bitvals=t._bitvals,
                          block_base=t._block_base[:1], rel=t._rel[:2], payload=t._payload, payload_bytes=L)
    assert one._c.fixed_len == L  # (compress stores a single row raw)
    assert ibp_embed.compress(w[:0])._c.fixed_len == 0


def test_fixed_length_rows_decode_and_pool_as_through_the_index_on_every_kernel_set():
    """Rows in order, a new order, the cached path (a small call), deduplicated (Zipf ids,
    a bitmap) and every id decoded in windows (uniform ids): 60k rows, 8229 ids."""
    n_rows, n = 60_000, 8229
    w = _one_exponent(n_rows, 64, seed=1)
    t = ibp_embed.compress(w, word_bits=64)
    assert t._c.fixed_len == t.row_lengths()[0]
    by_index = _with_index(t)
    g = torch.Generator().manual_seed(2)
    order = torch.randperm(n_rows, generator=g)[:5000]
    lengths = torch.randint(0, 2 * n // 300, (300,), generator=g)
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0).clamp(max=n)])
    off[-1] = n
    psw = torch.rand(n, generator=g)
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[order], order)
        for idx in (zipf_ids(n, n_rows, 1.05, seed=3), uniform_ids(n, n_rows, seed=3)):
            want = F.embedding_bag(idx, w.float(), off[:-1], mode="sum")
            assert torch.equal(t.lookup(idx, off), want)
            assert torch.equal(t.lookup(idx, off, psw, mode="mean"), by_index.lookup(idx, off, psw, mode="mean"))
        small = torch.tensor([7, n_rows - 1, 7, 0])
        assert torch.equal(t.lookup(small, torch.tensor([0, 3, 4])), by_index.lookup(small, torch.tensor([0, 3, 4])))


@pytest.mark.parametrize("word_bits", [16, 32, 64])
def test_fixed_length_rows_are_read_without_the_index(word_bits):
    """With fixed_len set, the decodes and lookups never read the index: zeroed after the
    table is taken (every row would then start at 0), the rows still come out right,
    through the run of full rows at every word size (full_rows_loop on AVX2)."""
    n_rows, n = 20_000, 4096
    w = _one_exponent(n_rows, 64, seed=8)
    t = ibp_embed.compress(w, word_bits=word_bits)
    assert t._c.fixed_len == t.row_lengths()[0]
    t._rel[:] = 0
    t._block_base[:] = 0
    g = torch.Generator().manual_seed(9)
    order = torch.randperm(n_rows, generator=g)[:3000]
    idx = torch.randint(0, n_rows, (n,), generator=g)
    off = torch.arange(0, n + 1, 16)
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[order], order)
        assert torch.equal(t.lookup(idx, off), F.embedding_bag(idx, w.float(), off[:-1], mode="sum"))


def test_the_operators_read_fixed_length_rows_without_the_index():
    w = _one_exponent(500, 32, seed=4)
    t = ibp_embed.compress(w, word_bits=64)
    tensors = ops.table_tensors(t)
    c = ops._table_of(*[tensors[k] for k in ops.TABLE_TENSORS], tensors["meta"], torch.float16, "t")._c
    assert c.fixed_len == t.row_lengths()[0] > 0
    ids, off = torch.tensor([1, 499, 499, 0]), torch.tensor([0, 3, 4])
    got = torch.ops.ibp.pooled_lookup(*[tensors[k] for k in ops.TABLE_TENSORS], tensors["meta"], torch.float16,
                                      ids, off, None, 0, "t")
    assert torch.equal(got, F.embedding_bag(ids, w.float(), off[:-1], mode="sum"))


def test_a_fixed_length_the_index_does_not_bear_out_is_refused():
    w = _one_exponent(200, 64, seed=5)
    t = ibp_embed.compress(w, word_bits=64)
    L = t._c.fixed_len
    bad = ffi.new("uint64_t *")
    assert lib.ibp_validate(t._c, bad) == lib.IBP_OK
    for wrong in (L - 1, L + 1):
        t._c.fixed_len = wrong
        assert lib.ibp_validate(t._c, bad) == lib.IBP_E_CORRUPT and bad[0] == 0
    t._c.fixed_len = L
    # an index whose rows differ (two rows' boundary moved): not fixed, and refused as fixed
    rel = t._rel.copy()
    rel[70] += 1
    moved = CompressedTable(shape=t.shape, dtype=t.dtype, word_bits=64, masks=t._masks, bitvals=t._bitvals,
                            block_base=t._block_base, rel=rel, payload=t._payload,
                            payload_bytes=t._payload_bytes, validate=False)
    assert moved._c.fixed_len == 0 and lib.ibp_fixed_row_bytes(moved._c) == 0
    short = CompressedTable(shape=t.shape, dtype=t.dtype, word_bits=64, masks=t._masks, bitvals=t._bitvals,
                            block_base=t._block_base, rel=t._rel, payload=t._payload,
                            payload_bytes=t._payload_bytes - 1, validate=False)
    assert short._c.fixed_len == 0  # spans past the payload: not taken as fixed
    moved._c.fixed_len = L
    assert lib.ibp_validate(moved._c, bad) == lib.IBP_E_CORRUPT and bad[0] == 69
    raw = ibp_embed.compress(torch.randn(20, 4))
    assert raw.is_raw and raw._c.fixed_len == 0
    raw._c.fixed_len = 16  # a raw table has no index to agree with
    assert lib.ibp_validate(raw._c, bad) == lib.IBP_E_ARG


def test_a_corrupt_header_among_fixed_length_rows_is_reported():
    """Rows of one length and one uniform plan are decoded in a run of their own
    (full_rows_loop on the AVX2 kernels), which must hand a row whose header says a
    word does not participate (a flipped bit: same length, so the index cannot tell)
    back to the general decoder, which reports it; every other row still decodes."""
    w = _one_exponent(400, 64, seed=6)
    t = ibp_embed.compress(w, word_bits=64)
    assert t._c.fixed_len == t.row_lengths()[0]
    bad = 200
    t._payload[bad * t._c.fixed_len] ^= 1 << 3  # word 3's participation bit
    others = torch.cat([torch.arange(bad - 40, bad), torch.arange(bad + 1, bad + 40)])
    for _ in every_isa():
        with pytest.raises(ibp_embed.FormatError):
            t.gather(torch.arange(bad - 40, bad + 40))
        assert_decodes(t, w[others], others)
