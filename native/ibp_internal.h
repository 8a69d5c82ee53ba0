/* ibp_internal.h - declarations shared by the library's C files (not public). */
#ifndef IBP_INTERNAL_H
#define IBP_INTERNAL_H

#include "ibp.h"

/* Row kernels, compiled once per instruction set (ibp_isa_*.c). */
typedef struct ibp_kernels {
    int (*assign)(const ibp_codebook *cb, const uint8_t *rows, uint64_t n_rows,
                  uint8_t *cluster_out, uint32_t *length_out);
    /* lengths NULL: row i takes starts[i + 1] - starts[i] bytes (packed layout). */
    int (*encode)(const ibp_codebook *cb, const uint8_t *rows, uint64_t n_rows,
                  const uint8_t *clusters, const uint64_t *starts, const uint32_t *lengths,
                  uint8_t *payload);
    int (*decode)(const ibp_table *t, const int64_t *idx, uint64_t n_idx, uint8_t *out);
    int (*lookup)(const ibp_table *t, int dtype, uint32_t dim, const int64_t *indices,
                  const int64_t *offsets, uint64_t n_bags, const float *weights,
                  int mode, float *out);
} ibp_kernels;

extern const ibp_kernels ibp_kernels_generic;
extern const ibp_kernels ibp_kernels_v3; /* x86-64-v3: BMI2 pext/pdep, AVX2, FMA, F16C */
extern const ibp_kernels ibp_kernels_avx512;

int ibp_threads(void);

/* Start of row i in the payload of a packed table (i may be n_rows: its end). */
static inline uint64_t ibp_row_start(const ibp_table *t, uint64_t i)
{
    uint64_t rel = t->rel_bytes == 2 ? ((const uint16_t *)t->rel)[i]
                                     : ((const uint32_t *)t->rel)[i];
    return t->block_base[i / IBP_BLOCK_ROWS] + rel;
}

/* Where row i is stored and how long it is, in either layout. */
static inline void ibp_row_span(const ibp_table *t, uint64_t i, uint64_t *start, uint64_t *len)
{
    if (t->row_start) {
        *start = t->row_start[i];
        *len = t->row_len[i];
    } else {
        *start = ibp_row_start(t, i);
        *len = ibp_row_start(t, i + 1) - *start;
    }
}

#endif /* IBP_INTERNAL_H */
