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
#define IBP_FORMAT_VERSION 2
#define IBP_ABI_VERSION 10

/* Return codes. */
#define IBP_OK 0
#define IBP_E_ARG -1     /* invalid argument (shape, word size, null pointer) */
#define IBP_E_INDEX -2   /* row index out of range */
#define IBP_E_CORRUPT -3 /* compressed data is inconsistent */
#define IBP_E_NOMEM -4   /* allocation failed */

#define IBP_POOL_SUM 0
#define IBP_POOL_MEAN 1
/* A pooled lookup naming this many ids a row of a table, a thread, decodes the table
 * whole into each thread's cache (where it fits) instead of its distinct rows. */
#define IBP_FILL_IDS_PER_ROW 10

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
    uint32_t n_clusters;     /* K: 1..256, or 0: a raw table (below); masks may then be NULL */
    const uint64_t *masks;   /* [K][M]: 1 = invariant bit position */
    const uint64_t *bitvals; /* [K][M]: values of invariant bits (subset of mask) */
    const uint8_t *vbits;    /* [K][M]: W - popcount(mask), derived */
} ibp_codebook;

/* A compressed table: a codebook, an offsets index and the row payload.
 * A raw table (K = 0, format version 2) stores every row raw: row i is the R bytes
 * at payload + i * R, payload_bytes = n_rows * R, with no index (block_base and rel
 * are not read and may be NULL) and no tail pad. compress() makes one where the
 * masks, index and tail pad would outweigh what encoding saves. */
typedef struct ibp_table {
    ibp_codebook cb;
    uint64_t n_rows;
    uint32_t rel_bytes;          /* 2 or 4: width of rel[] */
    /* 0, or L where the index puts every row at i * L, L bytes long (rows that all
     * encode to one length, as where every word of every row participates): libibp's
     * CPU decodes and lookups then read no index. Set from ibp_fixed_row_bytes;
     * ibp_validate checks it. */
    uint32_t fixed_len;
    const uint64_t *block_base;  /* [(n_rows >> 6) + 1] */
    const void *rel;             /* [n_rows + 1] of uint16 or uint32 */
    const uint8_t *payload;      /* payload_bytes, then (K >= 1) at least ibp_tail_pad() readable bytes */
    uint64_t payload_bytes;
    /* Store mode (an updatable table, see ibp_store_*): when block_len is not NULL,
     * rows form blocks of 2^block_shift rows, each block anywhere in the payload.
     * Row i of block b = i >> block_shift starts at block_base[b] + rel[i] (rel is
     * uint16) and ends where the next row of its block starts, or at block_len[b]
     * for the block's last row. */
    const uint32_t *block_len;
    uint32_t block_shift;
    uint32_t reserved2;
} ibp_table;

int ibp_abi_version(void);
int ibp_format_version(void);
const char *ibp_error_string(int code);

/* Threads used by the parallel loops (default, n <= 0: OpenMP's count), at most
 * IBP_MAX_THREADS, whichever way they were asked for: 100,000 crashed the process
 * (OpenMP's team could not be had). */
#define IBP_MAX_THREADS 1024
void ibp_set_num_threads(int n);
int ibp_get_num_threads(void);
/* Lookups keep buffers with each thread that ran them (a cache of decoded rows, the
 * deduplication scratch, decode plans: up to tens of MB a thread), so that the next
 * call allocates and page-faults nothing. This frees them on the calling thread and
 * the ibp_get_num_threads() workers of its OpenMP team (the team its lookups run on),
 * and returns the bytes freed; the next lookups allocate them again. Each application
 * thread that runs lookups has its own team: call it from each, between its lookups. */
uint64_t ibp_release_thread_buffers(void);
/* Row-kernel instruction sets, best first chosen at load time. */
#define IBP_ISA_GENERIC 0 /* portable C: extract/deposit by bit loops */
#define IBP_ISA_V3 1      /* x86-64-v3: BMI2 pext/pdep */
#define IBP_ISA_AVX512 2  /* AVX-512 (VBMI, VBMI2, VPOPCNTDQ, BITALG): 8, 16, 32 words per step for W = 64, 32, 16 */
#define IBP_ISA_V3_NO_PDEP 3 /* x86-64-v3 with the portable bit loops for pext/pdep, which AMD Zen 1 and 2 microcode */
#define IBP_ISA_COUNT 4      /* kernel sets are numbered 0 .. IBP_ISA_COUNT - 1 */
int ibp_isa(void);
/* Force a kernel set (tests, benchmarks); IBP_E_ARG if this CPU lacks it. */
int ibp_set_isa(int isa);

/* Bytes of one core's L2 cache as libibp takes them (sysconf at load time, 256 KB to 64
 * MB; 1 MB where the system does not say): what its rules of thumb compare tables,
 * scratches and outputs with (ibp_spans.inc, ibp_pool.inc). */
