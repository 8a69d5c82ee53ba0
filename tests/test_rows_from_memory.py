"""Rows read from memory rather than cache: gathers and lookups that take the decoders'
prefetches for rows likely in memory (two-level prefetches, index entries a chunk
ahead), where a call's rows outgrow L2 or its table is much larger than L2
(rows_in_memory in native/ibp_spans.inc). Every instruction set bit for bit, raw rows
copied as stored and corrupt rows reported, as for rows in cache (test_decode_plans)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import ibp_embed

from helpers import assert_decodes, every_isa

# IBP_SCATTERED_COLD_MIN_L2S, read from the source: the large tables below must stay over
# the rule when it moves
_SPANS_SOURCE = Path(__file__).resolve().parents[1] / "native" / "ibp_spans.inc"
_COLD_RULE = re.search(r"#define IBP_SCATTERED_COLD_MIN_L2S (\d+)", _SPANS_SOURCE.read_text())
if _COLD_RULE is None:
    raise RuntimeError(f"{_SPANS_SOURCE} no longer defines IBP_SCATTERED_COLD_MIN_L2S: say here what the rule is")
COLD_MIN_L2S = int(_COLD_RULE[1])


def d64_rows(n: int, dtype: torch.dtype, outliers: float, g: torch.Generator):
    """n rows of 64 values in [1, 2) of one exponent, a share `outliers` of them at
    another (those words do not participate), and where there are outliers every 89th
    row random bits (stored raw): (weights, the raw rows' mask)."""
    w = (1 + 0.99 * torch.rand(n, 64, generator=g)).to(dtype)  # under 2.0 once rounded
    odd = torch.rand(w.shape, generator=g) < outliers
    w[odd] *= 64  # another exponent: the word does not participate
    raw_rows = (torch.arange(n) % 89 == 7) & (outliers > 0)
    w.view(torch.uint8)[raw_rows] = torch.randint(0, 256, w.view(torch.uint8)[raw_rows].shape, generator=g,
                                                  dtype=torch.uint8)
    return w, raw_rows


def assert_gathers_and_reports_a_corrupt_row(t, w, ids, raw_rows):
    """On 1 thread, every instruction set gathers rows ids of t (weights w) bit for bit;
    then, with the participation bit of the word with the most invariant bits flipped in
    an encoded row named in the middle of the batch (raw_rows: the rows stored raw), it
    reports that row and still gathers the others bit for bit."""
    from io_cases import single_thread

    with single_thread():
        for _ in every_isa():
            assert_decodes(t, w[ids], ids)
        bad = int(ids[np.flatnonzero(~raw_rows[ids].numpy())[len(ids) // 2]])
        j = int(np.argmax([bin(int(m)).count("1") for m in np.asarray(t.masks)[0]]))
        t._payload[int(t._row_starts()[bad]) + j // 8] ^= 1 << (j % 8)
        others = ids[ids != bad]
        for _ in every_isa():
            with pytest.raises(ibp_embed.FormatError):
                t.gather(ids)
            assert_decodes(t, w[others], others)


@pytest.mark.parametrize("word_bits", [16, 32, 64])
@pytest.mark.parametrize("outliers", [0.0, 0.05])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_short_rows_from_memory(word_bits, outliers, dtype):
    """Rows of 128 and 256 bytes (d64) gathered into more than L2 holds (5-10 MB on 1
    thread) take the prefetches of rows from memory where the loop steps them (far_rows:
    32 rows ahead into L2, the spans of the next chunk's rows included): rows of
    one exponent are all whole (decode_full_rows_cold); with 5% outliers, rows are
    packed rows (decode_packed_rows_cold, some rows raw; fp16 rows, of two steps, in its
    unrolled form). Every instruction set must decode them bit for bit and report a
    corrupt row among them."""
    g = torch.Generator().manual_seed(72)
    n = 6000
    w, raw_rows = d64_rows(n, dtype, outliers, g)
    t = ibp_embed.compress(w, word_bits=word_bits)
    assert t._row_bytes == 64 * w.element_size() and t.clusters == 1 and not t.is_raw
    assert_gathers_and_reports_a_corrupt_row(t, w, torch.randint(0, n, (40000,), generator=g), raw_rows)


@pytest.mark.parametrize("word_bits", [16, 32, 64])
@pytest.mark.parametrize("outliers", [0.05, 0.002])
def test_packed_rows_loop_from_memory(word_bits, outliers):
    """Rows gathered into more than L2 holds (4.6 MB on 1 thread) are decoded by the
    packed loop's variant for rows from memory (two-level prefetches), which tries
    the steps' direct forms only in tables where 85% of the steps or more are direct
    (direct_steps_common; as rows in cache do): at W = 64 5% outliers leave about 40% of the steps direct
    (their general steps then take every step, whole ones too), 0.2% 97% (direct
    steps taken; at W = 32 too, where 77% of the rows are whole). At W = 16, and W =
    32 with 5%, few rows are whole and direct steps are off: the general steps
    alone. Every instruction set must decode them bit for bit (the direct share
    itself only moves speed), copy a raw row (random bits) as stored and go on, and
    report a row whose bits do not add up to its length, among rows from memory as
    among rows in cache (test_packed_rows_loop_copies_raw_and_hands_back_corrupt_rows)."""
    g = torch.Generator().manual_seed(71)
    n = 3000
    w = 1 + torch.rand(n, 128, generator=g)
    odd = torch.rand(w.shape, generator=g) < outliers
    w[odd] *= 1024  # another exponent: the word does not participate
    raw_rows = torch.arange(n) % 97 == 13
    w.view(torch.uint8)[raw_rows] = torch.randint(0, 256, w.view(torch.uint8)[raw_rows].shape, generator=g,
                                                  dtype=torch.uint8)
    t = ibp_embed.compress(w, word_bits=word_bits)
    assert t.clusters == 1 and not t.is_raw and np.all(t.row_lengths()[raw_rows.numpy()] == t._row_bytes)
    ids = torch.randint(0, n, (9000,), generator=g)
    assert raw_rows[ids].any()
    assert_gathers_and_reports_a_corrupt_row(t, w, ids, raw_rows)


def large_table(word_bits: int, seed: int):
    """A table of more than IBP_SCATTERED_COLD_MIN_L2S times L2 (rows_in_memory; 19 MB of
    256-byte rows, over 8 times L2 on cores of up to 2 MB of it; skips where L2 is
    larger): weights, the table and the rows stored raw (random bits)."""
    from ibp_embed._native import lib

    w, raw_rows = d64_rows(100_000, torch.float32, 0.05, torch.Generator().manual_seed(seed))
    t = ibp_embed.compress(w, word_bits=word_bits)
    assert t.clusters == 1 and not t.is_raw
    if t._payload_bytes <= COLD_MIN_L2S * lib.ibp_l2_bytes():
        pytest.skip(f"an L2 of {lib.ibp_l2_bytes() >> 20} MB: the table would take the prefetches for rows in cache")
    return w, t, raw_rows


@pytest.mark.parametrize("word_bits", [16, 32, 64])
def test_few_rows_gathered_from_a_large_table(word_bits):
    """A gather of a few rows (1 to 200: outputs far below L2) from a table of more than
    8 times L2 takes the prefetches of rows from memory (rows_in_memory: the far rows
    into L2, the index entries a chunk ahead) where cold_rows allows (W = 64, and runs
    of rows): calls shorter than a chunk, of one chunk and of one row more, every
    instruction set bit for bit, raw rows copied as stored and a corrupt row reported."""
    from io_cases import single_thread

    w, t, raw_rows = large_table(word_bits, 73)
    g = torch.Generator().manual_seed(74)
    with single_thread():
        for m in (1, 7, 63, 64, 65):
            ids = torch.randint(0, t.shape[0], (m,), generator=g)
            for _ in every_isa():
                assert_decodes(t, w[ids], ids)
    ids = torch.randint(0, t.shape[0], (200,), generator=g)
    assert raw_rows[ids].any()
    assert_gathers_and_reports_a_corrupt_row(t, w, ids, raw_rows)


@pytest.mark.parametrize("word_bits", [16, 64])
def test_small_lookups_into_a_large_table(word_bits):
    """Lookups of fewer than 16 ids (the row cache's calls) into a table of more than 8
    times L2 decode their misses with the prefetches of rows from memory (rows_in_memory)
    where cold_rows allows: every instruction set's sums, mean and weighted bags among
    them, are the bits of the same bags pooled from the rows stored raw (libibp's pooling
    of a raw table: no decode), raw rows and repeated ids included."""
    from io_cases import single_thread

    w, t, raw_rows = large_table(word_bits, 75)
    plain = ibp_embed.CompressedTable.raw(w.view(torch.uint8).numpy(), torch.float32, 64)
    g = torch.Generator().manual_seed(76)
    raw_ids = torch.nonzero(raw_rows).reshape(-1)
    with single_thread():
        for lengths in ([1], [3, 0, 4], [5, 5, 5], [15]):
            off = torch.tensor([0, *lengths]).cumsum(0)
            ids = torch.randint(0, t.shape[0], (int(off[-1]),), generator=g)
            ids[0] = raw_ids[int(torch.randint(0, raw_ids.numel(), (1,), generator=g))]
            if ids.numel() > 2:
                ids[-1] = ids[1]  # an id again: a hit
            weights = torch.rand(ids.numel(), generator=g)
            for mode, psw in (("sum", None), ("mean", None), ("sum", weights)):
                want = plain.lookup(ids, off, per_sample_weights=psw, mode=mode).view(torch.int32)
                for _ in every_isa():
                    got = t.lookup(ids, off, per_sample_weights=psw, mode=mode)
                    assert torch.equal(got.view(torch.int32), want), (lengths, mode, psw is not None)
