/* ibp_internal.h - declarations shared by the library's C files (not public). */
#ifndef IBP_INTERNAL_H
#define IBP_INTERNAL_H

#include "ibp.h"

/* One sparse optimizer step over the distinct rows of a batch (ibp_store_backward):
 * occurrences sorted by row, rows[u] holds row ids[u] decoded and receives its
 * updated value. */
typedef struct ibp_train_job {
    const ibp_sparse_optim *opt;
    uint32_t dim;
    int generic;             /* FBGEMM's generic kernel, not its JIT fast path (the table is read
                              * by several features, or is not float32) */
    const int64_t *ids;      /* [n] distinct rows, increasing */
    const uint64_t *seg;     /* [n + 1] occurrences of row u: occ[seg[u] .. seg[u + 1]) */
    const uint32_t *occ;     /* sorted occurrences: position in indices */
    const uint32_t *occ_bag; /* [positions] feature * batch + bag */
    const float *occ_scale;  /* [positions] scale, or NULL: unweighted sum */
    const float *grad;
    uint64_t grad_stride;
    const uint64_t *grad_col;
    uint64_t batch;
    float *rows;             /* [n][dim] */
} ibp_train_job;

/* Row kernels, compiled once per instruction set (ibp_isa_*.c). */
typedef struct ibp_kernels {
    int (*assign)(const ibp_codebook *cb, const uint8_t *rows, uint64_t n_rows,
                  uint8_t *cluster_out, uint32_t *length_out);
    /* lengths NULL: row i takes starts[i + 1] - starts[i] bytes (packed layout). */
    int (*encode)(const ibp_codebook *cb, const uint8_t *rows, uint64_t n_rows,
                  const uint8_t *clusters, const uint64_t *starts, const uint32_t *lengths,
                  uint8_t *payload);
    int (*decode)(const ibp_table *t, const int64_t *idx, uint64_t n_idx, uint8_t *out);
    /* Checked jobs; errs[j] receives job j's error (IBP_OK: none). */
    void (*lookup_many)(const ibp_lookup_job *jobs, uint64_t n_jobs, int *errs);
    /* Optimizer step of n distinct rows (ibp_optim.inc). */
    int (*train_rows)(const ibp_train_job *job, uint64_t first, uint64_t last);
    /* n elements of a float16 / bfloat16 row buffer to float32 (to_float) or back,
     * rounding to nearest even. */
    void (*convert)(int dtype, int to_float, const void *src, uint64_t n, void *dst);
    /* Frees the calling thread's buffers (row cache, dedup scratch, decode plan);
     * returns the bytes they held. */
    uint64_t (*release_thread_buffers)(void);
} ibp_kernels;

extern const ibp_kernels ibp_kernels_generic;
extern const ibp_kernels ibp_kernels_v3; /* x86-64-v3: BMI2 pext/pdep, AVX2, FMA, F16C */
extern const ibp_kernels ibp_kernels_avx512;
extern const ibp_kernels ibp_kernels_v3_no_pdep; /* the v3 kernels with portable extract/deposit */

int ibp_threads(void);
/* Whether the CPU is AMD's (or Hygon's): how far pooled rows may lie without
 * prefetches differs from Intel's cores (ibp_pool.inc). */
int ibp_cpu_amd(void);
/* The row kernels of the instruction set in use (ibp.c). */
const ibp_kernels *ibp_active_kernels(void);

/* A packed table whose rows are all raw, at i * R, with no index (K = 0). */
static inline int ibp_raw_layout(const ibp_table *t)
{
    return t->cb.n_clusters == 0 && !t->block_len;
}

/* Start of row i in the payload of a packed table (i may be n_rows: its end). */
static inline uint64_t ibp_row_start(const ibp_table *t, uint64_t i)
{
    if (t->cb.n_clusters == 0)
        return i * t->cb.row_bytes;
    uint64_t rel = t->rel_bytes == 2 ? ((const uint16_t *)t->rel)[i]
                                     : ((const uint32_t *)t->rel)[i];
    return t->block_base[i / IBP_BLOCK_ROWS] + rel;
}

