"""A slow, obviously-right reference of the IBP format (docs/format.md, version 2).

Plain Python integers and bit loops, no tricks: the tests hold libibp against this
byte for byte. Section names below refer to docs/format.md. Nothing here is fast;
use it on tables of a few hundred rows at most.
"""
from __future__ import annotations

import numpy as np


def n_words(row_bytes: int, word_bits: int) -> int:
    """M = ceil(R / B), B = W / 8 ("Table and words")."""
    return -(-row_bytes // (word_bits // 8))


def row_words(row: bytes, word_bits: int) -> list[int]:
    """The M little-endian words of a row, zero-padded to M * B bytes ("Table and words")."""
    b = word_bits // 8
    row = bytes(row)
    padded = row + bytes(n_words(len(row), word_bits) * b - len(row))
    return [int.from_bytes(padded[j * b:(j + 1) * b], "little") for j in range(len(padded) // b)]


def pext(x: int, mask: int, width: int) -> int:
    """The bits of x at the set positions of mask (within width bits), packed from bit 0."""
    out, k = 0, 0
    for p in range(width):
        if mask >> p & 1:
            out |= (x >> p & 1) << k
            k += 1
    return out


def pdep(x: int, mask: int, width: int) -> int:
    """Inverse of pext: the low bits of x spread over the set positions of mask."""
    out, k = 0, 0
    for p in range(width):
        if mask >> p & 1:
            out |= (x >> k & 1) << p
            k += 1
    return out


def popcount(x: int) -> int:
    return bin(x).count("1")


def encode_row(row: bytes, word_bits: int, masks, bitvals, k: int) -> bytes:
    """Row encoded under cluster k ("Row encoding"), whatever its length (raw or not)."""
    w_, big_k = word_bits, len(masks)
    words = row_words(row, w_)
    m = len(words)
    part = [0] * ((m + 7) // 8)
    bits: list[int] = []  # the bitstream, one entry per bit, LSB-first
    for j, word in enumerate(words):
        mask, bitval = int(masks[k][j]), int(bitvals[k][j])
        if word & mask == bitval:
            part[j // 8] |= 1 << (j % 8)
            field, n = pext(word, ~mask, w_), w_ - popcount(mask)
        else:
            field, n = word, w_
        bits += [field >> i & 1 for i in range(n)]
    stream = bytearray((len(bits) + 7) // 8)
    for p, bit in enumerate(bits):
        stream[p // 8] |= bit << (p % 8)
    return (bytes([k]) if big_k > 1 else b"") + bytes(part) + bytes(stream)


def choose(row: bytes, word_bits: int, masks, bitvals) -> tuple[int, int]:
    """("Cluster choice", "Raw rows") -> (k with the smallest E, lowest on ties; stored length)."""
    sizes = [len(encode_row(row, word_bits, masks, bitvals, k)) for k in range(len(masks))]
    k = sizes.index(min(sizes))
    return k, min(sizes[k], len(row))


def rel_dtype(row_bytes: int):
    """u16 when 63 * R <= 65535, else u32 ("Payload and offsets index")."""
    return np.uint16 if 63 * row_bytes <= 65535 else np.uint32


def tail_pad(row_bytes: int, word_bits: int) -> int:
    """Zero bytes after the payload ("Payload and offsets index")."""
    b = word_bits // 8
    return -(-row_bytes // b) * b + -(-row_bytes // 8) + 136


def encode_table(rows: np.ndarray, word_bits: int, masks, bitvals) -> dict:
    """Encode uint8 rows [N, R]. Returns payload (bytes, no tail pad), block_base (u64),
    rel (u16/u32), lengths (stored bytes per row) and clusters (chosen k per row, -1 raw)."""
    n, r = rows.shape
    chunks, lengths, clusters = [], [], []
    for i in range(n):
        row = rows[i].tobytes()
        k, length = choose(row, word_bits, masks, bitvals)
        chunks.append(row if length == r else encode_row(row, word_bits, masks, bitvals, k))
        lengths.append(length)
        clusters.append(-1 if length == r else k)
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    block_base = np.array([starts[64 * b] for b in range(n // 64 + 1)], dtype=np.uint64)
    rel = np.array([starts[i] - starts[i & ~63] for i in range(n + 1)], dtype=rel_dtype(r))
    return {"payload": b"".join(chunks), "block_base": block_base, "rel": rel,
            "lengths": np.array(lengths, dtype=np.int64), "clusters": np.array(clusters, np.int64)}


def table_nbytes(payload_bytes: int, n_rows: int, row_bytes: int, word_bits: int, n_clusters: int) -> int:
    """nbytes of a table ("Size"): a raw table (K = 0) is its rows, an encoded one adds
    its tail pad, offsets index and masks."""
    if n_clusters == 0:
        return n_rows * row_bytes
    index = 8 * (n_rows // 64 + 1) + np.dtype(rel_dtype(row_bytes)).itemsize * (n_rows + 1)
    masks = 2 * n_clusters * n_words(row_bytes, word_bits) * (word_bits // 8)
    return payload_bytes + tail_pad(row_bytes, word_bits) + index + masks


def store_table(rows: np.ndarray, word_bits: int, masks, bitvals) -> dict:
    """encode_table's result, or the raw table ("Raw tables": clusters 0, payload = the
    rows, no index) when the encoded table's nbytes would be at least N * R."""
    n, r = rows.shape
    enc = encode_table(rows, word_bits, masks, bitvals)
    if table_nbytes(len(enc["payload"]), n, r, word_bits, len(masks)) < n * r:
        return dict(enc, n_clusters=len(masks))
    return {"payload": rows.tobytes(), "block_base": np.zeros(0, np.uint64), "rel": np.zeros(0, rel_dtype(r)),
            "lengths": np.full(n, r, np.int64), "clusters": np.full(n, -1, np.int64), "n_clusters": 0}


def row_starts(block_base, rel, n_rows: int, row_bytes: int | None = None) -> list[int]:
    """start(i) = block_base[i >> 6] + rel[i] for 0 <= i <= N ("Payload and offsets index");
    i * R in a raw table (pass row_bytes)."""
    if row_bytes is not None:
        return [i * row_bytes for i in range(n_rows + 1)]
    return [int(block_base[i >> 6]) + int(rel[i]) for i in range(n_rows + 1)]


def decode_row(stored: bytes, row_bytes: int, word_bits: int, masks, bitvals) -> bytes:
    """Decode one stored row ("Row encoding", "Validity"); ValueError when inconsistent."""
    if len(stored) == row_bytes:
        return bytes(stored)
    w_, big_k = word_bits, len(masks)
    m = n_words(row_bytes, w_)
    hdr = (big_k > 1) + (m + 7) // 8
    if len(stored) > row_bytes or len(stored) < hdr:
        raise ValueError(f"bad stored length {len(stored)}")
    k = stored[0] if big_k > 1 else 0
    if k >= big_k:
        raise ValueError(f"cluster id {k} >= {big_k}")
    part, stream = stored[big_k > 1:hdr], stored[hdr:]
    pos, out = 0, b""
    for j in range(m):
        mask, bitval = int(masks[k][j]), int(bitvals[k][j])
        participating = part[j // 8] >> (j % 8) & 1
        n = w_ - popcount(mask) if participating else w_
        if (pos + n + 7) // 8 > len(stream):
            raise ValueError("bitstream shorter than its participation bits say")
        field = sum((stream[(pos + i) // 8] >> ((pos + i) % 8) & 1) << i for i in range(n))
        pos += n
        word = pdep(field, ~mask, w_) | bitval if participating else field
        out += word.to_bytes(w_ // 8, "little")
    if (pos + 7) // 8 != len(stream):
        raise ValueError("bitstream longer than its participation bits say")
    return out[:row_bytes]


def decode_table(payload: bytes, block_base, rel, n_rows: int, row_bytes: int, word_bits: int,
                 masks, bitvals) -> np.ndarray:
    """All rows of a table as uint8 [N, R] (no masks: a raw table)."""
    s = row_starts(block_base, rel, n_rows, row_bytes if len(masks) == 0 else None)
    out = np.zeros((n_rows, row_bytes), dtype=np.uint8)
    for i in range(n_rows):
        stored = bytes(payload[s[i]:s[i + 1]])
        out[i] = np.frombuffer(decode_row(stored, row_bytes, word_bits, masks, bitvals), np.uint8)
    return out


def bit_counts(rows: np.ndarray, word_bits: int, sel=None) -> np.ndarray:
    """counts[j][b]: how many selected rows (all when sel is None; repeats count) have
    bit b of word j set; as native ibp_bit_counts."""
    sel = range(rows.shape[0]) if sel is None else sel
    counts = np.zeros((n_words(rows.shape[1], word_bits), word_bits), dtype=np.uint64)
    for i in sel:
        for j, word in enumerate(row_words(rows[int(i)].tobytes(), word_bits)):
            for b in range(word_bits):
                counts[j, b] += word >> b & 1
    return counts


def word_costs(rows: np.ndarray, word_bits: int, cand_masks, cand_bitvals, sel=None) -> np.ndarray:
    """costs[c][j]: bitstream bits word j costs summed over the selected rows under
    candidate c (vbits when it participates, else W); as native ibp_word_costs."""
    sel = range(rows.shape[0]) if sel is None else sel
    n_cand, m = np.shape(cand_masks)
    costs = np.zeros((n_cand, m), dtype=np.uint64)
    for i in sel:
        words = row_words(rows[int(i)].tobytes(), word_bits)
        for c in range(n_cand):
            for j, word in enumerate(words):
                mask, bitval = int(cand_masks[c][j]), int(cand_bitvals[c][j])
                costs[c, j] += word_bits - popcount(mask) if word & mask == bitval else word_bits
    return costs


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit (".ibp file")."""
    crc ^= 0xFFFFFFFF
    for byte in bytes(data):
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF
