/* Row kernels for AVX-512 CPUs (Ice Lake, Zen 4 and newer): the v3 kernels, plus a
 * decoder that handles W = 64 rows eight words per step instead of one.
 *
 * Per step of 8 words: the header byte is the lane mask of participating words;
 * field lengths (vbits or 64) are prefix-summed across lanes to get each field's
 * bit offset; a 128-byte window of the bitstream sits in two registers and VPERMB
 * pulls each lane's 16 bytes out of it (two 8-byte halves), shifted into place by
 * the offset's low bits. The deposit (pdep has no vector form) inserts zeros at
 * the mask's runs of invariant bits, one run per iteration, in all lanes at once:
 * float tables have one or two runs per word (the high exponent bits), so two to
 * four iterations replace eight scalar pdeps. The window reads up to 128 bytes
 * past a field; the payload's tail pad covers that.
 */
#define IBP_ISA avx512
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline __m512i shift_lanes_up(__m512i x, int lanes)
{
    /* lane i <- lane i - lanes, zeros below */
    switch (lanes) {
    case 1: return _mm512_alignr_epi64(x, _mm512_setzero_si512(), 7);
    case 2: return _mm512_alignr_epi64(x, _mm512_setzero_si512(), 6);
    default: return _mm512_alignr_epi64(x, _mm512_setzero_si512(), 4);
    }
}

/* Decode words [0, 8 * floor(full / 8)) of a W = 64 row; returns how many. */
static __attribute__((noinline)) uint32_t decode_words64_avx512(const uint8_t *hdr, const uint8_t *bs, uint64_t *pos_io,
                                             const uint64_t *mask, const uint64_t *bitval,
                                             const uint8_t *vbits, uint32_t full, uint8_t *out)
{
    const __m512i w64 = _mm512_set1_epi64(64);
    const __m512i ones = _mm512_set1_epi64(-1);
    const __m512i bytes01234567 = _mm512_set1_epi64(0x0706050403020100LL);
    const __m512i bytes_x8 = _mm512_set1_epi64(0x0808080808080808LL);
    const __m512i splat_byte = _mm512_set1_epi64(0x0101010101010101LL);
    uint64_t pos = *pos_io;
    uint32_t j = 0;
    for (; j + 8 <= full; j += 8) {
        __mmask8 part = hdr[j / 8];
        __m512i vb = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const void *)(vbits + j)));
        /* n = part ? vbits : 64, as arithmetic (a masked blend here crashes GCC 12's LRA) */
        __m512i n = _mm512_sub_epi64(w64, _mm512_and_si512(_mm512_sub_epi64(w64, vb), _mm512_movm_epi64(part)));
        __m512i incl = _mm512_add_epi64(n, shift_lanes_up(n, 1));
        incl = _mm512_add_epi64(incl, shift_lanes_up(incl, 2));
        incl = _mm512_add_epi64(incl, shift_lanes_up(incl, 4));
        /* bit offset of each field from the window's first byte */
        __m512i at = _mm512_add_epi64(_mm512_sub_epi64(incl, n), _mm512_set1_epi64((long long)(pos & 7)));
        const uint8_t *win = bs + (pos >> 3);
        __m512i lo = _mm512_loadu_si512((const void *)win);
        __m512i hi = _mm512_loadu_si512((const void *)(win + 64));
        __m512i idx = _mm512_add_epi64(_mm512_mullo_epi64(_mm512_srli_epi64(at, 3), splat_byte), bytes01234567);
        __m512i b0 = _mm512_permutex2var_epi8(lo, idx, hi);                                  /* bytes k..k+7 */
        __m512i b8 = _mm512_permutex2var_epi8(lo, _mm512_add_epi64(idx, bytes_x8), hi);      /* bytes k+8..k+15 */
        __m512i s = _mm512_and_si512(at, _mm512_set1_epi64(7));
        __m512i field = _mm512_or_si512(_mm512_srlv_epi64(b0, s),
                                        _mm512_sllv_epi64(b8, _mm512_sub_epi64(w64, s))); /* shift 64 gives 0 */
        field = _mm512_andnot_si512(_mm512_sllv_epi64(ones, n), field);                  /* keep n bits */
        /* deposit: open a gap of zeros at each run of invariant bits, lowest first */
        __m512i m = _mm512_maskz_loadu_epi64(part, mask + j);
        while (_mm512_test_epi64_mask(m, m)) {
            __m512i low_bit = _mm512_and_si512(m, _mm512_sub_epi64(_mm512_setzero_si512(), m));
            __m512i run = _mm512_andnot_si512(_mm512_add_epi64(m, low_bit), m);
            __m512i below = _mm512_sub_epi64(low_bit, _mm512_set1_epi64(1)); /* all ones when m == 0 */
            __m512i len = _mm512_popcnt_epi64(run);
            field = _mm512_or_si512(_mm512_and_si512(field, below),
                                    _mm512_sllv_epi64(_mm512_andnot_si512(below, field), len));
            m = _mm512_xor_si512(m, run);
        }
        field = _mm512_or_si512(field, _mm512_maskz_loadu_epi64(part, bitval + j));
        _mm512_storeu_si512((void *)(out + (size_t)j * 8), field);
        pos += (uint64_t)_mm512_reduce_add_epi64(n);
    }
    *pos_io = pos;
    return j;
}

#define IBP_DECODE_WORDS64_SIMD decode_words64_avx512
#define IBP_EXTRACT(w, mask, W) _pext_u64((w), ~(mask) & ibp_low_bits(W))
#define IBP_DEPOSIT(x, mask, W) _pdep_u64((x), ~(mask) & ibp_low_bits(W))
#define IBP_HALF_TO_FLOAT(h) _cvtsh_ss(h)
#define IBP_FLOAT_TO_HALF(f) _cvtss_sh((f), _MM_FROUND_TO_NEAREST_INT) /* F16C: nearest even */
#define IBP_LOW(x, n, W) _bzhi_u64((x), (n))
#include "ibp_rowcodec.inc"