/* Whether rows are found through the index: not for a raw table, nor where every
 * row has one length (fixed_len). */
static inline int ibp_reads_index(const ibp_table *t)
{
    return !ibp_raw_layout(t) && !t->fixed_len;
}

/* Where row i is stored and how long it is, in any layout. */
static inline void ibp_row_span(const ibp_table *t, uint64_t i, uint64_t *start, uint64_t *len)
{
    if (t->fixed_len) {
        *start = i * t->fixed_len;
        *len = t->fixed_len;
    } else if (t->block_len) { /* a store's view (any K) */
        const uint16_t *rel = (const uint16_t *)t->rel;
        uint64_t b = i >> t->block_shift, next = i + 1;
        uint64_t end = (next >> t->block_shift) != b || next == t->n_rows ? t->block_len[b] : rel[next];
        *start = t->block_base[b] + rel[i];
        *len = end - rel[i];
    } else {
        *start = ibp_row_start(t, i);
        *len = ibp_row_start(t, i + 1) - *start;
    }
}

/* ibp_row_spans' loop over an index of 4-byte (`wide`, a constant) or 2-byte entries. */
static inline __attribute__((always_inline)) void ibp_row_spans_rel(const ibp_table *t, const int wide,
                                                                    const int64_t *ids, uint64_t n, uint64_t *start,
                                                                    uint64_t *len)
{
    const uint64_t *base = t->block_base;
    const void *rel = t->rel;
    for (uint64_t r = 0; r < n; r++) {
        const uint64_t i = (uint64_t)ids[r];
        const uint64_t at = wide ? ((const uint32_t *)rel)[i] : ((const uint16_t *)rel)[i];
        const uint64_t next = wide ? ((const uint32_t *)rel)[i + 1] : ((const uint16_t *)rel)[i + 1];
        const uint64_t from = base[i / IBP_BLOCK_ROWS] + at;
        start[r] = from;
        len[r] = base[(i + 1) / IBP_BLOCK_ROWS] + next - from;
    }
}

/* ibp_row_span of rows ids[0..n) (in range), with the layout read once: the loop of
 * ibp_row_span calls read the table's fields again for every row (its stores to
 * start and len may alias them) and tested the layout twice a row. 1 thread,
 * benchmarks.ab, both orders and the builds swapped: fp16 d64 rows in cache
 * 0.90-0.95x the time, lookups into 22k rows 0.90-0.97x; fp32 d128 within noise. */
static inline void ibp_row_spans(const ibp_table *t, const int64_t *ids, uint64_t n, uint64_t *start, uint64_t *len)
{
    if (t->fixed_len) {
        const uint64_t L = t->fixed_len;
        for (uint64_t r = 0; r < n; r++) start[r] = (uint64_t)ids[r] * L, len[r] = L;
    } else if (t->block_len || t->cb.n_clusters == 0)
        for (uint64_t r = 0; r < n; r++) ibp_row_span(t, (uint64_t)ids[r], &start[r], &len[r]);
    else if (t->rel_bytes == 2)
        ibp_row_spans_rel(t, 0, ids, n, start, len);
    else
        ibp_row_spans_rel(t, 1, ids, n, start, len);
}

/* Prefetch the lines of bytes [start, start + len) of payload: into L1 (and L2), or
 * where l2 into L2 only. */
static inline void prefetch_lines(const uint8_t *payload, uint64_t start, uint64_t len, int l2)
{
    for (uint64_t a = start & ~(uint64_t)63; a < start + len; a += 64)
        if (l2)
            __builtin_prefetch(payload + a, 0, 1);
        else
            __builtin_prefetch(payload + a);
}

/* The payload lines [next, end) of a row decoded later, which a row decoder
 * prefetches a line a step (see decode_spans_w in ibp_rowcodec.inc). */
