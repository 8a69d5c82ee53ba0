/* Row kernels for AVX-512 CPUs (Ice Lake, Zen 4 and newer): the v3 kernels, plus
 * decoders that handle W = 64 rows eight words per step (W = 32: sixteen) instead of one.
 *
 * Per step of 8 words: the header byte is the lane mask of participating words;
 * field lengths (vbits or 64) are prefix-summed across lanes to get each field's
 * bit offset (in a planned step: read from the plan, see step_layout); a 128-byte
 * window of the bitstream sits in two registers (the second loaded only where the
 * step's bits reach it: window_hi; the offsets and the window in ibp_avx512_fields.inc),
 * VPERMT2Q pulls out the two 64-bit
 * words that hold each lane's field and VPSHRDVQ shifts it out of them by the
 * offset's low 6 bits (W = 32 and 16: the same with 32- and 16-bit words, by VPERMD
 * and VPERMW from the first register alone where the step's bits fit it). Against
 * gathering each lane's bytes (VPSHUFB to splat the byte offset, two VPERMT2B, then
 * VPSHRDV by its low 3 bits), one shuffle-port instruction fewer a step: in-cache
 * decode 0.88-0.94x the time at W = 32 (fp32 d128, fp16 d64), 0.93-1.01x at W = 16,
 * 0.94-1.02x at W = 64 (most of whose steps are direct); 1 thread, both orders.
 * The deposit (pdep has no vector form) is planned per table (VPMULTISHIFTQB, see
 * ibp_avx512_plan.inc); without a plan it inserts zeros at the mask's runs of invariant bits, one
 * run per iteration, in all lanes at once. A W = 64 step whose words all participate
 * skips all of that: one VPERMB of one window and the shifts (plan_direct). The window reads
 * up to 128 bytes past a field; the payload's tail pad covers that. The decoders
 * are inlined into the row decoder: a call per row was 6% of a W = 64 float32 row
 * and 6% of a float16 one (measured, d128 / d64).
 */
#define IBP_ISA avx512
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ibp_bits.h"
#include "ibp_internal.h"

#include "ibp_avx512_plan.inc"

/* The planned deposit of a step's fields: bitval | (shifted bits & sel) for each
 * shift. Two shifts always (unused ones select nothing), so that the usual one or
 * two compile to straight code. */
static inline __m512i plan_deposit(const __m512i *ctrl, const __m512i *sel, __m512i bitval, uint32_t shifts,
                                   __m512i field)
{
    __m512i dep = _mm512_ternarylogic_epi64(_mm512_multishift_epi64_epi8(ctrl[0], field), sel[0], bitval, 0xea);
    dep = _mm512_ternarylogic_epi64(_mm512_multishift_epi64_epi8(ctrl[1], field), sel[1], dep, 0xea);
    if (shifts > 2)
        dep = _mm512_ternarylogic_epi64(_mm512_multishift_epi64_epi8(ctrl[2], field), sel[2], dep, 0xea);
    return dep;
}

/* What a step reads of its plan, held in registers for a whole row where every step
 * has the same plan (see steps_uniform), instead of six to ten 64-byte loads a step.
 * Against the loads (in cache, 1 thread, benchmarks.ab, both orders; a Zen 4 EPYC):
 * fp32 d128 W = 64 0.78-0.82x the time (trained-like 0.73-0.86x), W = 32 0.83-0.84x
 * (0.82-0.90x), fp16 d64 W = 64 0.90x, W = 32 0.92-0.93x; decode from memory and
 * single-table lookups within noise; fp32 d128 rows whose words all participate
 * (decode_full_row; an ad-hoc timing of 1,000 of them) 0.65-0.70x. Locals of the
 * step loops, not a struct: GCC kept a struct of them on the stack. `uniform` a
 * constant; ps the first step's plan. */
static const plan_step zero_step; /* what UNIFORM_STEP_REGS reads where not uniform (unused) */
#define UNIFORM_STEP_REGS(ps)                                                                                    \
    const plan_step *const u_ = uniform ? (ps) : &zero_step;                                                       \
    const step_layout ul = u_->layout;                                                                             \
    const __m512i u_direct_idx = u_->direct_idx, u_bitval = u_->bitval, u_excl = u_->excl;                        \
    const __m512i u_late_below = u_->late_below[0];                                                                \
    const __m512i u_direct_ctrl[PLAN_MAX_SHIFTS] = {u_->direct_ctrl[0], u_->direct_ctrl[1], u_->direct_ctrl[2]};  \
    const __m512i u_ctrl[PLAN_MAX_SHIFTS] = {u_->ctrl[0], u_->ctrl[1], u_->ctrl[2]};                              \
    const __m512i u_sel[PLAN_MAX_SHIFTS] = {u_->sel[0], u_->sel[1], u_->sel[2]}

/* The direct step (see plan_direct) of a row whose words all participate: idx, ctrl,
 * sel and bitval its plan, `fixed` its first bit when every earlier word participates,
 * pos its first bit. */
static inline __attribute__((always_inline)) __m512i direct_step_of(__m512i idx, const __m512i *ctrl,
                                                                    const __m512i *sel, __m512i bitval,
                                                                    uint32_t shifts, uint32_t fixed,
                                                                    const uint8_t *bs, uint64_t pos)
{
    const uint64_t from = pos - (fixed & 7); /* the planned window's first bit (pos >= fixed) */
    const uint8_t *q = bs + (from >> 3);
    __m512i win = _mm512_loadu_si512((const void *)q);
    if (from & 7) /* not when pos == fixed: always shifting cost float16 d64 rows 5-9%; one
                   * VPSHRDVQ, not two shifts and an OR: 0.94-1.02x the time (W = 64 fp32 d128) */
        win = _mm512_shrdv_epi64(win, _mm512_loadu_si512((const void *)(q + 8)),
                                 _mm512_set1_epi64((long long)(from & 7)));
    return plan_deposit(ctrl, sel, bitval, shifts, _mm512_permutexvar_epi8(idx, win));
}

/* direct_step_of step s of a plan. */
static inline __attribute__((always_inline)) __m512i direct_step(const plan_step *s, const uint8_t *bs, uint64_t pos)
{
    return direct_step_of(s->direct_idx, s->direct_ctrl, s->sel, s->bitval, s->layout.shifts, s->layout.fixed, bs, pos);
}

/* The W = 64 and W = 32 step loops below read a step's plan through STEP and
 * DIRECT_STEP: from UNIFORM_STEP_REGS's registers where `uniform` (a constant), else
 * from the step's plan ps. */
#define STEP(f) (uniform ? u_##f : ps->f)
#define DIRECT_STEP()                                                                                              \
    (uniform ? direct_step_of(u_direct_idx, u_direct_ctrl, u_sel, u_bitval, ul.shifts, 0, bs, pos)               \
             : direct_step(ps, bs, pos))

/* Step ps of a row decoded by decode_full_row, with `shifts` (a constant) shifts. */
static inline __attribute__((always_inline)) __m512i full_step(const plan_step *ps, const uint8_t *bs,
                                                               const uint32_t shifts)
{
    const __m512i win = _mm512_loadu_si512((const void *)(bs + (ps->layout.fixed >> 3)));
    return plan_deposit(ps->direct_ctrl, ps->sel, ps->bitval, shifts, _mm512_permutexvar_epi8(ps->direct_idx, win));
}

/* Whether the header at hdr says that every word participates (cluster view v). */
static inline __attribute__((always_inline)) int header_full(const plan_view *v, const uint8_t *hdr)
{
    if (v->hdr_bytes <= 8) { /* a plain load (the payload's tail pad covers it), not a masked one */
        uint64_t h;
        memcpy(&h, hdr, 8);
        return (h | v->hdr_fill) == ~(uint64_t)0;
    }
    return !_mm512_mask_cmpneq_epu8_mask(v->hdr_mask, _mm512_loadu_si512((const void *)hdr), _mm512_set1_epi8(-1));
}

/* The n direct steps of a row decoded whole under a uniform plan (see steps_uniform):
 * idx, ctrl, sel and bitval every step's plan, each step's window the previous one's
 * plus `stride` bytes. */
static inline __attribute__((always_inline)) void uniform_full_steps(__m512i idx, const __m512i *ctrl,
                                                                     const __m512i *sel, __m512i bitval,
                                                                     uint32_t stride, uint32_t n, const uint8_t *bs,
                                                                     uint8_t *out, step_prefetch *pf,
                                                                     const uint32_t shifts)
{
    for (uint32_t st = 0; st < n; st++, bs += stride, out += 64) {
        step_prefetch_line(pf);
        const __m512i field = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512((const void *)bs));
        _mm512_storeu_si512((void *)out, plan_deposit(ctrl, sel, bitval, shifts, field));
    }
}

/* uniform_full_steps with the plan of step s. */
static inline __attribute__((always_inline)) void uniform_full_steps_of(const plan_step *s, uint32_t n,
                                                                        const uint8_t *bs, uint8_t *out,
                                                                        step_prefetch *pf, const uint32_t shifts)
{
    const __m512i ctrl[PLAN_MAX_SHIFTS] = {s->direct_ctrl[0], s->direct_ctrl[1], s->direct_ctrl[2]};
    const __m512i sel[PLAN_MAX_SHIFTS] = {s->sel[0], s->sel[1], s->sel[2]};
    uniform_full_steps(s->direct_idx, ctrl, sel, s->bitval, s->layout.total / 8, n, bs, out, pf, shifts);
}

/* The steps of a row decoded whole (see decode_full_rows): bs its bitstream, v its
 * cluster's view; a line of pf a step. */
static inline __attribute__((always_inline)) void full_row_steps(const plan_view *v, const uint8_t *bs, uint8_t *out,
                                                                 step_prefetch *pf)
{
    const plan_step *ps = v->steps, *const end = ps + v->n_steps; /* locals: the stores may alias v */
    if (v->uniform) {
        if (v->most_shifts <= 2)
            uniform_full_steps_of(ps, v->n_steps, bs, out, pf, 2);
        else
            uniform_full_steps_of(ps, v->n_steps, bs, out, pf, 3);
        return;
    }
    if (v->most_shifts <= 2) /* the number of shifts a constant: no branch per step */
        for (; ps < end; ps++, out += 64) {
            step_prefetch_line(pf);
            _mm512_storeu_si512((void *)out, full_step(ps, bs, 2));
        }
    else
        for (; ps < end; ps++, out += 64) {
            step_prefetch_line(pf);
            _mm512_storeu_si512((void *)out, full_step(ps, bs, 3));
        }
}

/* The view of the cluster of the row stored at row[0, len) if the row is full (every
 * word participates and its cluster has full rows), else NULL. `single`: the plan has
 * one cluster, whose view is v0 (the rows have no cluster byte). */
static inline __attribute__((always_inline)) const plan_view *full_row_view(const decode_plan *p, const plan_view *v0,
                                                                            const int single, const uint8_t *row,
                                                                            uint64_t len)
{
    const uint32_t k = single ? 0 : row[0];
    if (!single && k >= p->clusters)
        return NULL;
    const plan_view *v = single ? v0 : &p->views[k];
    return v->full_len && len == v->full_len && header_full(v, row + !single) ? v : NULL; /* 0: no such rows */
}

/* decode_full_rows for one row, inlined into the general row loop, for tables where
 * full rows and others alternate: returns 0 (nothing written) for a row that is not
 * full. */
static inline __attribute__((always_inline)) int decode_full_row(const void *p_v, const uint8_t *row, uint64_t len,
                                                                 uint8_t *out, step_prefetch *pf)
{
    const decode_plan *p = p_v;
    if (!p)
        return 0;
    const int single = p->clusters == 1;
    const plan_view *v = full_row_view(p, &p->views[0], single, row, len);
    if (!v)
        return 0;
    full_row_steps(v, row + !single + v->hdr_bytes, out, pf);
    return 1;
}
#define IBP_DECODE_FULL_ROW(plan, row, len, out, pf) decode_full_row((plan), (row), (len), (out), (pf))

#include "ibp_avx512_fields.inc"

static inline __m512i shift_lanes_up(__m512i x, int lanes)
{
    /* lane i <- lane i - lanes, zeros below */
    switch (lanes) {
    case 1: return _mm512_alignr_epi64(x, _mm512_setzero_si512(), 7);
    case 2: return _mm512_alignr_epi64(x, _mm512_setzero_si512(), 6);
    default: return _mm512_alignr_epi64(x, _mm512_setzero_si512(), 4);
    }
}

/* Decode words [0, 8 * floor(full / 8)) of a W = 64 row; returns how many. `planned`
 * (a constant) says that plan_v is not NULL. */
static inline __attribute__((always_inline)) uint32_t decode_words64_steps(const uint8_t *hdr, const uint8_t *bs, uint64_t *pos_io,
                                             const uint64_t *mask, const uint64_t *bitval,
                                             const uint8_t *vbits, uint32_t full, uint8_t *out,
                                             const void *plan_v, const int planned, const int uniform,
                                             step_prefetch *pf)
{
    const plan_view *plan = planned ? plan_v : NULL;
    const __m512i w64 = _mm512_set1_epi64(64);
    const __m512i ones = _mm512_set1_epi64(-1);
    const plan_step *ps = planned ? plan->steps : NULL; /* step j / 8's (uniform: every step's) */
    UNIFORM_STEP_REGS(ps);
    uint64_t pos = *pos_io;
    uint32_t j = 0;
    for (; j + 8 <= full; j += 8, ps += planned && !uniform) {
        step_prefetch_line(pf); /* a later row's line (see decode_spans_w) */
        __mmask8 part = hdr[j / 8];
        __m512i excl, n = w64; /* each field's offset from the step's first bit; its length (read
                                * only by the unplanned deposit) */
        uint64_t step_bits;
        const step_layout *lay = uniform ? &ul : planned ? &ps->layout : NULL;
        if (planned && part == lay->direct_part) { /* every word participates */
            _mm512_storeu_si512((void *)(out + (size_t)j * 8), DIRECT_STEP());
            pos += lay->total;
            continue;
        }
        if (lay && lay->extra) { /* the planned layout, corrected for non-participating lanes */
            excl = shared_excl64(hdr + j / 8, STEP(excl), uniform ? u_late_below : ps->late_below[0], lay->extra_x2);
            step_bits = shared_step_bits(lay, part);
        } else {
            __m512i vb = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const void *)(vbits + j)));
            /* n = part ? vbits : 64, as arithmetic (a masked blend here crashes GCC 12's LRA) */
            n = _mm512_sub_epi64(w64, _mm512_and_si512(_mm512_sub_epi64(w64, vb), _mm512_movm_epi64(part)));
            __m512i incl = _mm512_add_epi64(n, shift_lanes_up(n, 1));
            incl = _mm512_add_epi64(incl, shift_lanes_up(incl, 2));
            incl = _mm512_add_epi64(incl, shift_lanes_up(incl, 4));
            excl = _mm512_sub_epi64(incl, n);
            step_bits = (uint64_t)_mm_extract_epi64(_mm512_extracti64x2_epi64(incl, 3), 1);
        }
        __m512i field = step_fields64(bs, pos, excl, step_bits);
        if (plan) { /* planned deposit (see plan_cluster); non-participating lanes keep the raw word */
            __m512i dep = plan_deposit(STEP(ctrl), STEP(sel), STEP(bitval), lay->shifts, field);
            field = _mm512_mask_mov_epi64(field, part, dep);
            _mm512_storeu_si512((void *)(out + (size_t)j * 8), field);
            pos += step_bits;
            continue;
        }
        field = _mm512_andnot_si512(_mm512_sllv_epi64(ones, n), field); /* keep n bits */
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
        pos += step_bits;
    }
    *pos_io = pos;
    return j;
}

/* Rows without a plan (see plan_for) are rare: their loop is out of line. */
static __attribute__((noinline)) uint32_t decode_words64_unplanned(const uint8_t *hdr, const uint8_t *bs, uint64_t *pos_io,
                                                                   const uint64_t *mask, const uint64_t *bitval,
                                                                   const uint8_t *vbits, uint32_t full, uint8_t *out)
{
    return decode_words64_steps(hdr, bs, pos_io, mask, bitval, vbits, full, out, NULL, 0, 0, NULL);
}

static inline __attribute__((always_inline)) uint32_t decode_words64_avx512(const uint8_t *hdr, const uint8_t *bs, uint64_t *pos_io,
                                             const uint64_t *mask, const uint64_t *bitval,
                                             const uint8_t *vbits, uint32_t full, uint8_t *out,
                                             const void *plan_v, step_prefetch *pf)
{
    const plan_view *plan = plan_v;
    if (!plan)
        return decode_words64_unplanned(hdr, bs, pos_io, mask, bitval, vbits, full, out);
    return plan->uniform ? decode_words64_steps(hdr, bs, pos_io, mask, bitval, vbits, full, out, plan_v, 1, 1, pf)
                         : decode_words64_steps(hdr, bs, pos_io, mask, bitval, vbits, full, out, plan_v, 1, 0, pf);
}

/* Decode words [0, 16 * floor(full / 16)) of a W = 32 row; returns how many. The W = 64
 * steps above with sixteen 32-bit lanes. Two header bytes give the step's lane mask.
 * `direct` (a constant) tries direct steps where every word participates (see
 * DECODE_WORDS_ENTRY). */
static inline __attribute__((always_inline)) uint32_t decode_words32_steps(const uint8_t *hdr, const uint8_t *bs, uint64_t *pos_io,
                                             const uint64_t *mask, const uint64_t *bitval,
                                             const uint8_t *vbits, uint32_t full, uint8_t *out,
                                             const void *plan_v, const int planned, const int direct,
                                             const int uniform)
{
    const plan_view *plan = planned ? plan_v : NULL;
    const __m512i w32 = _mm512_set1_epi32(32);
    const __m512i ones = _mm512_set1_epi32(-1);
    const __m512i zero = _mm512_setzero_si512();
    const plan_step *ps = planned ? plan->steps : NULL; /* step j / 16's (uniform: every step's) */
    UNIFORM_STEP_REGS(ps);
    uint64_t pos = *pos_io;
    uint32_t j = 0;
    for (; j + 16 <= full; j += 16, ps += planned && !uniform) {
        uint16_t bits;
        memcpy(&bits, hdr + j / 8, 2);
        __mmask16 part = (__mmask16)bits;
        __m512i excl, n = w32;
        uint64_t step_bits;
        const step_layout *lay = uniform ? &ul : planned ? &ps->layout : NULL;
        if (direct && part == lay->direct_part) { /* as in decode_words64_avx512 */
            _mm512_storeu_si512((void *)(out + (size_t)j * 4), DIRECT_STEP());
            pos += lay->total;
            continue;
        }
        if (lay && lay->extra) { /* as in decode_words64_avx512 */
            excl = shared_excl32(hdr + j / 8, STEP(excl), uniform ? u_late_below : ps->late_below[0], lay->extra_x2);
            step_bits = shared_step_bits(lay, part);
        } else {
            __m512i vb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(vbits + j)));
            n = _mm512_sub_epi32(w32, _mm512_and_si512(_mm512_sub_epi32(w32, vb), _mm512_movm_epi32(part)));
            __m512i incl = _mm512_add_epi32(n, _mm512_alignr_epi32(n, zero, 15));
            incl = _mm512_add_epi32(incl, _mm512_alignr_epi32(incl, zero, 14));
            incl = _mm512_add_epi32(incl, _mm512_alignr_epi32(incl, zero, 12));
            incl = _mm512_add_epi32(incl, _mm512_alignr_epi32(incl, zero, 8));
            excl = _mm512_sub_epi32(incl, n);
            step_bits = (uint32_t)_mm_extract_epi32(_mm512_extracti32x4_epi32(incl, 3), 3);
        }
        __m512i field = step_fields32(bs, pos, excl, step_bits);
        if (plan) { /* as in decode_words64_avx512 */
            __m512i dep = plan_deposit(STEP(ctrl), STEP(sel), STEP(bitval), lay->shifts, field);
            field = _mm512_mask_mov_epi32(field, part, dep);
            _mm512_storeu_si512((void *)(out + (size_t)j * 4), field);
            pos += step_bits;
            continue;
        }
        field = _mm512_andnot_si512(_mm512_sllv_epi32(ones, n), field); /* keep n bits */
        /* masks and bit values are stored as 64-bit words: narrow 16 of them */
        __m512i m = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(_mm512_loadu_si512(mask + j))),
                                       _mm512_cvtepi64_epi32(_mm512_loadu_si512(mask + j + 8)), 1);
        __m512i bv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(_mm512_loadu_si512(bitval + j))),
                                        _mm512_cvtepi64_epi32(_mm512_loadu_si512(bitval + j + 8)), 1);
        m = _mm512_maskz_mov_epi32(part, m);
        while (_mm512_test_epi32_mask(m, m)) {
            __m512i low_bit = _mm512_and_si512(m, _mm512_sub_epi32(zero, m));
            __m512i run = _mm512_andnot_si512(_mm512_add_epi32(m, low_bit), m);
            __m512i below = _mm512_sub_epi32(low_bit, _mm512_set1_epi32(1)); /* all ones when m == 0 */
            __m512i len = _mm512_popcnt_epi32(run);
            field = _mm512_or_si512(_mm512_and_si512(field, below),
                                    _mm512_sllv_epi32(_mm512_andnot_si512(below, field), len));
            m = _mm512_xor_si512(m, run);
        }
        field = _mm512_or_si512(field, _mm512_maskz_mov_epi32(part, bv));
        _mm512_storeu_si512((void *)(out + (size_t)j * 4), field);
        pos += step_bits;
    }
    *pos_io = pos;
    return j;
}

#undef STEP
#undef DIRECT_STEP

/* 8 64-bit words narrowed to 8 16-bit lanes */
static inline __m128i narrow16(const uint64_t *p)
{
    return _mm512_cvtepi64_epi16(_mm512_loadu_si512((const void *)p));
}

/* lane i <- lane i - k of 32 16-bit lanes, zeros below */
static inline __m512i shift_words_up(__m512i x, int k)
{
    const __m512i lane = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                          15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return _mm512_maskz_permutexvar_epi16((__mmask32)(0xffffffffu << k),
                                          _mm512_sub_epi16(lane, _mm512_set1_epi16((short)k)), x);
}

/* Decode words [0, 32 * floor(full / 32)) of a W = 16 row; returns how many. The same
 * steps with thirty-two 16-bit lanes; four header bytes give the lane mask; `direct`
 * as at W = 32. */
static inline __attribute__((always_inline)) uint32_t decode_words16_steps(const uint8_t *hdr, const uint8_t *bs, uint64_t *pos_io,
                                             const uint64_t *mask, const uint64_t *bitval,
                                             const uint8_t *vbits, uint32_t full, uint8_t *out,
                                             const void *plan_v, const int planned, const int direct)
{
    const plan_view *plan = planned ? plan_v : NULL;
    const __m512i w16 = _mm512_set1_epi16(16);
    const __m512i ones = _mm512_set1_epi16(-1);
    const __m512i zero = _mm512_setzero_si512();
    const plan_step *ps = planned ? plan->steps : NULL; /* step j / 32's */
    uint64_t pos = *pos_io;
    uint32_t j = 0;
    for (; j + 32 <= full; j += 32, ps += planned) {
        uint32_t bits;
        memcpy(&bits, hdr + j / 8, 4);
        __mmask32 part = (__mmask32)bits;
        __m512i excl, n = w16;
        uint64_t step_bits;
        const step_layout *lay = planned ? &ps->layout : NULL;
        if (direct && part == lay->direct_part) { /* as in decode_words64_avx512 */
            _mm512_storeu_si512((void *)(out + (size_t)j * 2), direct_step(ps, bs, pos));
            pos += lay->total;
            continue;
        }
        if (lay && lay->extra) { /* one or two extras: as in decode_words64_avx512 */
            excl = shared_excl16_of(hdr + j / 8, ps->excl, ps->late_below, lay, part, &step_bits);
        } else if (lay) {
            excl = lane_excl16(part, lay, ps->excl, &step_bits);
        } else {
            __m512i vb = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const void *)(vbits + j)));
            n = _mm512_sub_epi16(w16, _mm512_and_si512(_mm512_sub_epi16(w16, vb), _mm512_movm_epi16(part)));
            __m512i incl = _mm512_add_epi16(n, shift_words_up(n, 1));
            incl = _mm512_add_epi16(incl, shift_words_up(incl, 2));
            incl = _mm512_add_epi16(incl, shift_words_up(incl, 4));
            incl = _mm512_add_epi16(incl, shift_words_up(incl, 8));
            incl = _mm512_add_epi16(incl, shift_words_up(incl, 16));
            excl = _mm512_sub_epi16(incl, n);
            step_bits = (uint16_t)_mm_extract_epi16(_mm512_extracti32x4_epi32(incl, 3), 7);
        }
        __m512i field = step_fields16(bs, pos, excl, step_bits);
        if (plan) { /* as in decode_words64_avx512 */
            __m512i dep = plan_deposit(ps->ctrl, ps->sel, ps->bitval, lay->shifts, field);
            field = _mm512_mask_mov_epi16(field, part, dep);
            _mm512_storeu_si512((void *)(out + (size_t)j * 2), field);
            pos += step_bits;
            continue;
        }
        field = _mm512_andnot_si512(_mm512_sllv_epi16(ones, n), field); /* keep n bits */
        /* masks and bit values are stored as 64-bit words: narrow 32 of them */
        __m512i m = _mm512_castsi128_si512(narrow16(mask + j));
        __m512i bv = _mm512_castsi128_si512(narrow16(bitval + j));
        m = _mm512_inserti32x4(m, narrow16(mask + j + 8), 1);
        bv = _mm512_inserti32x4(bv, narrow16(bitval + j + 8), 1);
        m = _mm512_inserti32x4(m, narrow16(mask + j + 16), 2);
        bv = _mm512_inserti32x4(bv, narrow16(bitval + j + 16), 2);
        m = _mm512_inserti32x4(m, narrow16(mask + j + 24), 3);
        bv = _mm512_inserti32x4(bv, narrow16(bitval + j + 24), 3);
        m = _mm512_maskz_mov_epi16(part, m);
        while (_mm512_test_epi16_mask(m, m)) {
            __m512i low_bit = _mm512_and_si512(m, _mm512_sub_epi16(zero, m));
            __m512i run = _mm512_andnot_si512(_mm512_add_epi16(m, low_bit), m);
            __m512i below = _mm512_sub_epi16(low_bit, _mm512_set1_epi16(1)); /* all ones when m == 0 */
            __m512i len = _mm512_popcnt_epi16(run);
            field = _mm512_or_si512(_mm512_and_si512(field, below),
                                    _mm512_sllv_epi16(_mm512_andnot_si512(below, field), len));
            m = _mm512_xor_si512(m, run);
        }
        field = _mm512_or_si512(field, _mm512_maskz_mov_epi16(part, bv));
        _mm512_storeu_si512((void *)(out + (size_t)j * 2), field);
        pos += step_bits;
    }
    *pos_io = pos;
    return j;
}

/* The W = 32 and W = 16 loops above, compiled apart: with the direct branch (a call per
 * row), without it (see mostly_full_rows), and for the rare rows without a plan (a
 * call per row); at W = 32 the first two again for uniform plans (see steps_uniform:
 * fp32 d128 rows 0.84-0.90x the time, fp16 d64 0.90x; at W = 16 1.01-1.04x, so not
 * there). One loop testing the plan's flag decoded the tables without
 * direct steps 3-6% slower (fp32 d128, torchrec init and trained-like, W = 16 and 32),
 * and both loops inlined into the row decoder made fp32 W = 64 lookups 1-11% slower in
 * 5 of 6 runs (the quick Zipf set). With the plan a constant and the steps walked by
 * pointer, as at W = 64: 0.89-0.94x the time in cache (fp32 d128 torchrec init and
 * trained-like, fp16 d64; benchmarks.ab, both orders). */
#define DECODE_WORDS_PARAMS                                                                                        \
    const uint8_t *hdr, const uint8_t *bs, uint64_t *pos_io, const uint64_t *mask, const uint64_t *bitval,          \
        const uint8_t *vbits, uint32_t full, uint8_t *out, const void *plan_v
#define DECODE_WORDS_ARGS hdr, bs, pos_io, mask, bitval, vbits, full, out
#define DECODE_WORDS_LOOP(W, name, ...) /* ...: the loop's constants after plan_v */                            \
    static __attribute__((noinline)) uint32_t decode_words##W##_##name(DECODE_WORDS_PARAMS)                        \
    {                                                                                                              \
        return decode_words##W##_steps(DECODE_WORDS_ARGS, plan_v, __VA_ARGS__);                                    \
    }
DECODE_WORDS_LOOP(32, direct, 1, 1, 0)
DECODE_WORDS_LOOP(32, direct_uniform, 1, 1, 1)
DECODE_WORDS_LOOP(32, unplanned, 0, 0, 0)
DECODE_WORDS_LOOP(16, direct, 1, 1)
DECODE_WORDS_LOOP(16, unplanned, 0, 0)
#undef DECODE_WORDS_LOOP

