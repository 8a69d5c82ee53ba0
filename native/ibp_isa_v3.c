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
#include "ibp_rowcodec.inc"
