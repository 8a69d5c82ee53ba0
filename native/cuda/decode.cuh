/* decode.cuh - the per-row, per-lane decoding logic of the CUDA kernels.
 *
 * Everything here is __host__ __device__: the kernels (decode.cu, lookup.cu)
 * run it one warp per row, and emulate.cu runs the very same functions lane by
 * lane on the host, so the bit logic is tested on machines without a GPU. The
 * per-word bit operations come from native/ibp_bits.h, shared with the C
 * library.
 *
 * How a warp decodes a row (docs/format.md): lane l takes word j = j0 + l of a
 * 32-word step, reads its participation bit from the row header, and knows the
 * bits the word takes in the bitstream (vbits[j] when it participates, else W).
 * An exclusive warp scan of those lengths gives each lane the bit offset of its
 * word; each lane then reads its field, deposits it into the mask's variable
 * positions, ORs in bitval, and writes the word: 32 consecutive words per step,
 * so the stores of a warp are contiguous. Raw rows are the same loop with no
 * header and every word W bits long.
 */
#ifndef IBP_CUDA_DECODE_CUH
#define IBP_CUDA_DECODE_CUH

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cuda_fp16.h>

#include "ibp.h"
#include "ibp_bits.h"

#define IBPC_HD __host__ __device__ __forceinline__

