/* ibp_bits.h - per-word bit logic of the IBP format, shared by the C library and
 * the CUDA kernels (every function is static inline and marked host+device).
 *
 * A row is M words of W bits. For the cluster's mask m (1 = invariant position)
 * and bitval v, a word w "participates" when (w & m) == v; it is then stored as
 * its W - popcount(m) variable bits, compacted in order (a pext by ~m). Decoding
 * deposits them back (a pdep by ~m) and ORs in v. The portable extract/deposit
 * below loop over the runs of invariant bits, or over the variable bits where
 * those are fewer, so the common case of a few invariant bits costs a few
 * iterations.
 */
#ifndef IBP_BITS_H
#define IBP_BITS_H

#include <stdint.h>

#if defined(__CUDACC__)
#define IBP_HD static inline __host__ __device__
#else
#define IBP_HD static inline
#endif

IBP_HD int ibp_popcount64(uint64_t x)
{
#if defined(__CUDA_ARCH__)
    return __popcll(x);
#else
    return __builtin_popcountll(x);
#endif
}

/* Index of the lowest / highest set bit; x must be non-zero. */
IBP_HD int ibp_lowest_bit(uint64_t x)
{
#if defined(__CUDA_ARCH__)
    return __ffsll((long long)x) - 1;
#else
    return __builtin_ctzll(x);
#endif
}

IBP_HD int ibp_highest_bit(uint64_t x)
{
#if defined(__CUDA_ARCH__)
    return 63 - __clzll((long long)x);
#else
    return 63 - __builtin_clzll(x);
#endif
}

/* The n lowest bits set, 0 <= n <= 64. */
IBP_HD uint64_t ibp_low_bits(uint32_t n)
{
    return n >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << n) - 1);
}

IBP_HD int ibp_participates(uint64_t w, uint64_t mask, uint64_t bitval)
{
    return (w & mask) == bitval;
}

/* Bits a word costs in the bitstream. */
IBP_HD uint32_t ibp_word_cost(uint64_t w, uint64_t mask, uint64_t bitval,
                              uint32_t vbits, uint32_t word_bits)
{
    return ibp_participates(w, mask, bitval) ? vbits : word_bits;
}

/* pext(w, ~mask) restricted to W bits: the variable bits of w, compacted. */
IBP_HD uint64_t ibp_extract(uint64_t w, uint64_t mask, uint32_t word_bits)
{
    uint64_t keep = ~mask & ibp_low_bits(word_bits);
    w &= keep;
    if (ibp_popcount64(mask & ibp_low_bits(word_bits)) <= ibp_popcount64(keep)) {
        /* Few invariant bits: close the gap of each run of them, highest first so lower
         * positions stay put (a float's invariant bits come in a run or two). */
        uint64_t m = mask & ibp_low_bits(word_bits);
        while (m) {
            const int top = ibp_highest_bit(m);
            const uint64_t below = ~m & ibp_low_bits((uint32_t)top); /* its lowest bit is above their top */
            const int start = below ? ibp_highest_bit(below) + 1 : 0;
            m &= ibp_low_bits((uint32_t)start);
            w = (w & ibp_low_bits((uint32_t)start)) | ((w >> top >> 1) << start);
        }
        return w;
    }
    /* Few variable bits: gather them one by one. */
    uint64_t out = 0;
    int k = 0;
    while (keep) {
        int p = ibp_lowest_bit(keep);
        keep &= keep - 1;
        out |= ((w >> p) & 1) << k;
        k++;
    }
    return out;
}

/* pdep(x, ~mask) restricted to W bits: x's low bits spread over the variable positions. */
IBP_HD uint64_t ibp_deposit(uint64_t x, uint64_t mask, uint32_t word_bits)
{
    uint64_t keep = ~mask & ibp_low_bits(word_bits);
    uint64_t m = mask & ibp_low_bits(word_bits);
    if (ibp_popcount64(m) <= ibp_popcount64(keep)) {
        /* Few invariant bits: open a zero gap for each run of them, lowest first. */
        x &= ibp_low_bits((uint32_t)ibp_popcount64(keep));
        while (m) {
            const int p = ibp_lowest_bit(m);
            const uint64_t above = ~(m >> p); /* 0: the run is all 64 bits */
            const int len = above ? ibp_lowest_bit(above) : 64;
            const uint64_t low = ibp_low_bits((uint32_t)p);
            m &= m + ((uint64_t)1 << p); /* the run cleared */
            x = (x & low) | (((x & ~low) << 1) << (len - 1));
        }
        return x;
    }
    uint64_t out = 0;
    int k = 0;
    while (keep) {
        int p = ibp_lowest_bit(keep);
        keep &= keep - 1;
        out |= ((x >> k) & 1) << p;
        k++;
    }
    return out;
}

/* Readable bytes every payload holds after its last row (ibp_tail_pad in ibp.h,
 * the one definition, shared by libibp and the CUDA kernels). A corrupt header
 * can make a decoder read a whole row's worth of words (row_bytes rounded up to
 * words) plus the header bits from any row start; on top of that comes the
 * widest bit reader's window: the AVX-512 decoder's 128-byte window + 8. The
 * CUDA kernels read less past a row (at most 12 bytes past a field, 15 bytes of
 * 16-byte granule slack) and register or copy exactly this span. Host payloads
 * are allocated with it, so it must never shrink. */
IBP_HD uint64_t ibp_tail_pad_bytes(uint32_t row_bytes, uint32_t word_bits)
{
    uint32_t B = word_bits / 8 ? word_bits / 8 : 1;
    return (uint64_t)(row_bytes + B - 1) / B * B + (row_bytes + 7) / 8 + 136;
}

/* A word of the decoded row: participating words get their invariant bits back. */
IBP_HD uint64_t ibp_decode_word(uint64_t field, int participating, uint64_t mask,
                                uint64_t bitval, uint32_t word_bits)
{
    return participating ? (ibp_deposit(field, mask, word_bits) | bitval) : field;
}

#endif /* IBP_BITS_H */