typedef struct step_prefetch {
    const uint8_t *next, *end;
    const uint8_t *spare; /* prefetched once next reaches end: a line in L1 (of the row being decoded) */
    int l2; /* into L2 only (a constant where the decoders are inlined; see decode_spans_cold_w) */
} step_prefetch;

/* The lines of bytes [start, start + len) of payload (len >= 1) for step_prefetch_line. */
static inline step_prefetch step_prefetch_of(const uint8_t *payload, uint64_t start, uint64_t len,
                                             const uint8_t *spare, int l2)
{
    return (step_prefetch){payload + (start & ~(uint64_t)63), payload + start + len, spare, l2};
}

/* No row to prefetch: step_prefetch_line prefetches `row` (the one being decoded). */
static inline step_prefetch step_prefetch_none(const uint8_t *row, int l2)
{
    return (step_prefetch){row, row, row, l2};
}

/* Prefetch the next line of pf (may be NULL), or once its lines are done the spare
 * line: one prefetch a step whatever the row's length. A branch on it is one the
 * predictor cannot learn: fp16 d64 rows of 114 bytes span two lines or three by
 * where they start. Rows in cache in a new order every call (benchmarks.ab
 * decode-fresh, 1 thread, both orders and the builds swapped; a Zen 4 EPYC): fp16
 * d64 torchrec init W = 64 (decode_full_rows) 0.86-0.99x the time; rows from memory
 * (decode-cold) 0.93-1.06x, noise. The spare line, not the row's last line again:
 * 0.96-0.98x the time from memory. */
static inline void step_prefetch_line(step_prefetch *pf)
{
    if (pf) {
        const uint8_t *a = pf->next < pf->end ? pf->next : pf->spare;
        if (pf->l2)
            __builtin_prefetch(a, 0, 1);
        else
            __builtin_prefetch(a);
        pf->next += 64;
    }
}

/* Prefetch the lines of bytes [start, start + len) of payload (len >= 1) with `lines`
 * prefetches (as many as the longest rows span), the last line again where the row
 * spans fewer: no loop exit that depends on the row's length and place, as
 * prefetch_lines has (see step_prefetch_line). The address is clamped (a CMOV): GCC
 * made a branch of a choice between the line and a spare one. The count is the
 * table's: a jump into straight prefetches (one the predictor learns), not a loop of
 * eight instructions a line (40 a fp32 d64 row), where perf put a tenth of the packed
 * rows' loop's samples (new fp32 d64 rows in cache). Against the loop (new rows in
 * cache, 1 thread, benchmarks.ab decode-fresh, both orders and the builds swapped; an
 * Emerald Rapids Xeon): fp32 d64 0.87-0.92x the time, fp32 d128 0.82-0.98x,
 * trained-like fp32 d128 0.84-0.96x (W = 32, both orders in one process: 0.82-0.87x),
 * x86-64-v3 fp32 d64 0.90-0.99x; lookups into 101k rows 0.98-1.02x by the medians (Zipf ids: fp32
 * d64, fp16 d64, trained-like fp32 d128; uniform: fp32 d64). The lines go from the
 * last to the first (the cases fall through downwards); from the first to the last,
 * new fp32 d64 rows in cache took 1.01-1.05x the time (trained-like fp32 d128
 * 1.00-1.04x) and Zipf lookups into 101k fp32 d64 rows 0.99-1.00x (the same host and
 * method). */
#define PREFETCH_LINE_K(k)                                                                                         \
    do {                                                                                                           \
        const uint64_t at = a + 64 * (k) < last ? a + 64 * (k) : last;                                             \
        if (l2)                                                                                                    \
            __builtin_prefetch(payload + at, 0, 1);                                                                \
        else                                                                                                       \
            __builtin_prefetch(payload + at);                                                                      \
    } while (0)
static inline void prefetch_lines_fixed(const uint8_t *payload, uint64_t start, uint64_t len, uint32_t lines,
                                        int l2)
{
    const uint64_t last = (start + len - 1) & ~(uint64_t)63, a = start & ~(uint64_t)63;
    switch (lines) {
    default:
        for (uint32_t k = 9; k < lines; k++) PREFETCH_LINE_K(k);
        /* fall through */
    case 9: PREFETCH_LINE_K(8); /* fall through */
    case 8: PREFETCH_LINE_K(7); /* fall through */
    case 7: PREFETCH_LINE_K(6); /* fall through */
    case 6: PREFETCH_LINE_K(5); /* fall through */
    case 5: PREFETCH_LINE_K(4); /* fall through */
    case 4: PREFETCH_LINE_K(3); /* fall through */
    case 3: PREFETCH_LINE_K(2); /* fall through */
    case 2: PREFETCH_LINE_K(1); /* fall through */
    case 1: PREFETCH_LINE_K(0); /* fall through */
    case 0: break;
    }
}
#undef PREFETCH_LINE_K

/* Prefetch a row stored at bytes [start, start + len) of payload, of a table of R-byte
 * rows (R a constant per table: the test is one the predictor learns). Rows of up to
 * IBP_FIXED_PREFETCH_BYTES take prefetch_lines_fixed: in cache in a new order every call
 * (benchmarks.ab decode-fresh, 1 thread, both orders and the builds swapped; a Zen 4),
 * the packed rows' loop took fp32 d64 W = 64 0.82-0.95x the time, trained-like fp32
 * d128 W = 32 0.92-0.95x, fp32 d128 W = 64 0.98-1.01x. Longer rows, where none was
 * measured to gain, keep the loop: one exit a row over many lines costs little, and
 * the fixed count repeats the last line. fp32 d384 lookups (B4096 x P20 Zipf 1.05,
 * 101k rows), the loop against the fixed count: 0.93-0.96x the time in one run (the
 * builds in both positions), 0.87-1.09x in another (the position effect), noise in
 * processes of their own. */
#define IBP_FIXED_PREFETCH_BYTES 512

/* The prefetches prefetch_lines_fixed takes for a row of up to R bytes and the `over`
 * bytes read past it, from anywhere in a line; 0 where rows are longer than
 * IBP_FIXED_PREFETCH_BYTES (prefetch_lines' loop then). */
static inline uint32_t fixed_prefetch_lines(uint64_t R, uint64_t over)
{
    return R <= IBP_FIXED_PREFETCH_BYTES ? (uint32_t)((R + over + 63) / 64 + 1) : 0;
}

static inline void prefetch_row(const uint8_t *payload, uint64_t start, uint64_t len, uint64_t R, int l2)
{
    if (R <= IBP_FIXED_PREFETCH_BYTES)
        prefetch_lines_fixed(payload, start, len, fixed_prefetch_lines(R, 0), l2);
    else
        prefetch_lines(payload, start, len, l2);
}

/* The decode plans a thread keeps (each ISA's IBP_PLAN_FOR), one a codebook, found by
 * the address of its masks (the plan checks they still hold what it was built from)
 * and replaced in turn: one plan a thread, rebuilt at every switch of table, was 52% of
 * a B1 x P20 lookup's native time into the 26 tables of a Criteo-like set (0.9 us a
 * table; fp32 d64, 1 thread, a Zen 4 EPYC). */
#define IBP_PLAN_SLOTS 32
typedef struct plan_slots {
    const void *key[IBP_PLAN_SLOTS]; /* the masks each slot's plan was last taken for */
    uint32_t last, turn;             /* the slot found last; the next to replace */
} plan_slots;

/* The slot of the plan for the codebook whose masks are at `key` (taken, if none). */
static inline uint32_t plan_slot(plan_slots *s, const void *key)
{
    if (s->key[s->last] == key)
        return s->last;
    for (uint32_t i = 0; i < IBP_PLAN_SLOTS; i++)
        if (s->key[i] == key)
            return s->last = i;
    const uint32_t i = s->turn++ % IBP_PLAN_SLOTS;
    s->key[i] = key;
    return s->last = i;
}

#endif /* IBP_INTERNAL_H */