uint64_t ibp_l2_bytes(void);
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
/* Structural check of a table: codebook, offsets monotone and in bounds, row
 * lengths, cluster ids, fixed_len (every row that long, if set). Returns
 * IBP_E_CORRUPT and the first bad row in *bad_row. */
int ibp_validate(const ibp_table *t, uint64_t *bad_row);
/* The fixed_len the index of t says (one pass over it), 0 where rows differ in
 * length, their spans would not fill the payload, or t has no index (raw, or a
 * store's view). */
uint32_t ibp_fixed_row_bytes(const ibp_table *t);

/* Decode rows idx[0..n_idx) (all rows when idx is NULL) into out, row_bytes each. */
int ibp_decode(const ibp_table *t, const int64_t *idx, uint64_t n_idx, uint8_t *out);

/* Pooled lookup: bag b pools rows indices[offsets[b] .. offsets[b+1]), each scaled
 * by weights[i] when weights is not NULL; MEAN divides by the bag size (empty
 * bags give zeros). The table holds elements of dtype (IBP_DTYPE_*), dim of them
 * per row; out is [n_bags][dim] float32. */
int ibp_lookup(const ibp_table *t, int dtype, uint32_t dim,
               const int64_t *indices, const int64_t *offsets, uint64_t n_bags,
               const float *weights, int mode, float *out);

/* One pooled lookup of a batch, as ibp_lookup, that writes bag b's pooled row at
 * out + b * out_stride (out_stride >= dim floats): the jobs of one call can fill
 * the columns of one [n_bags][sum of dims] output, as FBGEMM's TBE does.
 * n_indices is the length of indices (and of weights, when given): the offsets
 * must run from 0 to it without decreasing, so that a job never reads past them. */
typedef struct ibp_lookup_job {
    const ibp_table *table;
    int dtype;
    uint32_t dim;
    const int64_t *indices;
    uint64_t n_indices;
    const int64_t *offsets;
    uint64_t n_bags;
    const float *weights;
    int mode;
    float *out;
    uint64_t out_stride;
} ibp_lookup_job;

/* Run n_jobs lookups (of a batch's tables) together, their bags spread over the
 * threads in one parallel region (none with one thread). On an error, *failed_job
 * (when not NULL) is the first job that failed; the outputs are then unspecified. */
int ibp_lookup_many(const ibp_lookup_job *jobs, uint64_t n_jobs, uint64_t *failed_job);

/* One job of ibp_lookup_keyed: pools key `key` of the batch from `table`, or from
 * `copy` (a raw table of the same rows, decoded, or NULL) where the job has fewer
 * than copy_below ids and more than none. */
typedef struct ibp_keyed_job {
    const ibp_table *table;
    const ibp_table *copy;
    uint64_t copy_below;
    uint64_t key;
    int dtype;
    uint32_t dim;
    int mode;
} ibp_keyed_job;

/* ibp_lookup_many over a batch laid out as a KeyedJaggedTensor's (TorchRec's and
 * FBGEMM's TBE layout): values [n_values] ids, weights [n_values] or NULL, offsets
 * [n_keys * n_bags + 1] running from 0 to n_values without decreasing (bag b of key
 * k: values[offsets[k * n_bags + b] .. offsets[k * n_bags + b + 1])). Job j pools
 * its key into columns [D_0 + .. + D_{j-1}, + D_j) of out ([n_bags][sum of dims]
 * float32). *copies_wanted (when not NULL) counts the jobs that would have pooled
 * from a copy they lack (copy NULL, copy_below reached): they pool from their table.
 * Errors as ibp_lookup_many's; *failed_job = n_jobs where no job failed (bad offsets or
 * arguments: IBP_E_ARG; IBP_E_NOMEM). The offsets are read once, before any lookup. */
int ibp_lookup_keyed(const ibp_keyed_job *jobs, uint64_t n_jobs, const int64_t *values, uint64_t n_values,
                     const int64_t *offsets, uint64_t n_keys, uint64_t n_bags, const float *weights,
                     float *out, uint64_t *failed_job, uint64_t *copies_wanted);

/* The same with each job's own arrays (the jobs' keys unused): job j pools
 * indices[j] ([n_indices[j]] ids), bags offsets[j] ([n_bags + 1], from 0 to
 * n_indices[j] without decreasing), weights[j] (or none: weights or weights[j] NULL).
 * Errors as ibp_lookup_keyed's; these arrays are read where the lookup reads them (the
 * caller must not write them during the call). */
int ibp_lookup_lists(const ibp_keyed_job *jobs, uint64_t n_jobs, const int64_t *const *indices,
                     const uint64_t *n_indices, const int64_t *const *offsets, const float *const *weights,
                     uint64_t n_bags, float *out, uint64_t *failed_job, uint64_t *copies_wanted);

