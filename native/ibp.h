/* ibp.h - public C interface of libibp, the Invariant Bit Packing codec.
 *
 * The block between CFFI_BEGIN and CFFI_END is also the cffi cdef used by the
 * Python package (ibp_embed/_native.py), so it must stay plain C declarations
 * and integer #defines. The on-disk/in-memory format is described in
 * docs/format.md; IBP_FORMAT_VERSION is that document's version.
 */
#ifndef IBP_H
#define IBP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* CFFI_BEGIN */
#define IBP_FORMAT_VERSION 1
#define IBP_ABI_VERSION 1

/* Return codes. */
#define IBP_OK 0
#define IBP_E_ARG -1     /* invalid argument (shape, word size, null pointer) */
#define IBP_E_INDEX -2   /* row index out of range */
#define IBP_E_CORRUPT -3 /* compressed data is inconsistent */
#define IBP_E_NOMEM -4   /* allocation failed */

#define IBP_POOL_SUM 0
#define IBP_POOL_MEAN 1

#define IBP_DTYPE_F32 0
#define IBP_DTYPE_F16 1
#define IBP_DTYPE_BF16 2

/* Rows per offset block: row i starts at block_base[i >> 6] + rel[i]. */
#define IBP_BLOCK_ROWS 64

/* Masks of all clusters, widened to 64 bits whatever the word size. */
typedef struct ibp_codebook {
    uint32_t row_bytes;      /* R: bytes of one raw row */
    uint32_t word_bits;      /* W: 16, 32 or 64 */
    uint32_t n_words;        /* M = ceil(R / (W/8)) */
    uint32_t n_clusters;     /* K: 1..256 */
    const uint64_t *masks;   /* [K][M]: 1 = invariant bit position */
    const uint64_t *bitvals; /* [K][M]: values of invariant bits (subset of mask) */
    const uint8_t *vbits;    /* [K][M]: W - popcount(mask), derived */
} ibp_codebook;

/* A compressed table: a codebook, an offsets index and the row payload. */
typedef struct ibp_table {
    ibp_codebook cb;
    uint64_t n_rows;
    uint32_t rel_bytes;          /* 2 or 4: width of rel[] */
    uint32_t reserved;
    const uint64_t *block_base;  /* [(n_rows >> 6) + 1] */
    const void *rel;             /* [n_rows + 1] of uint16 or uint32 */
    const uint8_t *payload;      /* payload_bytes, then at least ibp_tail_pad() readable bytes */
    uint64_t payload_bytes;
    /* Arena mode (a table being updated): when row_start is not NULL, row i lives at
     * payload + row_start[i] with row_len[i] bytes, in any order, and the block
     * index above is unused. */
    const uint64_t *row_start;
    const uint32_t *row_len;
} ibp_table;

int ibp_abi_version(void);
int ibp_format_version(void);
const char *ibp_error_string(int code);

/* Threads used by the parallel loops (default: all cores OpenMP sees). */
void ibp_set_num_threads(int n);
int ibp_get_num_threads(void);
/* Row-kernel instruction sets, best first chosen at load time. */
#define IBP_ISA_GENERIC 0 /* portable C: extract/deposit by bit loops */
#define IBP_ISA_V3 1      /* x86-64-v3: BMI2 pext/pdep */
#define IBP_ISA_AVX512 2  /* AVX-512 (VBMI, VPOPCNTDQ): 8 words per step for W = 64 */
int ibp_isa(void);
/* Force a kernel set (tests, benchmarks); IBP_E_ARG if this CPU lacks it. */
int ibp_set_isa(int isa);

/* Bytes that must be readable past the payload's end (decoders over-read). */
uint64_t ibp_tail_pad(uint32_t row_bytes, uint32_t word_bits);
/* Offset index width for rows of this size (2 or 4), 0 if rows are too large. */
uint32_t ibp_rel_bytes(uint32_t row_bytes);
uint32_t ibp_crc32c(uint32_t crc, const void *data, size_t n);

/* Statistics over rows (n_rows x row_bytes, C order). sel: row numbers to use,
 * or NULL for all rows. counts: [M][W], how many selected rows have each bit set. */
int ibp_bit_counts(const uint8_t *rows, uint64_t n_rows, uint32_t row_bytes,
                   uint32_t word_bits, const int64_t *sel, uint64_t n_sel,
                   uint64_t *counts);
/* For n_cand candidate (mask, bitval) sets of M words each, the total bitstream
 * bits each word position costs over the selected rows: costs [n_cand][M]. */
int ibp_word_costs(const uint8_t *rows, uint64_t n_rows, uint32_t row_bytes,
                   uint32_t word_bits, const int64_t *sel, uint64_t n_sel,
                   const uint64_t *cand_masks, const uint64_t *cand_bitvals,
                   uint32_t n_cand, uint64_t *costs);

/* For every row: the cluster that stores it smallest (lowest id on ties) and its
 * stored length in bytes (row_bytes when stored raw). Either output may be NULL. */
int ibp_assign(const ibp_codebook *cb, const uint8_t *rows, uint64_t n_rows,
               uint8_t *cluster_out, uint32_t *length_out);
/* Encode rows into payload at offsets[0..n_rows] (from ibp_assign's lengths).
 * clusters may be NULL when K == 1. */
int ibp_encode(const ibp_codebook *cb, const uint8_t *rows, uint64_t n_rows,
               const uint8_t *clusters, const uint64_t *offsets, uint8_t *payload);
/* The same, row i going to payload + starts[i] with lengths[i] bytes (arena mode). */
int ibp_encode_at(const ibp_codebook *cb, const uint8_t *rows, uint64_t n_rows,
                  const uint8_t *clusters, const uint64_t *starts, const uint32_t *lengths,
                  uint8_t *payload);

/* Copy n variable-length rows: src + src_start[i] -> dst + dst_start[i], len[i] bytes
 * (compacting an arena). Ranges must not overlap. */
int ibp_move_rows(const uint8_t *src, const uint64_t *src_start, const uint32_t *len,
                  uint64_t n, uint8_t *dst, const uint64_t *dst_start);

/* Structural check of a table: codebook, offsets monotone and in bounds, row
 * lengths, cluster ids. Returns IBP_E_CORRUPT and the first bad row in *bad_row. */
int ibp_validate(const ibp_table *t, uint64_t *bad_row);

/* Decode rows idx[0..n_idx) (all rows when idx is NULL) into out, row_bytes each. */
int ibp_decode(const ibp_table *t, const int64_t *idx, uint64_t n_idx, uint8_t *out);

/* Pooled lookup: bag b pools rows indices[offsets[b] .. offsets[b+1]), each scaled
 * by weights[i] when weights is not NULL; MEAN divides by the bag size (empty
 * bags give zeros). The table holds elements of dtype (IBP_DTYPE_*), dim of them
 * per row; out is [n_bags][dim] float32. */
int ibp_lookup(const ibp_table *t, int dtype, uint32_t dim,
               const int64_t *indices, const int64_t *offsets, uint64_t n_bags,
               const float *weights, int mode, float *out);
/* CFFI_END */

#ifdef __cplusplus
}
#endif
#endif /* IBP_H */
