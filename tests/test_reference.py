"""libibp against the pure-Python reference of docs/format.md, byte for byte.

Every encoding check runs on both row-kernel paths: the portable extract/deposit
loops (ibp_bits.h) and the BMI2 pext/pdep path, when this CPU has it.
"""
from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ibp_embed
from ibp_embed import _native, codec, io
from ibp_embed import reference as ref
from ibp_embed._native import ffi, lib
from ibp_embed.errors import FormatError
from ibp_embed.table import CompressedTable

from helpers import assert_decodes

WORD_BITS = (16, 32, 64)


ISAS = _native.KERNEL_SETS
PATHS = tuple(_native.runnable_kernel_sets())  # the kernel sets this CPU runs


@contextlib.contextmanager
def kernel_path(name: str):
    """Force one row-kernel instruction set, restoring the previous one afterwards."""
    before = lib.ibp_isa()
    try:
        if lib.ibp_set_isa(ISAS[name]) != 0:
            pytest.skip(f"this CPU cannot run the {name} kernels")
        assert lib.ibp_isa() == ISAS[name]
        yield
    finally:
        lib.ibp_set_isa(before)


@pytest.fixture(params=list(ISAS))
def kernel(request):
    with kernel_path(request.param):
        yield request.param


def test_kernel_sets_are_checked_and_the_bmi2_ones_come_in_pairs():
    """ibp_set_isa takes the sets this CPU runs and refuses numbers outside them; a CPU
    with BMI2 runs both of its builds (with pdep and with the portable loops, picked on
    AMD Zen 1 and 2), and the set picked at load time is one of the sets it runs."""
    before = lib.ibp_isa()
    try:
        runs = [isa for isa in range(lib.IBP_ISA_COUNT) if lib.ibp_set_isa(isa) == 0]
        assert lib.IBP_ISA_GENERIC in runs and before in runs
        assert (lib.IBP_ISA_V3 in runs) == (lib.IBP_ISA_V3_NO_PDEP in runs)
        assert lib.IBP_ISA_AVX512 not in runs or lib.IBP_ISA_V3 in runs
        for bad in (-1, lib.IBP_ISA_COUNT, 255):
            assert lib.ibp_set_isa(bad) == lib.IBP_E_ARG
    finally:
        lib.ibp_set_isa(before)
    assert lib.ibp_isa() == before
    assert set(_native.KERNEL_SETS.values()) == set(range(lib.IBP_ISA_COUNT))


# ---------------------------------------------------------------- helpers

def p(a, ctype):
    return _native.ptr(a, ctype)


def low(w):
    return (1 << w) - 1