static inline __attribute__((always_inline)) uint32_t decode_words32_avx512(DECODE_WORDS_PARAMS)
{
    const plan_view *plan = plan_v;
    if (!plan)
        return decode_words32_unplanned(DECODE_WORDS_ARGS, NULL);
    if (plan->direct)
        return plan->uniform ? decode_words32_direct_uniform(DECODE_WORDS_ARGS, plan_v)
                             : decode_words32_direct(DECODE_WORDS_ARGS, plan_v);
    return plan->uniform ? decode_words32_steps(DECODE_WORDS_ARGS, plan_v, 1, 0, 1)
                         : decode_words32_steps(DECODE_WORDS_ARGS, plan_v, 1, 0, 0);
}

static inline __attribute__((always_inline)) uint32_t decode_words16_avx512(DECODE_WORDS_PARAMS)
{
    const plan_view *plan = plan_v;
    if (!plan)
        return decode_words16_unplanned(DECODE_WORDS_ARGS, NULL);
    return plan->direct ? decode_words16_direct(DECODE_WORDS_ARGS, plan_v)
                        : decode_words16_steps(DECODE_WORDS_ARGS, plan_v, 1, 0);
}
#undef DECODE_WORDS_ARGS
#undef DECODE_WORDS_PARAMS

/* The bytes past a row that the prefetches of rows likely in memory (cold_rows) cover:
 * a step cuts its fields from a 64-byte window loaded at its first byte, so a row's
 * last step reads up to 63 bytes past the row (a direct step of under 8 bytes, rare in
 * float rows, up to 71: its window takes a second load 8 bytes on), on a line no
 * prefetch brought where that step starts late in the row's last line, and the decode
 * waited on memory there. Against no bytes covered (1 thread, B4096 x P20,
 * benchmarks.ab_set, B / A time, median of rounds, each build as A and as B; an
 * Emerald Rapids Xeon): uniform ids into the six tables of 14k-507k rows of make
 * bench's scale in one lookup_many call, fp32 d64 0.75-0.81x the time, fp32 d128
 * 0.92-0.94x, fp16 d64 (rows of two or three lines, a line more for most) 0.83-1.02x
 * as B and 1.06-1.08x as A, no gain past the position; Zipf ids 0.99x (fp32 d64),
 * 1.01-1.03x (fp16 d64); the quick set's tables, from L3, 0.99-1.01x. 16, 32 and 48
 * bytes covered on every prefetch (single runs, fp32 d64 uniform) took 0.84x, 0.78x
 * and 0.70x. Against 63 on the cold prefetches (the same tables, both orders): 16
 * took 1.10x the time as B, 63 0.91x as B; 127 1.00x either way: a tighter bound per
 * table would gain nothing. Rows in cache keep none: covered there too, new fp32 d128
 * rows took 1.10-1.14x the time and fp16 d64 1.08-1.31x (benchmarks.ab decode-fresh),
 * for the line more that every row then prefetches; as it is, 0.99-1.01x and
 * 0.95-1.05x.
 * decode_packed_rows_cold prefetches a row's steps and one line more, which leaves the
 * covered bytes' last line where they span two more; a second line after the steps:
 * 0.99-1.01x (fp16 d64), 1.00-1.03x (fp32 d64). */
#define IBP_COLD_OVERREAD 63
#include "ibp_avx512_runs.inc"
#undef UNIFORM_STEP_REGS

#define IBP_DECODE_WORDS64_SIMD decode_words64_avx512
#define IBP_STEP_PREFETCH 1 /* the W = 64 decoders prefetch a line a step */
#define IBP_DECODE_WORDS32_SIMD decode_words32_avx512
#define IBP_DECODE_WORDS16_SIMD decode_words16_avx512
#define IBP_EXTRACT(w, mask, W) _pext_u64((w), ~(mask) & ibp_low_bits(W))
#define IBP_DEPOSIT(x, mask, W) _pdep_u64((x), ~(mask) & ibp_low_bits(W))
#define IBP_HALF_TO_FLOAT(h) _cvtsh_ss(h)
#define IBP_FLOAT_TO_HALF(f) _cvtss_sh((f), _MM_FROUND_TO_NEAREST_INT) /* F16C: nearest even */
#define IBP_LOW(x, n, W) _bzhi_u64((x), (n))
#include "ibp_rowcodec.inc"
