/* Row kernels for x86-64-v3 CPUs (Haswell, Zen and newer): BMI2 pext/pdep do a
 * word's extract/deposit in one instruction. Built with -march=x86-64-v3 and only
 * called after a run-time CPU check (ibp.c). */
#define IBP_ISA v3
#include <immintrin.h>
#define IBP_EXTRACT(w, mask, W) _pext_u64((w), ~(mask) & ibp_low_bits(W))
#define IBP_DEPOSIT(x, mask, W) _pdep_u64((x), ~(mask) & ibp_low_bits(W))
#define IBP_HALF_TO_FLOAT(h) _cvtsh_ss(h)
#define IBP_FLOAT_TO_HALF(f) _cvtss_sh((f), _MM_FROUND_TO_NEAREST_INT) /* F16C: nearest even */
#define IBP_LOW(x, n, W) _bzhi_u64((x), (n)) /* bzhi keeps all bits for n >= 64 */
#include "ibp_rowcodec.inc"