/* ---- Updatable tables (training) ----
 * An ibp_store holds a table whose rows can be rewritten: rows are grouped in blocks
 * of up to 64 rows (about 4 KB raw), each block packed with a little headroom; a
 * block whose rows outgrow it moves to the end of the arena, and the arena is
 * compacted in place once the space abandoned that way is worth reclaiming.
 *
 * Concurrency: every function may be called from any thread at any time. Reads
 * (decode, lookup, export, info) share a reader/writer lock; writes (update,
 * backward, compact, reset) hold it exclusively, so a read never sees a row half
 * rewritten nor memory a write freed. Writers are preferred (no starvation). */
typedef struct ibp_store ibp_store;

typedef struct ibp_store_info {
    uint64_t n_rows;
    uint32_t row_bytes, word_bits, n_clusters, block_rows;
    uint64_t live_bytes;   /* encoded rows */
    uint64_t slack_bytes;  /* headroom left inside blocks */
    uint64_t dead_bytes;   /* space of moved blocks, reclaimed by compaction */
    uint64_t free_bytes;   /* allocated past the last block (tail pad included) */
    uint64_t arena_bytes;  /* = live + slack + dead + free */
    uint64_t index_bytes;  /* per-row and per-block index */
    uint64_t meta_bytes;   /* masks, bitvals and their bit counts */
    uint64_t moves;        /* blocks moved since creation */
    uint64_t compactions;
} ibp_store_info;

/* A store holding a copy of packed table t (its codebook and rows). */
int ibp_store_create(const ibp_table *t, ibp_store **out);
void ibp_store_destroy(ibp_store *s);
/* Replace the store's codebook and rows by packed table t's (a repack). */
int ibp_store_reset(ibp_store *s, const ibp_table *t);
int ibp_store_info_get(ibp_store *s, ibp_store_info *out);
int ibp_store_decode(ibp_store *s, const int64_t *idx, uint64_t n_idx, uint8_t *out);
int ibp_store_lookup(ibp_store *s, int dtype, uint32_t dim, const int64_t *indices,
                     const int64_t *offsets, uint64_t n_bags, const float *weights, int mode,
                     float *out);
/* Packed copy of the rows: offsets [n_rows + 1], payload of payload_cap bytes
 * (at least live_bytes + ibp_tail_pad; IBP_E_ARG when smaller, offsets then hold
 * the sizes needed). */
int ibp_store_export(ibp_store *s, uint64_t *offsets, uint8_t *payload, uint64_t payload_cap);
/* Rewrite rows ids[0..n) (strictly increasing) with raw rows (n x row_bytes). */
int ibp_store_update(ibp_store *s, const int64_t *ids, uint64_t n, const uint8_t *rows);
/* Move every block back to back (dead space becomes free), trim the headroom. */
int ibp_store_compact(ibp_store *s);

/* Sparse optimizers of FBGEMM's fused TBE (fp32 rows), applied in backward. */
#define IBP_OPT_SGD 0             /* EXACT_SGD */
#define IBP_OPT_ADAGRAD 1         /* EXACT_ADAGRAD: momentum1 [n_rows * dim] */
#define IBP_OPT_ROWWISE_ADAGRAD 2 /* EXACT_ROWWISE_ADAGRAD: momentum1 [n_rows] */
#define IBP_WD_NONE 0
#define IBP_WD_L2 1
#define IBP_WD_DECOUPLE 2

typedef struct ibp_sparse_optim {
    int32_t kind;
    int32_t weight_decay_mode; /* row-wise Adagrad only */
    float learning_rate;
    float eps;
    float weight_decay;
    uint32_t reserved;
    float *momentum1;          /* NULL for SGD */
} ibp_sparse_optim;

/* Backward of pooled lookups fused with the optimizer step, as FBGEMM's CPU TBE
 * does it, for a table of dtype IBP_DTYPE_F32 / F16 / BF16 (16-bit rows are updated
 * in float32 and rounded to nearest even): n_features features read the table; feature f's
 * bags are offsets[f * batch + b .. + 1] into indices (offsets[0] = 0);
 * grad (batch rows of grad_stride floats) holds feature f's output gradient at
 * column grad_col[f]. Each distinct row gets the sum of its occurrences'
 * gradients (in occurrence order; scaled by the per-sample weight, or 1/L for
 * MEAN bags without weights), then one optimizer step; the row is re-encoded. */
int ibp_store_backward(ibp_store *s, const ibp_sparse_optim *opt, int dtype, uint32_t n_features,
                       uint64_t batch, const int64_t *indices, const int64_t *offsets,
                       const float *weights, int mode, const float *grad,
                       uint64_t grad_stride, const uint64_t *grad_col);
/* CFFI_END */

#ifdef __cplusplus
}
#endif
#endif /* IBP_H */
