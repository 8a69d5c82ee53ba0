"""The decoders' planned paths (AVX-512's, and AVX2's full rows), each against every
instruction set, bit for bit:
fields placed from a table's plan, direct steps, runs of full rows (decode_full_rows,
which hands raw rows back to the general decoder) and of packed rows
(decode_packed_rows, which copies them), and the corrupt rows both hand back. Rows are
decoded into buffers filled with the complement of the expected bytes
(helpers.assert_decodes), so that a byte a decoder fails to write cannot pass."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import ibp_embed

from helpers import assert_decodes, every_isa, lane_extras


# IBP_DIRECT_MIN_PERCENT, read from the source: a test written for one share cannot go on
# passing without the path it names when the rule moves
_PLAN_SOURCE = Path(__file__).resolve().parents[1] / "native" / "ibp_avx512_plan.inc"
_DIRECT_RULE = re.search(r"#define IBP_DIRECT_MIN_PERCENT (\d+)", _PLAN_SOURCE.read_text())
if _DIRECT_RULE is None:
    raise RuntimeError(f"{_PLAN_SOURCE} no longer defines IBP_DIRECT_MIN_PERCENT: say here what the direct-step rule is")
DIRECT_MIN_SHARE = int(_DIRECT_RULE[1]) / 100


def direct_step_share(t, w) -> float:
    """The share of the steps of t's encoded rows (one cluster) whose words all
    participate: the decoders take those steps' direct forms only in tables where it
    is DIRECT_MIN_SHARE or more (direct_steps_common in native/ibp_avx512_plan.inc)."""
    W = t.word_bits
    raw = np.ascontiguousarray(w.contiguous().view(torch.uint8).numpy())
    words = raw.view({16: np.uint16, 32: np.uint32, 64: np.uint64}[W]).astype(np.uint64)
    masks, bitvals = np.asarray(t.masks)[0], np.asarray(t.bitvals)[0]
    steps = ((words & masks) == bitvals).reshape(len(words), -1, 512 // W).all(axis=2)
    return float(steps[t.row_lengths() < t._row_bytes].mean())


@pytest.mark.parametrize("outliers", [0.01, 0.002])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("word_bits", [16, 32, 64])
def test_decode_plans_place_fields_after_words_that_do_not_participate(word_bits, dtype, outliers):
    """Where every word of a step has the same invariant bits, the AVX-512 decoders
    take the fields' offsets from the plan and add W - vbits for each word below that
    does not participate; a step whose every word participates is cut from one window,
    shifted when words before it did not participate (in tables where 85% of the steps
    or more are such, at W = 16 and 32 where rows mostly have every word
    participating: 0.2% outliers, not 1%). Values in
    [1, 2) share their exponent; scattered outliers (another exponent) make single
    words, and so the fields after them, move. Every instruction set must decode the
    table bit for bit."""
    g = torch.Generator().manual_seed(43)
    w = (1 + torch.rand(900, 128, generator=g)).to(dtype)
    outliers = torch.rand(900, 128, generator=g) < outliers
    w[outliers] = (w[outliers].float() * 1024).to(dtype)
    t = ibp_embed.compress(w, word_bits=word_bits)
    lengths = t.row_lengths()
    assert t.clusters == 1 and len(np.unique(lengths)) > 3  # outliers do not participate: longer rows
    ids = torch.randint(0, 900, (400,), generator=g)
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[ids], ids)


@pytest.mark.parametrize("word_bits", [16, 32, 64])
def test_decode_plans_follow_each_words_own_runs(word_bits):
    """The AVX-512 decoders plan a table's deposits once (per cluster and word: a
    shift per run of variable bits in each byte, and the bit values) and reuse the
    plan while the codebook is the same. Columns with their own sign and exponent
    give every word its own bit values; int8 bytes with variable bits 0, 2 and 4 take
    a plan's three shifts, and with 0, 2, 4 and 6 more than a plan holds (decoded
    without one); two tables of one shape decoded in turn must not share a plan; a
    table of four magnitudes has a plan per cluster. Every instruction set must
    decode all of them bit for bit."""
    g = torch.Generator().manual_seed(41)
    cols = torch.arange(96)
    scale = torch.pow(2.0, (cols % 23 - 11).float()) * torch.where(cols % 3 == 0, -1.0, 1.0)
    a = ((1 + torch.rand(700, 96, generator=g)) * scale).float()
    b = ((1 + torch.rand(700, 96, generator=g)) * scale.flip(0)).float()
    c = torch.randint(0, 128, (700, 96), generator=g, dtype=torch.int8)
    # a's values with scattered outliers: words that do not participate send rows through
    # the step loops (whole rows of participating words take decode_full_row)
    e = torch.where(torch.rand(700, 96, generator=g) < 0.01, a * 1024, a)
    tables = [(ibp_embed.compress(x, word_bits=word_bits), x) for x in (a, b, c & 0x15, c & 0x55, e)]
    # rows of four magnitudes: a plan per cluster
    d = a * torch.pow(2.0, 8.0 * (torch.arange(700) % 4)).unsqueeze(1)
    tables.append((ibp_embed.compress(d, word_bits=word_bits, clusters=4), d))
    assert tables[-1][0].clusters > 1
    ids = torch.randint(0, 700, (300,), generator=g)
    for _ in every_isa():
        for _ in range(2):
            for t, x in tables:
                assert_decodes(t, x)
                assert_decodes(t, x[ids], ids)


@pytest.mark.parametrize("dim", [128, 136, 384])
@pytest.mark.parametrize("outliers", [0.0, 0.01])
@pytest.mark.parametrize("invariant_bits", [17, 18])
def test_uniform_plans_place_steps_by_arithmetic(invariant_bits, outliers, dim):
    """Where every 64-bit word of a table has one mask and one set of bit values, the
    x86-64-v3 decoders read one step's plan for a whole row and place its steps by
    arithmetic (unit_steps_uniform in native/ibp_units_avx2.inc): a full row's step s
    at s * (256 - 4c) bits, on a byte boundary only where c, a word's invariant bits,
    is even; any other row's from a popcount of its header, the steps with a word that
    does not participate decoded again after. Columns alternate between values in
    [1, 2) (sign and exponent invariant: 9 bits a float) and values of either sign
    (8 bits) or of one sign (9): c = 17 or 18; scattered outliers (another exponent)
    make words that do not participate. Rows of 136 floats end in a unit past the
    steps, rows of 384 take 48 steps (three of the header's 64-bit words). Every
    instruction set must decode the table bit for bit."""
    g = torch.Generator().manual_seed(47)
    w = 1 + torch.rand(900, dim, generator=g)
    if invariant_bits == 17:
        w[:, 1::2] *= torch.where(torch.rand(900, dim // 2, generator=g) < 0.5, -1.0, 1.0)
    w = torch.where(torch.rand(900, dim, generator=g) < outliers, w * 1024, w)
    t = ibp_embed.compress(w, word_bits=64)
    masks, bitvals = np.asarray(t.masks)[0], np.asarray(t.bitvals)[0]
    assert t.clusters == 1 and len(set(masks.tolist())) == 1 and len(set(bitvals.tolist())) == 1
    assert bin(int(masks[0])).count("1") == invariant_bits
    lengths = t.row_lengths()
    assert (lengths == lengths.min()).any() and (outliers == 0) == (len(np.unique(lengths)) == 1)
    ids = torch.randint(0, 900, (400,), generator=g)
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[ids], ids)


@pytest.mark.parametrize("dim", [16, 136, 160, 384])
def test_uniform_plans_decode_each_step_once_where_most_have_such_a_word(dim):
    """Where more than half of a block's steps (up to 16 steps of four 64-bit words)
    have a word that does not participate, the x86-64-v3 uniform loop decodes each step
    once by the general step instead of all packed and those again (decode_steps in
    native/ibp_units_avx2.inc). 10% outliers put such a word in about half the steps:
    blocks of either kind, in one row and from row to row, so that the running
    position crosses from one branch to the other. Rows of 16 floats are one block of
    two steps, 136 floats 17 steps (16 and 1, and a unit past them), 160 floats 20 (16
    and 4), 384 floats 48. Every instruction set must decode the table bit for bit."""
    g = torch.Generator().manual_seed(53)
    w = 1 + torch.rand(900, dim, generator=g)
    w = torch.where(torch.rand(900, dim, generator=g) < 0.1, w * 1024, w)
    t = ibp_embed.compress(w, word_bits=64)
    masks, bitvals = np.asarray(t.masks)[0], np.asarray(t.bitvals)[0]
    assert t.clusters == 1 and len(set(masks.tolist())) == 1 and len(set(bitvals.tolist())) == 1
    odd = (w.numpy().view(np.uint64) & masks) != bitvals  # words that do not participate
    steps = odd[:, : odd.shape[1] // 4 * 4].reshape(len(w), -1, 4).any(axis=2)
    most = np.concatenate([2 * steps[:, s:s + 16].sum(1, keepdims=True) > steps[:, s:s + 16].shape[1]
                           for s in range(0, steps.shape[1], 16)], axis=1)
    assert 0.2 < most.mean() < 0.8  # blocks of both kinds
    ids = torch.randint(0, 900, (400,), generator=g)
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[ids], ids)


@pytest.mark.parametrize("word_bits", [16, 32])
def test_uniform_plans_at_w16_and_w32(word_bits):
    """At W = 16 and 32 a uniform plan's steps (every unit of four words, or two, the
    same masks) read one step's plan for the whole row too (unit_steps_uniform):
    values in [1, 2) with scattered outliers, every instruction set bit for bit."""
    g = torch.Generator().manual_seed(53)
    w = 1 + torch.rand(900, 136, generator=g)
    w = torch.where(torch.rand(900, 136, generator=g) < 0.01, w * 1024, w)
    t = ibp_embed.compress(w, word_bits=word_bits)
    assert t.clusters == 1 and len(np.unique(t.row_lengths())) > 3
    ids = torch.randint(0, 900, (400,), generator=g)
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[ids], ids)


def bits(*runs: tuple[int, int]) -> int:
    """The mask of bit runs [a, b)."""
    return sum(((1 << (b - a)) - 1) << a for a, b in runs)


@pytest.mark.parametrize("case", ["fp16 pairs", "three runs and one", "four runs and none", "a word all invariant",
                                  "columns of their own"])
def test_w32_steps_decode_a_word_a_lane(case):
    """At W = 32 the x86-64-v3 decoders take a row's steps a word a 32-bit lane
    (decode_word_lanes in native/ibp_units_avx2.inc): each word's first bit from its
    nibble's and a byte of the step's plan, the deposit by the word's own segments.
    Even and odd columns have their own invariant bits and values: two runs a word
    (float16 pairs), three runs and one, four and none (five segments, the most a
    plan holds), a word whose every bit is invariant (fields of no bits); those plans
    are uniform (step 0's for every step). Columns of their own (five masks and
    values, a period that no step repeats) read each step's plan. 1% of words have an
    invariant bit flipped and do not participate. Rows of 130 words end in a unit past
    the steps. Every instruction set must decode the table bit for bit."""
    pattern = {"fp16 pairs": [bits((10, 14), (26, 30)), bits((10, 14), (26, 30))],
               "three runs and one": [bits((2, 3), (9, 12), (25, 31)), bits((28, 31))],
               "four runs and none": [bits((1, 3), (8, 10), (17, 19), (26, 30)), 0],
               "a word all invariant": [bits((27, 31)), bits((0, 32))],
               "columns of their own": [bits((23, 31)), bits((20, 31)), bits((4, 9), (26, 30)), bits((0, 16)),
                                        bits((12, 24))]}[case]
    rng = np.random.default_rng(59)
    words = rng.integers(0, 1 << 32, (900, 130), dtype=np.uint64)
    masks = np.array([pattern[c % len(pattern)] for c in range(130)], dtype=np.uint64)
    values = rng.integers(0, 1 << 32, len(pattern), dtype=np.uint64)[np.arange(130) % len(pattern)] & masks
    words = words & ~masks | values
    words ^= np.where(rng.random((900, 130)) < 0.01, masks & (0 - masks), 0).astype(np.uint64)  # lowest bit flipped
    w = torch.from_numpy(words.astype(np.uint32).view(np.int32))
    t = ibp_embed.compress(w, word_bits=32, threshold=0.95)  # the planted bits, no bits of chance
    assert t.clusters == 1 and np.array_equal(np.asarray(t.masks)[0], masks)
    assert np.array_equal(np.asarray(t.bitvals)[0], values) and len(np.unique(t.row_lengths())) > 3
    ids = torch.from_numpy(rng.integers(0, 900, 400))
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[ids], ids)


@pytest.mark.parametrize("out", [0.01, 0.6])
@pytest.mark.parametrize("case", ["fp16", "fp32 halves", "four runs and none", "a word all invariant",
                                  "columns of their own"])
def test_w16_steps_decode_a_word_a_lane(case, out):
    """At W = 16 the x86-64-v3 decoders take a row's steps a word a 16-bit lane
    (decode_word16_lanes in native/ibp_units_avx2.inc): each word's 16 bits from its
    byte by two multiplies, its first bit from a table by the header byte of its half
    (uniform plans) or by its unit's nibble (each step's plan: columns of their own,
    a period of five that no step repeats), the deposit by its own segments (up to
    five: four runs and none; a word all invariant has a field of no bits). The masks
    are given, not searched, so that 60% of words may not participate: their fields
    are 16 bits, and the words at a half's end start up to 14 bytes past its first.
    Rows of 134 words end in a unit and two words past the steps. Every instruction
    set must decode the table bit for bit."""
    from ibp_embed.codec import _Codebook, _encode_table

    pattern = {"fp16": [bits((10, 15))],
               "fp32 halves": [0, bits((7, 15))],
               "four runs and none": [bits((1, 3), (5, 7), (9, 11), (13, 15)), 0, 0, 0],
               "a word all invariant": [bits((12, 16)), bits((0, 16))],
               "columns of their own": [bits((10, 15)), bits((8, 15)), bits((12, 16)), bits((0, 8)),
                                        bits((4, 12))]}[case]
    rng = np.random.default_rng(61)
    n, m = 700, 134
    words = rng.integers(0, 1 << 16, (n, m), dtype=np.uint64)
    masks = np.array([pattern[c % len(pattern)] for c in range(m)], dtype=np.uint64)
    values = rng.integers(0, 1 << 16, len(pattern), dtype=np.uint64)[np.arange(m) % len(pattern)] & masks
    words = words & ~masks | values
    words ^= np.where(rng.random((n, m)) < out, masks & (0 - masks), 0).astype(np.uint64)  # lowest bit flipped
    w = torch.from_numpy(words.astype(np.uint16).view(np.int16))
    rows = w.numpy().view(np.uint8)
    t = _encode_table(rows, w.dtype, m, _Codebook(rows.shape[1], 16, masks[None], values[None]), False, False)
    assert len(np.unique(t.row_lengths())) > 3
    ids = torch.from_numpy(rng.integers(0, n, 400))
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[ids], ids)


def test_w16_steps_whose_fields_reach_past_their_first_64_bytes():
    """An AVX-512 W = 16 step cuts its fields from the 64 bytes at its first byte alone
    (one-source VPERMW) unless its bits, from its first bit's place in that byte, reach
    past them; then from 128 bytes (step_fields16 in native/ibp_avx512_fields.inc).
    Words of 2 invariant bits, 128 a row (four steps of 32): the first step has 1-3
    words that do not participate (2 bits more each, so the second starts 2-6 bits
    into its byte), the second 29-31 (506-510 bits, past 512 with the offset for some
    rows, not for others), the last two none; rows stay shorter than raw. Every
    instruction set must decode the table bit for bit."""
    from ibp_embed.codec import _Codebook, _encode_table

    rng = np.random.default_rng(67)
    n, m = 600, 128
    masks = np.full(m, bits((14, 16)), dtype=np.uint64)
    words = rng.integers(0, 1 << 14, (n, m), dtype=np.uint64)  # bits 14, 15 zero: participating
    for r in range(n):
        for lo, count in ((0, rng.integers(1, 4)), (32, rng.integers(29, 32))):
            words[r, lo + rng.choice(32, count, replace=False)] |= 1 << 14
    w = torch.from_numpy(words.astype(np.uint16).view(np.int16))
    rows = w.numpy().view(np.uint8)
    t = _encode_table(rows, w.dtype, m, _Codebook(rows.shape[1], 16, masks[None], np.zeros((1, m), np.uint64)),
                      False, False)
    assert (t.row_lengths() < t._row_bytes).all()
    ids = torch.from_numpy(rng.integers(0, n, 400))
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[ids], ids)


def test_tables_of_more_clusters_than_planned_steps():
    """Tables of more than 16 clusters have no planned steps on the x86-64-v3 kernels
    (UNIT_STEPS_MAX_CLUSTERS): their rows go unit by unit, and no step's plan may be
    read (make sanitize stopped at a read through NULL before 8f7c670). Rows of 21
    magnitudes with scattered outliers, every instruction set bit for bit."""
    g = torch.Generator().manual_seed(5)
    w = (1 + torch.rand(1000, 32, generator=g)) * 2.0 ** torch.randint(-40, 40, (1000, 1), generator=g).float()
    w = torch.where(torch.rand(1000, 32, generator=g) < 0.02, w * 1024, w)
    t = ibp_embed.compress(w, word_bits=64, clusters=64, allow_raw=False)
    assert t.clusters > 16
    for _ in every_isa():
        assert_decodes(t, w)


@pytest.mark.parametrize("case", ["fp32 halves", "fp32 halves, three runs a byte", "fp32 halves, an exponent a step",
                                  "fp32 halves, d120", "fp16 by column", "fp16, 20 lanes of one extra"])
def test_decode_plans_weigh_two_extras_at_w16(case):
    """At W = 16 the two halves of a float32 have their own invariant bits (values in
    [1, 2) with the mantissa's last bit clear: 9 in the high half, 1 in the low), so a
    step's lanes take two extras, and the AVX-512 decoders count each one's
    non-participating lanes apart (shared_excl16_two): in the packed loop (one
    cluster; its plan held in registers, with three runs of variable bits in a byte
    (bits 1 and 3 clear, not bit 0), or read step by step where each step's columns have their
    own exponent), also for rows from memory (a gather of 20 MB), in the step loop
    (rows of 7.5 steps, d120), and for fp16 columns of two magnitudes alternating (two
    steps a row). Where one of the two extras has more than 16 lanes (20 columns of 32
    in [1, 2), 12 in [1, 1.5)), the lanes' prefix sum decodes the step instead.
    Outliers in either half (another exponent, a cleared bit set) make words of both
    extras move the fields after them. Every instruction set must decode the tables bit
    for bit."""
    from io_cases import single_thread

    g = torch.Generator().manual_seed(81)
    n = 1200
    if case.startswith("fp32"):
        w = 1 + torch.rand(n, 120 if "d120" in case else 128, generator=g)
        if "exponent a step" in case:
            w *= torch.pow(2.0, (torch.arange(w.shape[1]) // 16).float())
        low = 0b1010 if "three runs" in case else 1
        if "three runs" in case:  # bit 0 variable (1 + rand rounds it to 0 more often than not)
            w.view(torch.int32)[:] ^= torch.randint(0, 2, w.shape, generator=g, dtype=torch.int32)
        w.view(torch.int32)[:] &= ~low
        w.view(torch.int32)[torch.rand(w.shape, generator=g) < 0.01] |= low
        w[torch.rand(w.shape, generator=g) < 0.01] *= 1024
        want = [[2 if "three runs" in case else 1, 9]] * 8
    else:
        split = 20 if "20 lanes" in case else None
        cols = torch.arange(64) % 32
        narrow = cols >= split if split else cols % 2 == 1  # in [1, 1.5): one invariant bit more
        w = (1 + torch.rand(n, 64, generator=g) * torch.where(narrow, 0.49, 0.99)).half()
        w[torch.rand(w.shape, generator=g) < 0.01] *= 64
        want = [[6, 7]] * 2
    t = ibp_embed.compress(w, word_bits=16)
    assert t.clusters == 1 and lane_extras(t) == want
    assert len(np.unique(t.row_lengths())) > 3  # words of both extras do not participate
    ids = torch.randint(0, n, (500,), generator=g)
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[ids], ids)
    if case == "fp32 halves":
        many = torch.randint(0, n, (40000,), generator=g)
        with single_thread():
            for _ in every_isa():
                assert_decodes(t, w[many], many)


@pytest.mark.parametrize("clusters", [1, 4])
def test_runs_of_full_rows_stop_at_other_rows(clusters):
    """Where nearly all rows have every word participating (here 97%), the AVX-512
    decoders take them in a loop of their own (decode_full_rows), which hands a row of
    another length or cluster, or with a word that does not participate, back to the
    general decoder and resumes after it. fp16 d64 rows, one exponent per cluster (a
    cluster per magnitude), an outlier in 3% of the rows; ids in order, in runs and
    scattered. Every instruction set must decode them bit for bit."""
    g = torch.Generator().manual_seed(53)
    n = 3000
    w = (1 + torch.rand(n, 64, generator=g)) * torch.pow(2.0, 4.0 * (torch.arange(n) % clusters)).unsqueeze(1)
    odd = torch.rand(n, generator=g) < 0.03
    w[odd, 5] /= 1024  # another exponent: its word does not participate
    w = w.half()
    t = ibp_embed.compress(w, word_bits=64, clusters=clusters)
    lengths = t.row_lengths()
    assert not t.is_raw and (t.clusters > 1) == (clusters > 1)
    assert 0.9 < np.mean(lengths == np.bincount(lengths).argmax()) < 1  # nearly all rows full, not all
    ids = torch.cat([torch.randint(0, n, (500,), generator=g), torch.arange(1000, 1400),
                     torch.nonzero(odd).flatten()[:20].repeat_interleave(3)])
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[ids], ids)


def test_full_row_fast_path_reads_the_header():
    """The AVX-512 decoders take a row whose every word participates straight from the
    plan's direct steps, recognised by its length and its header. A row with a word that
    does not participate can have the same length: here word 0 has one invariant bit
    (its top bit), so a row whose word 0 breaks it is 1 bit longer, which the last byte
    of a full row's bitstream (441 bits) has room for. Only the header tells them apart;
    every instruction set must decode both kinds bit for bit."""
    g = torch.Generator().manual_seed(47)
    w = torch.randint(0, 2**54, (600, 8), generator=g, dtype=torch.int64)
    w[:, 0] = torch.randint(0, 2**62, (600,), generator=g) * 2 + torch.randint(0, 2, (600,), generator=g)  # 63 bits
    odd = torch.arange(600) % 50 == 7
    w[odd, 0] |= -(2**63)  # the invariant top bit broken: word 0 does not participate
    t = ibp_embed.compress(w, word_bits=64, threshold=0.9)
    lengths = t.row_lengths()
    assert t.clusters == 1 and not t.is_raw and len(np.unique(lengths)) == 1  # same length, either kind
    ids = torch.randint(0, 600, (300,), generator=g)
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[ids], ids)


@pytest.mark.parametrize("word_bits", [16, 32, 64])
def test_full_rows_are_told_from_raw_rows_by_their_length(word_bits):
    """The AVX2 decoders too take a row whose every word participates straight to its
    steps (decode_full_row_steps), recognised by its length and its header. A raw row
    (stored as it is) whose first bytes, a header's place, are all ones must still come
    out as stored: fp16 d64 rows of one exponent, every fifth hundred rows random bits
    that start with 0xff bytes. Every instruction set must decode them bit for bit."""
    g = torch.Generator().manual_seed(67)
    n = 2000
    w = (1 + torch.rand(n, 64, generator=g)).half()
    raw_rows = torch.arange(n) % 500 == 3
    b = w.view(torch.uint8)
    b[raw_rows] = torch.randint(0, 256, b[raw_rows].shape, generator=g, dtype=torch.uint8)
    b[raw_rows, :8] = 0xFF
    t = ibp_embed.compress(w, word_bits=word_bits)
    lengths = t.row_lengths()
    assert t.clusters == 1 and np.all(lengths[raw_rows.numpy()] == 128) and np.all(lengths[~raw_rows.numpy()] < 128)
    ids = torch.cat([torch.arange(n), torch.nonzero(raw_rows).flatten().repeat(3)])
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[ids], ids)


def test_a_row_of_no_bytes_is_corrupt_where_no_row_is_stored_full():
    """A cluster whose full rows would be stored raw (R = 32 bytes, one invariant bit a
    word: 1 + 32 bytes encoded) has no full length (0). A row of no bytes, which only a
    table taken without validation can hold, must not pass for a full one (its header
    read from the next row's bytes, all ones): every instruction set reports it."""
    from ibp_embed._native import lib

    masks = np.full((1, 4), 1 << 63, dtype=np.uint64)
    payload = np.zeros(32 + lib.ibp_tail_pad(32, 64), dtype=np.uint8)
    payload[:32] = 0xFF
    t = ibp_embed.CompressedTable(shape=(2, 8), dtype=torch.float32, word_bits=64, masks=masks,
                                  bitvals=np.zeros((1, 4), dtype=np.uint64), block_base=np.zeros(1, dtype=np.uint64),
                                  rel=np.array([0, 0, 32], dtype=np.uint16), payload=payload, payload_bytes=32,
                                  validate=False)  # row 0: 0 bytes, row 1: raw
    for _ in every_isa():
        with pytest.raises(ibp_embed.FormatError):
            t.gather(torch.tensor([0]))
        assert_decodes(t, payload[:32].reshape(1, 32), torch.tensor([1]))


@pytest.mark.parametrize("cut", ["empty", "one byte", "header less one"])
def test_rows_shorter_than_their_header_are_corrupt_in_the_row_loops(cut):
    """A row cut shorter than its header (only a table taken without validation holds
    one) among rows of a one-mask fp32 table, which the row loops decode (x86-64-v3:
    step_rows_loop, AVX-512: decode_packed_rows): every instruction set reports it, alone
    and in a run of rows, and decodes the rows around it."""
    from ibp_embed._native import lib

    g = torch.Generator().manual_seed(67)
    w = 1 + torch.rand(200, 64, generator=g)
    w[torch.rand(w.shape, generator=g) < 0.01] *= 1024  # another exponent: the word does not participate
    t = ibp_embed.compress(w, word_bits=64)
    assert t.clusters == 1 and not t.is_raw
    hdr_bytes, bad = 64 * 4 // 8 // 8, 100
    starts, lengths = t._row_starts(), t.row_lengths()
    rows = [t._payload[int(s):int(s) + int(n)] for s, n in zip(starts, lengths)]
    rows[bad] = rows[bad][:{"empty": 0, "one byte": 1, "header less one": hdr_bytes - 1}[cut]]
    ends = np.cumsum([0] + [r.size for r in rows]).astype(np.uint64)
    block_base = ends[:-1:64].copy()
    rel = (ends - block_base[np.minimum(np.arange(ends.size) // 64, block_base.size - 1)]).astype(np.uint16)
    payload = np.zeros(int(ends[-1]) + lib.ibp_tail_pad(256, 64), dtype=np.uint8)
    payload[:int(ends[-1])] = np.concatenate(rows)
    cut_table = ibp_embed.CompressedTable(shape=t.shape, dtype=torch.float32, word_bits=64, masks=t.masks,
                                          bitvals=t.bitvals, block_base=block_base, rel=rel, payload=payload,
                                          payload_bytes=int(ends[-1]), validate=False)
    others = torch.cat([torch.arange(bad - 30, bad), torch.arange(bad + 1, bad + 30)])
    for _ in every_isa():
        for ids in (torch.tensor([bad]), torch.arange(bad - 30, bad + 30)):
            with pytest.raises(ibp_embed.FormatError):
                cut_table.gather(ids)
        assert_decodes(cut_table, w[others], others)


@pytest.mark.parametrize("direct", [False, True], ids=["general-steps", "direct-steps"])
@pytest.mark.parametrize("word_bits", [16, 32, 64])
@pytest.mark.parametrize("kind", ["float32", "float16", "int8-three-runs"])
def test_packed_rows_loop_copies_raw_and_hands_back_corrupt_rows(kind, word_bits, direct):
    """Rows of a one-cluster table whose steps all share one plan (every word the same
    mask, as in float tables), most with words that do not participate, are decoded in
    a loop of their own (decode_packed_rows, AVX-512): field offsets from one shared
    extra (W = 16 float32: each half's own), direct steps where a step's words all
    participate (in tables where 85% of the steps are such: fewer outliers), a deposit
    of two or three shifts (int8 bytes with variable bits 0, 2 and 4). It copies a raw
    row (random bits) as stored and goes on, and must hand back a row whose bits do not
    add up to its length (a flipped participation bit), for the general decoder to
    report. Every instruction set must decode the rest bit for bit."""
    g = torch.Generator().manual_seed(59)
    n = 1200
    if kind == "int8-three-runs":
        w = torch.randint(0, 128, (n, 128), generator=g, dtype=torch.int8) & 0x15
        odd = torch.rand(n, 128, generator=g) < (0.0015 if direct else 0.004)
        w[odd] |= 0x40  # a variable bit where the mask has an invariant one
    else:
        dtype = getattr(torch, kind)
        w = 1 + torch.rand(n, 128 if dtype == torch.float32 else 64, generator=g)
        odd = torch.rand(w.shape, generator=g) < (0.004 if direct else 0.02 if dtype == torch.float32 else 0.01)
        w[odd] *= 1024  # another exponent: the word does not participate
        w = w.to(dtype)
    raw_rows = torch.arange(n) % 97 == 13
    w.view(torch.uint8)[raw_rows] = torch.randint(0, 256, w.view(torch.uint8)[raw_rows].shape, generator=g,
                                                  dtype=torch.uint8)
    t = ibp_embed.compress(w, word_bits=word_bits)
    lengths = t.row_lengths()
    assert t.clusters == 1 and not t.is_raw and np.all(lengths[raw_rows.numpy()] == t._row_bytes)
    full = np.bincount(lengths).argmax()
    assert np.mean(lengths == full) < 0.9  # not decode_full_rows' tables
    if kind != "float32" or word_bits != 16:  # float32 halves at W = 16 have next to no direct steps
        assert (direct_step_share(t, w) >= DIRECT_MIN_SHARE) == direct
    ids = torch.cat([torch.arange(n), torch.randint(0, n, (700,), generator=g)])
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[ids], ids)
    # corrupt an encoded row in the middle of a run: flip the participation bit of the
    # word with the most invariant bits (one bit more or less may fit the last byte)
    bad = int(np.flatnonzero(~raw_rows.numpy())[n // 2])
    j = int(np.argmax([bin(int(m)).count("1") for m in np.asarray(t.masks)[0]]))
    t._payload[int(t._row_starts()[bad]) + j // 8] ^= 1 << (j % 8)
    for _ in every_isa():
        with pytest.raises(ibp_embed.FormatError):
            t.gather(torch.arange(bad - 20, bad + 20))
        others = torch.cat([torch.arange(bad - 20, bad), torch.arange(bad + 1, bad + 20)])
        assert_decodes(t, w[others], others)


@pytest.mark.parametrize("kind,word_bits", [("int8", 16), ("int8", 32), ("int8", 64), ("float16", 16),
                                            ("float16", 32)])  # float16 at 64: no header ends a row exactly
def test_packed_rows_loop_takes_raw_rows_by_their_length(word_bits, kind):
    """A raw row is told by its length alone: read as an encoded row, its first bytes
    (a header's place) can name words whose fields add up to that length too. Such a
    row, here crafted (int8 bytes whose top bit is invariant, so that a word's extra
    is W / 8 bits; float16 of one exponent, whose words the AVX2 decoders' word_rows_loop
    takes at W = 16 and 32), must come out as stored, from every instruction set."""
    g = torch.Generator().manual_seed(61)
    n, row_bytes = 800, 128
    if kind == "int8":
        w = torch.randint(0, 128, (n, row_bytes), generator=g, dtype=torch.int8)
        w[torch.rand(w.shape, generator=g) < 0.002] |= -128  # its word does not participate
    else:
        w = 1 + torch.rand(n, row_bytes // 2, generator=g)
        w[torch.rand(w.shape, generator=g) < 0.003] *= 1024  # another exponent: its word does not participate
        w = w.half()
    masks = np.asarray(ibp_embed.compress(w, word_bits=word_bits).masks)[0]
    n_words, hdr_bytes = masks.size, masks.size // 8
    # header bits that make the bitstream of a row of row_bytes exactly end its span
    bits, header = n_words * word_bits, 0
    for j, m in enumerate(masks):
        if -(-bits // 8) <= row_bytes - hdr_bytes:
            break
        bits -= bin(int(m)).count("1")
        header |= 1 << j
    assert -(-bits // 8) == row_bytes - hdr_bytes
    crafted = torch.randint(0, 256, (row_bytes,), generator=g, dtype=torch.uint8)
    crafted[:hdr_bytes] = torch.tensor(list(header.to_bytes(hdr_bytes, "little")), dtype=torch.uint8)
    w.view(torch.uint8)[n // 2] = crafted
    t = ibp_embed.compress(w, word_bits=word_bits)
    assert np.array_equal(np.asarray(t.masks)[0], masks) and t.row_lengths()[n // 2] == row_bytes
    assert direct_step_share(t, w) >= DIRECT_MIN_SHARE  # direct steps before and after it
    for _ in every_isa():
        assert_decodes(t, w[n // 2 - 10: n // 2 + 10], torch.arange(n // 2 - 10, n // 2 + 10))


@pytest.mark.parametrize("word_bits", [16, 32, 64])
def test_packed_rows_loop_with_a_plan_per_step(word_bits):
    """Packed rows whose steps each have their own plan (columns with their own
    invariant bits: int8 columns of 1 to 7 variable bits) read each step's plan as
    they go (at W = 16; at W = 32 and 64 a word's lanes have other extras, which the
    general step loops take); a step whose words all participate is cut straight from
    the bitstream at its planned bit, which, after a step of a bit count that is not a
    whole number of bytes, lies inside a byte (0.15% outliers: most rows and 85% of the
    steps or more have every word participating). Every instruction set must decode them bit for bit."""
    g = torch.Generator().manual_seed(67)
    n, dim = 1500, 128
    top = 2 ** (1 + torch.arange(dim) % 7)
    w = (torch.rand(n, dim, generator=g) * top).to(torch.int8)
    odd = torch.rand(n, dim, generator=g) < 0.0015
    w[odd] |= -128
    t = ibp_embed.compress(w, word_bits=word_bits)
    masks = np.asarray(t.masks)[0]
    lanes = 512 // word_bits
    step_bits = [sum(word_bits - bin(int(m)).count("1") for m in masks[s: s + lanes])
                 for s in range(0, masks.size, lanes)]
    assert t.clusters == 1 and len(set(step_bits)) > 1 and step_bits[0] % 8  # the next step starts mid-byte
    full = np.mean(t.row_lengths() == np.bincount(t.row_lengths()).argmax())
    assert 0.3 < full < 0.9  # direct steps tried, not decode_full_rows' tables
    assert direct_step_share(t, w) >= DIRECT_MIN_SHARE
    ids = torch.cat([torch.arange(n), torch.randint(0, n, (500,), generator=g)])
    for _ in every_isa():
        assert_decodes(t, w)
        assert_decodes(t, w[ids], ids)
