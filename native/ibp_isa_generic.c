/* Row kernels for any x86-64 / other CPU: portable extract and deposit loops. */
#define IBP_ISA generic
#include "ibp_rowcodec.inc"