def random_codebook(rng: random.Random, k: int, r: int, w: int):
    """K clusters of random masks with densities from none to all bits; the padding
    bits of the last word are invariant zero in some clusters, random in others."""
    m = ref.n_words(r, w)
    pad_bits = (m * w // 8 - r) * 8
    pad_mask = (low(pad_bits) << (w - pad_bits)) if pad_bits else 0
    masks = np.zeros((k, m), np.uint64)
    bitvals = np.zeros((k, m), np.uint64)
    for c in range(k):
        for j in range(m):
            density = rng.choice([0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0])
            mask = sum(1 << b for b in range(w) if rng.random() < density)
            if j == m - 1 and c % 2 == 0:
                mask |= pad_mask
            bitval = rng.getrandbits(w) & mask
            if j == m - 1 and c % 2 == 0:
                bitval &= ~pad_mask
            masks[c, j], bitvals[c, j] = mask, bitval
    return masks, bitvals


def runs_codebook(rng: random.Random, k: int, r: int, w: int, max_runs: int = 2):
    """K clusters whose every mask is up to max_runs runs of invariant bits, as a
    float's exponent bits are: the planned deposits (by runs or segments) take them,
    where random masks fall back to the general one."""
    m = ref.n_words(r, w)
    masks = np.zeros((k, m), np.uint64)
    bitvals = np.zeros((k, m), np.uint64)
    for c in range(k):
        for j in range(m):
            mask = 0
            for _ in range(rng.randint(0, max_runs)):
                lo = rng.randrange(w)
                mask |= low(rng.randint(1, w - lo)) << lo
            masks[c, j], bitvals[c, j] = mask, rng.getrandbits(w) & mask
    return masks, bitvals


def rows_for(rng: random.Random, n: int, r: int, w: int, masks, bitvals, p_word=0.85, p_random=0.15):
    """Rows drawn near the clusters: each word takes its cluster's invariant bits with
    probability p_word; a fraction p_random of the rows is pure noise; some repeat."""
    k, m = masks.shape
    out = np.zeros((n, r), np.uint8)
    for i in range(n):
        if i and rng.random() < 0.1:
            out[i] = out[rng.randrange(i)]
            continue
        c = rng.randrange(k)
        words = []
        for j in range(m):
            word = rng.getrandbits(w)
            if rng.random() >= p_random and rng.random() < p_word:
                word = (word & ~int(masks[c, j])) | int(bitvals[c, j])
            words.append(word)
        raw = b"".join(x.to_bytes(w // 8, "little") for x in words)[:r]
        out[i] = np.frombuffer(raw, np.uint8)
    return out


def c_encode(rows: np.ndarray, w: int, masks, bitvals):
    """Encode with libibp directly (ibp_assign + ibp_encode) under a given codebook."""
    n, r = rows.shape
    book = codec._Codebook(r, w, masks, bitvals)
    ids, lengths = book.assign(rows)
    offsets = np.zeros(n + 1, np.uint64)
    offsets[1:] = np.cumsum(lengths, dtype=np.uint64)
    payload = np.zeros(int(offsets[-1]) + int(lib.ibp_tail_pad(r, w)), np.uint8)
    if n:
        rc = lib.ibp_encode(book.c, p(rows, "const uint8_t *"), n,
                            p(ids, "const uint8_t *"), p(offsets, "const uint64_t *"),
                            p(payload, "uint8_t *"))
        assert rc == lib.IBP_OK
    block_base, rel = codec.split_offsets(offsets, r)
    return ids, lengths, payload, int(offsets[-1]), block_base, rel


def make_table(n, r, w, masks, bitvals, block_base, rel, payload, payload_bytes, validate=True):
    return CompressedTable(shape=(n, r), dtype=torch.uint8, word_bits=w, masks=masks,
                           bitvals=bitvals, block_base=block_base, rel=rel, payload=payload,
                           payload_bytes=payload_bytes, validate=validate)


def check_against_reference(rows: np.ndarray, w: int, masks, bitvals, paths=PATHS):
    """C encoding == reference encoding, and each decodes the other's, on every path."""
    n, r = rows.shape
    want = ref.encode_table(rows, w, masks, bitvals)
    choice = [ref.choose(rows[i].tobytes(), w, masks, bitvals) for i in range(n)]
    for path in paths:
        with kernel_path(path):
            ids, lengths, payload, pb, block_base, rel = c_encode(rows, w, masks, bitvals)
            assert [int(x) for x in ids] == [c[0] for c in choice], path
            assert lengths.tolist() == want["lengths"].tolist(), path
            assert pb == len(want["payload"])
            assert payload[:pb].tobytes() == want["payload"], path
            assert not payload[pb:].any()
            assert block_base.dtype == np.uint64 and block_base.tolist() == want["block_base"].tolist()
            assert rel.dtype == want["rel"].dtype and rel.tolist() == want["rel"].tolist()
            # C decodes the C encoding; the reference decodes it too.
            t = make_table(n, r, w, masks, bitvals, block_base, rel, payload, pb)
            assert t.row_lengths().tolist() == want["lengths"].tolist()
            assert t.cluster_ids().tolist() == want["clusters"].tolist()
            assert_decodes(t, rows, msg=path)
            assert ref.decode_table(payload, block_base, rel, n, r, w, masks, bitvals).tobytes() \
                == rows.tobytes()
            # C decodes a table built from the reference's own arrays.
            ref_payload = np.frombuffer(want["payload"] + bytes(ref.tail_pad(r, w)), np.uint8)
            t2 = make_table(n, r, w, masks, bitvals, want["block_base"], want["rel"],
                            ref_payload, len(want["payload"]))
            assert_decodes(t2, rows, msg=path)
            if n:
                idx = np.random.default_rng(n).integers(0, n, size=2 * n)
                assert_decodes(t2, rows[idx], idx, msg=path)
    return want


# ---------------------------------------------------------------- reference self-checks

def test_reference_pext_pdep_small_cases():
    assert ref.pext(0b1011_0110, 0b1111_0000, 8) == 0b1011
    assert ref.pext(0b1011_0110, 0b0101_0101, 8) == 0b0110
    assert ref.pdep(0b0100, 0b0101_0101, 8) == 0b0001_0000
    assert ref.pdep(0b1011, 0b1111_0000, 8) == 0b1011_0000
    assert ref.pext(-1, ~0b1, 8) == 0b111_1111  # ~mask as Python ints stays within width
    rng = random.Random(1)
    for w in WORD_BITS:
        for _ in range(50):
            x, mask = rng.getrandbits(w), rng.getrandbits(w)
            assert ref.pdep(ref.pext(x, mask, w), mask, w) == x & mask
            assert ref.pext(x, mask, w) < 1 << ref.popcount(mask)


def test_reference_row_layout_by_hand():
    # W=16, R=3 (M=2, last word padded), K=1. Word 0 = 0x1234, word 1 = 0x0056.
    masks = np.array([[0xFF00, 0xFF00]], np.uint64)
    bitvals = np.array([[0x1200, 0x0000]], np.uint64)
    row = bytes([0x34, 0x12, 0x56])
    enc = ref.encode_row(row, 16, masks, bitvals, 0)
    # participation byte 0b11, then 8 + 8 variable bits: 0x34, 0x56
    assert enc == bytes([0b11, 0x34, 0x56])
    assert ref.choose(row, 16, masks, bitvals) == (0, 3)  # E == R: stored raw
    assert ref.decode_row(enc, 3, 16, masks, bitvals) == enc  # L == R reads as raw
    row4 = row + b"\x00"  # R=4: the same encoding is now shorter than the row
    assert ref.encode_row(row4, 16, masks, bitvals, 0) == enc
    assert ref.choose(row4, 16, masks, bitvals) == (0, 3)
    assert ref.decode_row(enc, 4, 16, masks, bitvals) == row4
    # Non-participating word 0 (0x1334): whole 16 bits, then word 1's 8 bits.
    row2 = bytes([0x34, 0x13, 0x56])
    assert ref.encode_row(row2, 16, masks, bitvals, 0) == bytes([0b10, 0x34, 0x13, 0x56])
    # K=2: a cluster id byte first.
    m2, v2 = np.concatenate([masks, masks]), np.concatenate([bitvals, bitvals])
    assert ref.encode_row(row, 16, m2, v2, 1) == bytes([1, 0b11, 0x34, 0x56])
    assert ref.choose(row, 16, m2, v2) == (0, 3)


def test_reference_crc32c():
    assert ref.crc32c(b"123456789") == 0xE3069283
    assert ref.crc32c(b"") == 0


# ---------------------------------------------------------------- C versus reference

@pytest.mark.parametrize("w", WORD_BITS)
@pytest.mark.parametrize("r", [1, 3, 6, 13, 24])
@pytest.mark.parametrize("k", [1, 3])
def test_codebook_encoding_matches_reference(w, r, k):
    rng = random.Random(w * 1000 + r * 10 + k)
    masks, bitvals = random_codebook(rng, k, r, w)
    rows = rows_for(rng, 40, r, w, masks, bitvals)
    want = check_against_reference(rows, w, masks, bitvals)
    if r >= 13:  # big enough rows: some are encoded, and K > 1 is really used
        enc = want["clusters"][want["clusters"] >= 0]
        assert enc.size > 0
        if k > 1:
            assert np.unique(enc).size > 1


@pytest.mark.parametrize("w", WORD_BITS)
def test_tie_goes_to_lowest_cluster(w):
    rng = random.Random(w)
    r = 20
    masks, bitvals = random_codebook(rng, 2, r, w)
    # Cluster 2 duplicates cluster 0 and cluster 3 duplicates cluster 1: never chosen.
    masks = np.concatenate([masks, masks])
    bitvals = np.concatenate([bitvals, bitvals])
    rows = rows_for(rng, 30, r, w, masks[:2], bitvals[:2], p_random=0.0)
    want = check_against_reference(rows, w, masks, bitvals)
    enc = want["clusters"][want["clusters"] >= 0]
    assert set(enc.tolist()) == {0, 1}


@pytest.mark.parametrize("w", WORD_BITS)
def test_mask_patterns_through_both_paths(w):
    """Masks exercising both branches of the portable extract/deposit (few invariant bits,
    few variable bits, exactly half), all bits, no bits, single low/high bits."""
    half = low(w // 2)
    patterns = [0, low(w), 1, 1 << (w - 1), 0x5555555555555555 & low(w), half, half << (w // 2),
                low(w) ^ 1, low(w) ^ (1 << (w - 1)), low(w - 3) << 3, 1 | 1 << (w - 1),
                low(3), low(w) & ~(0xF0F0 << (w // 4))]
    for q in (0, 1, 7, 8, 9, w // 2 - 1, w // 2, w - 2):  # one variable / one invariant bit
        patterns += [low(w) ^ (1 << q), 1 << q]
    m = len(patterns)
    r = m * w // 8 - 1  # last word padded by one byte
    rng = random.Random(w + 7)
    masks = np.array([patterns], np.uint64)
    bitvals = np.array([[rng.getrandbits(w) & q for q in patterns]], np.uint64)
    # Pad byte bits of the last word must be invariant zero to participate: clear them.
    top = 0xFF << (w - 8)
    bitvals[0, -1] = int(bitvals[0, -1]) & ~top
    rows = rows_for(rng, 30, r, w, masks, bitvals, p_word=0.9, p_random=0.1)
    want = check_against_reference(rows, w, masks, bitvals)
    assert (want["lengths"] < r).sum() > 10


@pytest.mark.parametrize("w", WORD_BITS)
def test_many_rows_offsets_index(w):
    """N > 64: several offset blocks, rows of mixed lengths (some raw)."""
    rng = random.Random(w + 99)
    r = 7
    masks, bitvals = random_codebook(rng, 2, r, w)
    rows = rows_for(rng, 200, r, w, masks, bitvals, p_random=0.3)
    want = check_against_reference(rows, w, masks, bitvals)
    assert want["block_base"].size == 4 and want["rel"].dtype == np.uint16
    assert (want["lengths"] == r).any() and (want["lengths"] < r).any()


def test_wide_rows_use_u32_rel():
    """63 * R > 65535: rel entries are u32 (incompressible rows make them exceed 65535)."""
    r, w, n = 1041, 64, 66
    rng = np.random.default_rng(5)
    rows = rng.integers(0, 256, size=(n, r), dtype=np.uint8)
    rows[64:, :800] = 0  # rows of block 1 encode; block 0 is all raw, so rel[63] = 63 * R
    masks = np.zeros((1, ref.n_words(r, w)), np.uint64)
    masks[0, :100] = low(w)
    bitvals = np.zeros_like(masks)
    want = check_against_reference(rows, w, masks, bitvals, paths=PATHS[-1:])
    assert want["rel"].dtype == np.uint32 and int(want["rel"].max()) > 65535
    assert int(lib.ibp_rel_bytes(r)) == 4 and int(lib.ibp_rel_bytes(1040)) == 2


@pytest.mark.parametrize("w", WORD_BITS)
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("dtype,dim", [(torch.float16, 3), (torch.float32, 5), (torch.bfloat16, 8),
                                       (torch.int8, 13), (torch.int64, 2)])
def test_compress_matches_reference(kernel, w, k, dtype, dim):
    """The public encoder's output equals the reference encoding under its own codebook,
    and the table it stores by default (raw or not) the reference's choice."""
    rng = random.Random(dim * 31 + w + k)
    r = dim * dtype.itemsize
    masks, bitvals = random_codebook(rng, 3, r, w)
    rows = rows_for(rng, 50, r, w, masks, bitvals, p_random=0.2)
    weights = torch.from_numpy(rows).view(dtype).reshape(50, dim)
    t = ibp_embed.compress(weights, word_bits=w, clusters=k, allow_raw=False)
    stored, want = ibp_embed.compress(weights, word_bits=w, clusters=k), ref.store_table(rows, w, t._masks, t._bitvals)
    assert stored.clusters == want["n_clusters"] and stored.nbytes == min(t.nbytes, rows.size)
    assert stored._payload[:stored._payload_bytes].tobytes() == want["payload"]
    assert t.word_bits == w and t.clusters <= k
    want = ref.encode_table(rows, w, t._masks, t._bitvals)
    pb = t._payload_bytes
    assert pb == len(want["payload"])
    assert t._payload[:pb].tobytes() == want["payload"]
    assert t._payload.size == pb + ref.tail_pad(r, w) and not t._payload[pb:].any()
    assert t._block_base.tolist() == want["block_base"].tolist()
    assert t._rel.dtype == want["rel"].dtype and t._rel.tolist() == want["rel"].tolist()
    assert t.row_lengths().tolist() == want["lengths"].tolist()
    assert t.cluster_ids().tolist() == want["clusters"].tolist()
    dec = ref.decode_table(t._payload, t._block_base, t._rel, 50, r, w, t._masks, t._bitvals)
    assert dec.tobytes() == rows.tobytes()
    assert t.decompress().view(torch.uint8).numpy().tobytes() == rows.tobytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 30), r=st.integers(1, 20), w=st.sampled_from(WORD_BITS),
       k=st.integers(1, 4), seed=st.integers(0, 2**32 - 1),
       p_word=st.floats(0.0, 1.0), p_random=st.floats(0.0, 1.0))
def test_property_random_codebooks(n, r, w, k, seed, p_word, p_random):
    rng = random.Random(seed)
    masks, bitvals = random_codebook(rng, k, r, w)
    rows = rows_for(rng, n, r, w, masks, bitvals, p_word=p_word, p_random=p_random)
    check_against_reference(rows, w, masks, bitvals)


@settings(max_examples=90, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 12), r=st.integers(56, 300), w=st.sampled_from(WORD_BITS), k=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1), p_word=st.floats(0.0, 1.0))
def test_property_long_rows(n, r, w, k, seed, p_word):
    """Rows of 7 to 150 words: the AVX-512 decoders' steps of 8 (W = 64), 16 (W = 32) and
    32 (W = 16) words, then their scalar tails, on every path."""
    rng = random.Random(seed)
    masks, bitvals = random_codebook(rng, k, r, w)
    rows = rows_for(rng, n, r, w, masks, bitvals, p_word=p_word, p_random=0.1)
    check_against_reference(rows, w, masks, bitvals)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 12), r=st.integers(32, 300), w=st.sampled_from(WORD_BITS), k=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1), p_word=st.floats(0.5, 1.0))
def test_property_few_runs(n, r, w, k, seed, p_word):
    """Masks of a run or two a word (floats), rows with most words participating: the
    planned deposits and the steps of four units (the AVX2 kernels, with pdep or without),
    with every mix of participating words, full rows among them (p_word = 1)."""
    rng = random.Random(seed)
    masks, bitvals = runs_codebook(rng, k, r, w)
    rows = rows_for(rng, n, r, w, masks, bitvals, p_word=p_word, p_random=0.05)
    check_against_reference(rows, w, masks, bitvals)


@pytest.mark.parametrize("w", WORD_BITS)
def test_packed_steps(w):
    """Words with a run of invariant bits, enough that every 64-bit unit keeps 7 (as
    floats' exponents do), and rows with most words participating: the AVX2 steps
    load such a step's fields with one shuffle (its packed load) in full rows, and
    at W = 64 in others too, at every bit a step can start at; a word in ten without
    invariant bits leaves its step to the general loads."""
    rng = random.Random(7 * w)
    m = ref.n_words(384, w)
    masks, bitvals = np.zeros((2, m), np.uint64), np.zeros((2, m), np.uint64)
    least = -(-7 // (64 // w))  # per word, so that a unit has 7
    for c in range(2):
        for j in range(m):
            if rng.random() < 0.1:
                continue
            n = rng.randint(least, 2 * least)
            mask = low(n) << rng.randrange(w - n + 1)
            masks[c, j], bitvals[c, j] = mask, rng.getrandbits(w) & mask
    rows = rows_for(rng, 200, 384, w, masks, bitvals, p_word=0.99, p_random=0.0)
    check_against_reference(rows, w, masks, bitvals)


@pytest.mark.parametrize("w", WORD_BITS)
def test_rows_of_more_than_64_steps_of_header(w):
    """Rows of 1,100 bytes (138 to 550 words): the step decoders read the header 64
    bits at a time, so a row past 64 words (W = 64) takes a second read."""
    rng = random.Random(100 + w)
    masks, bitvals = runs_codebook(rng, 2, 1100, w)
    rows = rows_for(rng, 10, 1100, w, masks, bitvals, p_word=0.97, p_random=0.0)
    check_against_reference(rows, w, masks, bitvals)


@pytest.mark.parametrize("w", WORD_BITS)
def test_more_clusters_than_a_plan_holds(w):
    """20 clusters: past the AVX-512 plan's and the AVX2 steps' 16, rows decode
    without them."""
    rng = random.Random(w)
    masks, bitvals = runs_codebook(rng, 20, 96, w)
    rows = rows_for(rng, 60, 96, w, masks, bitvals, p_word=0.95, p_random=0.0)
    want = check_against_reference(rows, w, masks, bitvals)
    assert np.unique(want["clusters"][want["clusters"] >= 0]).size > 16


# ---------------------------------------------------------------- validity

@pytest.mark.parametrize("w", WORD_BITS)
def test_corrupt_participation_bits_agree(kernel, w):
    """Flip each participation bit of encoded rows: C raises FormatError exactly when the
    reference finds the bitstream length inconsistent, and otherwise decodes the same bytes."""
    rng = random.Random(w + 3)
    r = 5 * w // 8 - 1
    masks, bitvals = random_codebook(rng, 2, r, w)
    rows = rows_for(rng, 12, r, w, masks, bitvals, p_random=0.0)
    want = ref.encode_table(rows, w, masks, bitvals)
    s = ref.row_starts(want["block_base"], want["rel"], rows.shape[0])
    m = ref.n_words(r, w)
    n_errors = n_ok = 0
    for i in np.flatnonzero(want["lengths"] < r):
        for j in range(m):
            payload = bytearray(want["payload"] + bytes(ref.tail_pad(r, w)))
            payload[s[i] + 1 + j // 8] ^= 1 << (j % 8)  # K > 1: byte 0 is the cluster id
            arr = np.frombuffer(bytes(payload), np.uint8)
            t = make_table(rows.shape[0], r, w, masks, bitvals, want["block_base"], want["rel"],
                           arr, len(want["payload"]))
            try:
                expect = ref.decode_row(bytes(payload[s[i]:s[i + 1]]), r, w, masks, bitvals)
            except ValueError:
                with pytest.raises(FormatError):
                    t.gather([int(i)])
                n_errors += 1
            else:
                assert t.gather([int(i)]).numpy().tobytes() == expect
                n_ok += 1
    assert n_errors > 0 and n_ok > 0


def test_structural_validation_rejects_bad_cluster_id():
    rng = random.Random(0)
    r, w = 16, 32
    masks, bitvals = random_codebook(rng, 2, r, w)
    rows = rows_for(rng, 10, r, w, masks, bitvals, p_random=0.0)
    want = ref.encode_table(rows, w, masks, bitvals)
    i = int(np.flatnonzero(want["lengths"] < r)[0])
    s = ref.row_starts(want["block_base"], want["rel"], 10)
    payload = bytearray(want["payload"] + bytes(ref.tail_pad(r, w)))
    payload[s[i]] = 2  # cluster id >= K
    with pytest.raises(ValueError):
        ref.decode_row(bytes(payload[s[i]:s[i + 1]]), r, w, masks, bitvals)
    with pytest.raises(FormatError):
        make_table(10, r, w, masks, bitvals, want["block_base"], want["rel"],
                   np.frombuffer(bytes(payload), np.uint8), len(want["payload"]))


# ---------------------------------------------------------------- statistics

def _sel_args(sel):
    if sel is None:
        return ffi.NULL, 0, None
    a = np.ascontiguousarray(sel, dtype=np.int64)
    return p(a, "const int64_t *"), a.size, a


@pytest.mark.parametrize("w", WORD_BITS)
@pytest.mark.parametrize("r", [1, 5, 16])
@pytest.mark.parametrize("use_sel", [False, True])
def test_bit_counts_match_reference(w, r, use_sel):
    rng = random.Random(r * w)
    masks, bitvals = random_codebook(rng, 2, r, w)
    rows = rows_for(rng, 37, r, w, masks, bitvals)
    sel = [rng.randrange(37) for _ in range(25)] + [3, 3, 3] if use_sel else None
    sel_p, n_sel, keep = _sel_args(sel)
    counts = np.full((ref.n_words(r, w), w), 12345, np.uint64)
    rc = lib.ibp_bit_counts(p(rows, "const uint8_t *"), 37, r, w, sel_p, n_sel, p(counts, "uint64_t *"))
    assert rc == lib.IBP_OK
    want = ref.bit_counts(rows, w, sel)
    assert counts.tolist() == want.tolist()
    assert want.sum() > 0


def test_bit_counts_above_parallel_threshold():
    rng = np.random.default_rng(2)
    rows = rng.integers(0, 256, size=(5000, 3), dtype=np.uint8)
    counts = np.zeros((2, 16), np.uint64)
    assert lib.ibp_bit_counts(p(rows, "const uint8_t *"), 5000, 3, 16, ffi.NULL, 0,
                              p(counts, "uint64_t *")) == lib.IBP_OK
    bits = np.unpackbits(np.concatenate([rows, np.zeros((5000, 1), np.uint8)], 1), axis=1,
                         bitorder="little").reshape(5000, 2, 16)
    assert counts.tolist() == bits.sum(0).tolist()


@pytest.mark.parametrize("w", WORD_BITS)
@pytest.mark.parametrize("r", [3, 10])
@pytest.mark.parametrize("use_sel", [False, True])
def test_word_costs_match_reference(w, r, use_sel):
    rng = random.Random(r + w)
    masks, bitvals = random_codebook(rng, 5, r, w)
    rows = rows_for(rng, 29, r, w, masks[:2], bitvals[:2])
    sel = [rng.randrange(29) for _ in range(20)] + [0, 0] if use_sel else None
    sel_p, n_sel, keep = _sel_args(sel)
    costs = np.full(masks.shape, 7, np.uint64)
    rc = lib.ibp_word_costs(p(rows, "const uint8_t *"), 29, r, w, sel_p, n_sel,
                            p(masks, "const uint64_t *"), p(bitvals, "const uint64_t *"),
                            masks.shape[0], p(costs, "uint64_t *"))
    assert rc == lib.IBP_OK
    want = ref.word_costs(rows, w, masks, bitvals, sel)
    assert costs.tolist() == want.tolist()
    n_sel_rows = 29 if sel is None else len(sel)
    assert (want <= n_sel_rows * w).all() and (want < n_sel_rows * w).any()


def test_word_costs_above_parallel_threshold():
    rng = random.Random(11)
    r, w = 6, 32
    masks, bitvals = random_codebook(rng, 3, r, w)
    rows = rows_for(rng, 1500, r, w, masks, bitvals)
    costs = np.zeros(masks.shape, np.uint64)
    assert lib.ibp_word_costs(p(rows, "const uint8_t *"), 1500, r, w, ffi.NULL, 0,
                              p(masks, "const uint64_t *"), p(bitvals, "const uint64_t *"),
                              3, p(costs, "uint64_t *")) == lib.IBP_OK
    # Vectorised reference on whole columns (the loop reference is too slow here).
    padded = np.zeros((1500, 8), np.uint8)
    padded[:, :r] = rows
    words = padded.view(np.uint32)
    for c in range(3):
        for j in range(2):
            part = (words[:, j] & np.uint32(masks[c, j])) == np.uint32(bitvals[c, j])
            vb = w - ref.popcount(int(masks[c, j]))
            assert int(costs[c, j]) == int(part.sum()) * vb + int((~part).sum()) * w


def test_tail_pad_and_rel_bytes_match_spec():
    for r in [1, 2, 3, 7, 8, 9, 100, 1040, 1041, 4096]:
        for w in WORD_BITS:
            assert int(lib.ibp_tail_pad(r, w)) == ref.tail_pad(r, w)
        assert int(lib.ibp_rel_bytes(r)) == np.dtype(ref.rel_dtype(r)).itemsize


# ---------------------------------------------------------------- CRC-32C

def test_crc32c_check_value():
    assert io.crc32c(b"123456789") == 0xE3069283
    assert io.crc32c(b"") == 0


def test_crc32c_matches_pure_python():
    rng = np.random.default_rng(3)
    for n in [1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert io.crc32c(data) == ref.crc32c(data), n
        # Chaining: crc of a + b == crc of b continued from crc of a.
        cut = n // 3
        assert io.crc32c(data[cut:], io.crc32c(data[:cut])) == ref.crc32c(data)
        assert ref.crc32c(data[cut:], ref.crc32c(data[:cut])) == ref.crc32c(data)
    arr = rng.integers(0, 2**63, 10, dtype=np.int64)
    assert io.crc32c(arr) == ref.crc32c(arr.tobytes())