namespace ibpcuda {

/* Bits of the table's device-side status word (ORed by the kernels). */
enum : int { kStatusIndex = 1, kStatusCorrupt = 2, kStatusOffsets = 4 };

/* cp.async moves 16-byte granules; rows are staged from the 16-byte boundary below them. */
constexpr uint32_t kChunk = 16;
constexpr uint32_t kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

/* What the kernels need of a table; every pointer is device-readable. */
struct DevTable {
    const uint64_t *masks;      /* [K][M] */
    const uint64_t *bitvals;    /* [K][M] */
    const uint8_t *vbits;       /* [K][M] */
    const uint64_t *block_base; /* [(n_rows >> 6) + 1]; unused when K = 0 (raw) */
    const void *rel;            /* [n_rows + 1] of uint16 or uint32; unused when K = 0 */
    const uint8_t *payload;     /* 16-byte aligned; payload_bytes + tail pad readable (raw tables too) */
    uint64_t n_rows;
    uint32_t row_bytes, word_bits, n_words, n_clusters, rel_bytes;
    int *status;                /* device int, see kStatus* */
};

/* The codebook as a kernel reads it: from shared memory when it fits, else global. */
struct Meta {
    const uint64_t *masks;
    const uint64_t *bitvals;
    const uint8_t *vbits;
};

/* Launch geometry of the row kernels (decided on the host, see ibp_cuda_api.cu). */
struct Geometry {
    uint32_t warps;        /* warps per block */
    uint32_t staged;       /* 1: rows staged in shared memory with cp.async */
    uint32_t stage_bytes;  /* bytes of one staged row (two per warp: double buffering) */
    uint32_t meta_bytes;   /* shared bytes of the codebook (0 when read from global) */
    uint32_t warp_bytes;   /* shared bytes per warp (stages and, for pooling, row and sums) */
    uint32_t smem_bytes;   /* dynamic shared memory per block */
};

IBPC_HD uint32_t round_up(uint32_t x, uint32_t a) { return (x + a - 1) / a * a; }

/* Shared bytes of one staged row: the row at an offset of up to 15 bytes into the
 * buffer, and the over-read of read_bits (12 bytes from any bit position the
 * header can describe, even a corrupt one: at most the cluster byte, the header
 * and M*B bytes of bitstream). */
IBPC_HD uint32_t stage_bytes_for(uint32_t n_words, uint32_t word_bits)
{
    return round_up(n_words * (word_bits / 8) + (n_words + 7) / 8 + 48, kChunk);
}

/* Codebook bytes in shared memory: masks and bitvals 16-byte aligned, then vbits. */
IBPC_HD uint32_t meta_bytes_for(uint32_t n_clusters, uint32_t n_words)
{
    uint32_t km = n_clusters * n_words;
    return 2 * round_up(km * 8, kChunk) + round_up(km, kChunk);
}

/* Clusters of the codebook the kernels read: a raw table (K = 0) gets one of zero
 * masks, so that the decoder's unconditional mask loads stay in bounds. */
IBPC_HD uint32_t meta_clusters(uint32_t n_clusters) { return n_clusters ? n_clusters : 1; }

IBPC_HD uint64_t row_start(const DevTable &t, uint64_t i)
{
    if (t.n_clusters == 0) /* a raw table: rows back to back, no index */
        return i * t.row_bytes;
    uint64_t rel = t.rel_bytes == 2 ? (uint64_t)((const uint16_t *)t.rel)[i]
                                    : (uint64_t)((const uint32_t *)t.rel)[i];
    return t.block_base[i / IBP_BLOCK_ROWS] + rel;
}

/* A row found in the payload. len == 0: nothing to decode (index out of range
 * or inconsistent offsets; status says which), the output row is zeros. */
struct RowRef {
    const uint8_t *src; /* the row's first byte in the payload */
    uint32_t len;       /* stored bytes */
    uint32_t offset;    /* src & 15: where the row starts in its stage buffer */
    int status;         /* kStatus* of this row, 0 if fine */
};

IBPC_HD RowRef locate_row(const DevTable &t, uint64_t row)
{
    RowRef r;
    r.src = t.payload;
    r.len = 0;
    r.offset = 0;
    r.status = 0;
    if (row >= t.n_rows) {
        r.status = kStatusIndex;
        return r;
    }
    /* Two reads of the index (device memory); all lanes read the same addresses,
     * so each is one broadcast transaction. */
    uint64_t s = row_start(t, row), e = row_start(t, row + 1);
    if (e < s || e - s > t.row_bytes || e - s == 0) {
        r.status = kStatusCorrupt;
        return r;
    }
    r.src = t.payload + s;
    r.len = (uint32_t)(e - s);
    r.offset = (uint32_t)((uintptr_t)r.src & (kChunk - 1));
    return r;
}

/* Granules to stage for a row: from the 16-byte boundary below it to the one above its end. */
IBPC_HD uint32_t stage_chunks(const RowRef &r)
{
    return (r.offset + r.len + kChunk - 1) / kChunk;
}

/* A row's layout, from its first byte p (in a stage buffer or in the payload). */
struct RowCode {
    const uint8_t *hdr;     /* participation bits */
    const uint8_t *bs;      /* bitstream (raw rows: the row) */
    const uint64_t *mask;   /* the row's cluster: [M] */
    const uint64_t *bitval;
    const uint8_t *vbits;
    uint32_t raw;
    uint32_t body_bytes;    /* bytes the bitstream must take exactly */
    uint32_t bad;           /* cluster id out of range or row shorter than its header */
};

IBPC_HD RowCode row_code(const Meta &m, const uint8_t *p, uint32_t len, uint32_t row_bytes,
                         uint32_t n_words, uint32_t n_clusters)
{
    RowCode c;
    c.raw = len == row_bytes;
    c.bad = 0;
    uint32_t k = 0, hdr_bytes = 0, cid = 0;
    if (!c.raw) {
        cid = n_clusters > 1;
        k = cid ? p[0] : 0;
        hdr_bytes = cid + (n_words + 7) / 8;
        if (k >= n_clusters || len < hdr_bytes) {
            c.bad = 1;
            k = 0;
            hdr_bytes = 0;
        }
    }
    c.hdr = p + cid;
    c.bs = p + hdr_bytes;
    c.body_bytes = len - hdr_bytes;
    c.mask = m.masks + (uint64_t)k * n_words;
    c.bitval = m.bitvals + (uint64_t)k * n_words;
    c.vbits = m.vbits + (uint64_t)k * n_words;
    return c;
}

IBPC_HD uint32_t load_u32(const uint8_t *p) /* p 4-byte aligned */
{
#if defined(__CUDA_ARCH__)
    return *(const uint32_t *)p;
#else
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
#endif
}

/* n <= W bits of the LSB-first bitstream bs at bit pos, from aligned 32-bit
 * loads (two for W <= 32, three for W = 64: the field and its shift of up to
 * 31 bits fit in 64 or 96 bits). Reads at most 12 bytes from bs + pos / 8,
 * rounded down to 4 bytes; the stage buffer and the payload's tail pad cover it. */
template <uint32_t W>
IBPC_HD uint64_t read_bits(const uint8_t *bs, uint64_t pos, uint32_t n)
{
    const uint8_t *q = bs + (pos >> 3);
    const uint32_t mis = (uint32_t)((uintptr_t)q & 3);
    const uint8_t *a = q - mis; /* pointer arithmetic keeps the address space known */
    const uint32_t s = mis * 8 + (uint32_t)(pos & 7);
    uint64_t x = ((uint64_t)load_u32(a) | ((uint64_t)load_u32(a + 4) << 32)) >> s;
    if (W == 64 && s)
        x |= (uint64_t)load_u32(a + 8) << (64 - s);
    return x & ibp_low_bits(n);
}

/* Step 1 of a lane: the stream bits word j takes (0 past the row's last word). */
IBPC_HD uint32_t lane_bits(const RowCode &c, uint32_t j, uint32_t n_words, uint32_t W,
                           uint32_t *part)
{
    *part = 0;
    if (j >= n_words)
        return 0;
    if (c.raw)
        return W;
    uint32_t pb = (c.hdr[j >> 3] >> (j & 7)) & 1u;
    *part = pb;
    return pb ? (uint32_t)c.vbits[j] : W;
}

/* Step 2 of a lane, once the scan gave its bit offset: the decoded word j. */
template <uint32_t W>
IBPC_HD uint64_t lane_word(const RowCode &c, uint32_t j, uint32_t part, uint64_t pos, uint32_t n)
{
    uint64_t field = read_bits<W>(c.bs, pos, n);
    return ibp_decode_word(field, (int)part, c.mask[j], c.bitval[j], W);
}

/* Whether the bitstream took exactly the row's bytes (docs/format.md, Validity). */
IBPC_HD bool row_consistent(const RowCode &c, uint64_t total_bits)
{
    return !c.bad && (c.raw || (total_bits + 7) / 8 == c.body_bytes);
}

/* Store word j of a decoded row (R bytes at out). aligned: out is B-aligned and
 * R a multiple of B, so every word is whole. */
template <uint32_t W>
IBPC_HD void store_word(uint8_t *out, uint32_t j, uint64_t w, uint32_t row_bytes, bool aligned)
{
    constexpr uint32_t B = W / 8;
    const uint32_t at = j * B;
    if (aligned) {
        if (W == 16)
            *(uint16_t *)(out + at) = (uint16_t)w;
        else if (W == 32)
            *(uint32_t *)(out + at) = (uint32_t)w;
        else
            *(uint64_t *)(out + at) = w;
        return;
    }
    uint32_t nb = row_bytes - at < B ? row_bytes - at : B;
    for (uint32_t b = 0; b < nb; b++)
        out[at + b] = (uint8_t)(w >> (8 * b));
}

/* Stores decoded words into a row of memory (global for gathers, shared for pooling). */
template <uint32_t W>
struct RowStore {
    uint8_t *out;
    uint32_t row_bytes;
    bool aligned;
    IBPC_HD void put(uint32_t j, uint64_t w) { store_word<W>(out, j, w, row_bytes, aligned); }
};

/* ---- elements and pooling (shared by the pooling kernels and the emulation) ---- */

IBPC_HD float half_bits_to_float(uint16_t h)
{
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(h));
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        int shift = 0;
        while (!(man & 0x400)) {
            man <<= 1;
            shift++;
        }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

IBPC_HD float bits_to_float(uint32_t b)
{
#if defined(__CUDA_ARCH__)
    return __uint_as_float(b);
#else
    float f;
    memcpy(&f, &b, 4);
    return f;
#endif
}

/* Element d of a decoded row as float32 (row 4-byte aligned for F32, 2 for halves). */
IBPC_HD float row_elem(const uint8_t *row, uint32_t d, int dtype)
{
    if (dtype == IBP_DTYPE_F32)
        return bits_to_float(((const uint32_t *)(const void *)row)[d]);
    uint16_t h = ((const uint16_t *)(const void *)row)[d];
    return dtype == IBP_DTYPE_BF16 ? bits_to_float((uint32_t)h << 16) : half_bits_to_float(h);
}

/* One pooling step, in libibp's order: acc = fma(w, x, acc) (weighted: one
 * rounding, as libibp's fmaf(w, x, acc) and FBGEMM) or acc + x. The fma is
 * explicit on both sides: left to the compilers, nvcc contracts w * x + acc
 * into an fma (its default -fmad=true) while the host compiler, for x86-64
 * without FMA, rounds twice, and the emulation would not be the kernels'
 * arithmetic. */
IBPC_HD float pool_step(float acc, float x, const float *weights, uint64_t p)
{
#if defined(__CUDA_ARCH__)
    return weights ? __fmaf_rn(weights[p], x, acc) : __fadd_rn(acc, x);
#else
    return weights ? fmaf(weights[p], x, acc) : acc + x;
#endif
}

IBPC_HD float pool_finish(float acc, int mode, uint64_t lo, uint64_t hi)
{
    if (mode == IBP_POOL_MEAN && hi > lo)
        acc *= 1.0f / (float)(hi - lo);
    return acc;
}

/* Bag b's index range [lo, hi), clamped into [0, n_indices]; false when the
 * offsets are out of order or out of range (libibp's caller rejects those). */
IBPC_HD bool bag_range(const int64_t *offsets, uint64_t b, uint64_t n_bags, uint64_t n_indices,
                       uint64_t *lo, uint64_t *hi)
{
    int64_t a = offsets[b], e = offsets[b + 1];
    bool ok = a >= 0 && a <= e && (uint64_t)e <= n_indices;
    if (b == 0 && a != 0)
        ok = false;
    if (b + 1 == n_bags && (uint64_t)e != n_indices)
        ok = false;
    if (a < 0)
        a = 0;
    if ((uint64_t)a > n_indices)
        a = (int64_t)n_indices;
    if (e < a)
        e = a;
    if ((uint64_t)e > n_indices)
        e = (int64_t)n_indices;
    *lo = (uint64_t)a;
    *hi = (uint64_t)e;
    return ok;
}

/* Element d of bag b pooled from rows decoded once each (the dedup path):
 * rows[inverse[p]] is the row of index p. */
IBPC_HD float pool_bag_elem(const uint8_t *rows, uint32_t row_bytes, const uint32_t *inverse,
                            const float *weights, int dtype, int mode, uint64_t lo, uint64_t hi,
                            uint32_t d)
{
    float acc = 0.0f;
    for (uint64_t p = lo; p < hi; p++)
        acc = pool_step(acc, row_elem(rows + (uint64_t)inverse[p] * row_bytes, d, dtype), weights, p);
    return pool_finish(acc, mode, lo, hi);
}

} /* namespace ibpcuda */

#endif /* IBP_CUDA_DECODE_CUH */
