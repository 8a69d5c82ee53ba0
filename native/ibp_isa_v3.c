/* Row kernels for x86-64-v3 CPUs (Haswell, Zen and newer): BMI2 pext/pdep do a
 * word's extract/deposit in one instruction. Built with -march=x86-64-v3 and only
 * called after a run-time CPU check (ibp.c).
 *
 * Built a second time with IBP_V3_NO_PDEP for AMD Zen 1 and 2 (family 17h), whose
 * pext and pdep are microcoded. That build keeps everything else of x86-64-v3 (AVX2
 * pooling, F16C conversions, bzhi); it extracts and deposits with the portable loops
 * of ibp_bits.h (a step per run of invariant bits). On a Zen 2 it decoded a fp32
 * d128 row (in cache) in 95-150 ns, the pdep build (then a unit at a time) in
 * 4,900-6,600. Both builds decode whole rows four units of 64 bits a step with AVX2
 * (ibp_units_avx2.inc). */
#include <immintrin.h>
#ifdef IBP_V3_NO_PDEP
#define IBP_ISA v3_no_pdep
#else
#define IBP_ISA v3
#define IBP_EXTRACT(w, mask, W) _pext_u64((w), ~(mask) & ibp_low_bits(W))
#define IBP_DEPOSIT(x, mask, W) _pdep_u64((x), ~(mask) & ibp_low_bits(W))
#endif
#define IBP_HALF_TO_FLOAT(h) _cvtsh_ss(h)
#define IBP_FLOAT_TO_HALF(f) _cvtss_sh((f), _MM_FROUND_TO_NEAREST_INT) /* F16C: nearest even */
#define IBP_LOW(x, n, W) _bzhi_u64((x), (n)) /* bzhi keeps all bits for n >= 64 */
/* Rows likely in memory take the cold prefetches from 128 bytes, as AVX-512's stepped
 * loops do (cold_rows), and every row prefetch covers the bytes that the loads may
 * read past a row: 16 for load_fields, load_packed, read_unit and read_bits (16-byte
 * loads from a field's first byte, which lies at the row's end where a field has no
 * bits), 17 for decode_word_lanes and decode_word16_lanes (the same loads one byte
 * on): the line past a row, which no prefetch brought, made the loads wait on memory.
 * The build for Zen 1 and 2 (IBP_V3_NO_PDEP) takes the same, unmeasured there. With
 * 16 bytes covered against none (--isa v3, 1 thread, B4096 x P20, benchmarks.ab, both
 * orders and the builds swapped, min; a Zen 4 EPYC): from memory (lookup-cold) 273k fp16 d64 rows
 * 0.89-0.97x the time (uniform ids), 0.94-1.00x (Zipf), 506k fp32 d64 0.93-0.98x /
 * 0.83-0.89x, 273k bf16 d128 0.93-0.96x, 506k fp32 d128 1.00-1.04x (uniform); from L3
 * (`lookup`, a batch again) 0.96-1.04x (uniform), Zipf ids 1.00-1.03x (273k fp16 d64),
 * 0.92-1.00x (506k fp32 d64), but 1.06-1.07x (101k trained-like fp16 d64). Before the
 * overread was covered, the cold prefetches took fp16 d64 rows 1.03-1.07x the time
 * from memory. */
#define IBP_COLD_WHOLE_ROWS 1
/* The W = 64 steps prefetch the row far ahead a line a step where rows are likely in
 * memory (cold_rows), as AVX-512's steps do: a burst of the row's lines held the decode
 * up behind it (perf put 14% of a uniform fp32 d128 lookup's decode samples right after
 * the bursts' prefetches). 1 thread, --isa v3, a Zen 4 EPYC, against the burst:
 * benchmarks.ab decode-cold fp32 d128 0.84-0.86x the time (trained-like 0.83-0.85x),
 * both orders; benchmarks.ab_set over make bench's five tables of 66k-304k rows, B4096 x
 * P20, median of rounds: fp32 d128 uniform 0.93x, Zipf 0.94x, trained-like uniform
 * 0.91x; fp32 d64 and fp16 d64 uniform 1.01x and 0.99x (noise). Rows likely in cache
 * keep the burst (IBP_STEP_PREFETCH_WARM 0): stepped, new fp32 d64 rows in cache took
 * 1.05-1.09x the time (decode-fresh), fp32 d128 1.00-1.04x. */
#define IBP_STEP_PREFETCH 1
#define IBP_STEP_PREFETCH_WARM 0
#define IBP_ROW_OVERREAD 17
#include "ibp_rowcodec.inc"
