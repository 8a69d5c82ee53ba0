/* ibp.c - libibp's public entry points: argument checks, statistics for mask
 * building, table validation, checksums and the run-time choice of row kernels. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <omp.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif

#include "ibp_bits.h"
#include "ibp_internal.h"

static int g_threads = 0; /* 0: OpenMP's default */
#define IBP_HIST_MAX_ROW_BYTES 8192 /* bit counting by byte histograms up to 16 MB a thread */

int ibp_abi_version(void) { return IBP_ABI_VERSION; }
int ibp_format_version(void) { return IBP_FORMAT_VERSION; }

const char *ibp_error_string(int code)
{
    switch (code) {
    case IBP_OK: return "ok";
    case IBP_E_ARG: return "invalid argument";
    case IBP_E_INDEX: return "row index out of range";
    case IBP_E_CORRUPT: return "compressed data is corrupt";
    case IBP_E_NOMEM: return "out of memory";
    default: return "unknown error";
    }
}

static int cpu_amd(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    unsigned a, b, c, d;
    return __get_cpuid(0, &a, &b, &c, &d) &&
           ((b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163) || /* AuthenticAMD */
            (b == 0x6f677948 && d == 0x6e65476e && c == 0x656e6975));  /* HygonGenuine */
#else
    return 0;
#endif
}

static uint64_t g_l2_bytes = (uint64_t)1 << 20;
static int g_amd;

/* Read when the library loads: a lazy read would race with concurrent callers. The
 * clamp guards against nonsense from virtual machines. */
__attribute__((constructor)) static void cache_init(void)
{
#ifdef _SC_LEVEL2_CACHE_SIZE /* glibc */
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (l2 >= (256L << 10) && l2 <= (64L << 20))
        g_l2_bytes = (uint64_t)l2;
#endif
    g_amd = cpu_amd();
}

uint64_t ibp_l2_bytes(void) { return g_l2_bytes; }
int ibp_cpu_amd(void) { return g_amd; }

void ibp_set_num_threads(int n) { g_threads = n <= 0 ? 0 : n > IBP_MAX_THREADS ? IBP_MAX_THREADS : n; }
int ibp_threads(void)
{
    const int n = g_threads > 0 ? g_threads : omp_get_max_threads(); /* OMP_NUM_THREADS is not capped */
    return n > IBP_MAX_THREADS ? IBP_MAX_THREADS : n;
}
int ibp_get_num_threads(void) { return ibp_threads(); }

/* Whether pext and pdep are microcoded: AMD family 17h (Zen, Zen+, Zen 2) and its
 * Hygon relative, family 18h. Zen 3 (19h) and later do them in a few cycles. */
static int slow_pdep(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    unsigned a, b, c, d;
    if (!cpu_amd() || !__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    const unsigned family = ((a >> 8) & 0xf) == 0xf ? 0xf + ((a >> 20) & 0xff) : (a >> 8) & 0xf;
    return family == 0x17 || family == 0x18;
#else
    return 0;
#endif
}

static int cpu_has(int isa)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    int v3 = __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
             __builtin_cpu_supports("popcnt") && __builtin_cpu_supports("lzcnt");
    if (isa == IBP_ISA_V3 || isa == IBP_ISA_V3_NO_PDEP)
        return v3;
    if (isa == IBP_ISA_AVX512)
        return v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vbmi2") &&
               __builtin_cpu_supports("avx512vpopcntdq") &&
               __builtin_cpu_supports("avx512bitalg");
#endif
    return isa == IBP_ISA_GENERIC;
}

static const ibp_kernels *const isa_kernels[] = {
    &ibp_kernels_generic, &ibp_kernels_v3, &ibp_kernels_avx512, &ibp_kernels_v3_no_pdep,
};
_Static_assert(sizeof isa_kernels / sizeof *isa_kernels == IBP_ISA_COUNT, "a kernel set per IBP_ISA_*");
static int g_isa = -1;

static const ibp_kernels *kernels(void)
{
    if (g_isa < 0)
        g_isa = cpu_has(IBP_ISA_AVX512) ? IBP_ISA_AVX512
              : !cpu_has(IBP_ISA_V3)    ? IBP_ISA_GENERIC
              : slow_pdep()             ? IBP_ISA_V3_NO_PDEP
                                        : IBP_ISA_V3;
    return isa_kernels[g_isa];
}

const ibp_kernels *ibp_active_kernels(void) { return kernels(); }

uint64_t ibp_release_thread_buffers(void)
{
    uint64_t freed = 0;
#pragma omp parallel num_threads(ibp_threads()) reduction(+ : freed)
    for (int isa = 0; isa < IBP_ISA_COUNT; isa++) /* any set may have run (ibp_set_isa) */
        if (cpu_has(isa))
            freed += isa_kernels[isa]->release_thread_buffers();
    return freed;
}

int ibp_isa(void)
{
    kernels();
    return g_isa;
}

int ibp_set_isa(int isa)
{
    if (isa < 0 || isa >= IBP_ISA_COUNT || !cpu_has(isa))
        return IBP_E_ARG;
    g_isa = isa;
    return IBP_OK;
}

uint64_t ibp_tail_pad(uint32_t row_bytes, uint32_t word_bits)
{
    return ibp_tail_pad_bytes(row_bytes, word_bits); /* ibp_bits.h, shared with the CUDA code */
}

uint32_t ibp_rel_bytes(uint32_t row_bytes)
{
    uint64_t max_rel = (uint64_t)(IBP_BLOCK_ROWS - 1) * row_bytes;
    if (max_rel <= UINT16_MAX)
        return 2;
    if (max_rel <= UINT32_MAX)
        return 4;
    return 0;
}

/* ---- CRC-32C (Castagnoli), hardware instruction when the CPU has SSE4.2 ---- */

static uint32_t crc_table[256];

/* Built when the library loads: a lazy build would race with concurrent callers. */
__attribute__((constructor)) static void crc_init_table(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc_table[i] = c;
    }
}

static uint32_t crc32c_portable(uint32_t c, const uint8_t *p, size_t n)
{
    while (n--)
        c = crc_table[(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t c, const uint8_t *p,
                                                                size_t n)
{
    uint64_t c64 = c;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c64 = _mm_crc32_u64(c64, v);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--)
        c = _mm_crc32_u8(c, *p++);
    return c;
}
#endif

uint32_t ibp_crc32c(uint32_t crc, const void *data, size_t n)
{
    uint32_t c = ~crc;
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("sse4.2"))
        return ~crc32c_sse42(c, data, n);
#endif
    return ~crc32c_portable(c, data, n);
}

/* ---- argument checks ---- */

static int check_shape(uint32_t row_bytes, uint32_t word_bits)
{
    if (word_bits != 16 && word_bits != 32 && word_bits != 64)
        return IBP_E_ARG;
    if (row_bytes == 0 || ibp_rel_bytes(row_bytes) == 0)
        return IBP_E_ARG;
    return IBP_OK;
}

static int check_codebook(const ibp_codebook *cb)
{
    if (!cb || (cb->n_clusters && (!cb->masks || !cb->bitvals || !cb->vbits)))
        return IBP_E_ARG; /* K = 0 (raw) reads no masks */
    if (check_shape(cb->row_bytes, cb->word_bits) != IBP_OK)
        return IBP_E_ARG;
    uint32_t B = cb->word_bits / 8;
    if (cb->n_words != (cb->row_bytes + B - 1) / B)
        return IBP_E_ARG;
    if (cb->n_clusters > 256)
        return IBP_E_ARG;
    uint64_t wmask = ibp_low_bits(cb->word_bits);
    for (uint64_t q = 0; q < (uint64_t)cb->n_clusters * cb->n_words; q++) {
        if ((cb->masks[q] & ~wmask) || (cb->bitvals[q] & ~cb->masks[q]))
            return IBP_E_CORRUPT;
        if (cb->vbits[q] != cb->word_bits - ibp_popcount64(cb->masks[q]))
            return IBP_E_ARG;
    }
    return IBP_OK;
}

static int check_sel(const int64_t *sel, uint64_t n_sel, uint64_t n_rows)
{
    if (!sel)
        return IBP_OK;
    for (uint64_t s = 0; s < n_sel; s++)
        if (sel[s] < 0 || (uint64_t)sel[s] >= n_rows)
            return IBP_E_INDEX;
    return IBP_OK;
}

/* ---- statistics ---- */

int ibp_bit_counts(const uint8_t *rows, uint64_t n_rows, uint32_t row_bytes,
                   uint32_t word_bits, const int64_t *sel, uint64_t n_sel, uint64_t *counts)
{
    int rc = check_shape(row_bytes, word_bits);
    if (rc == IBP_OK)
        rc = check_sel(sel, n_sel, n_rows);
    if (rc != IBP_OK || !counts || (n_rows && !rows))
        return rc != IBP_OK ? rc : IBP_E_ARG;
    const uint32_t B = word_bits / 8, M = (row_bytes + B - 1) / B;
    const uint64_t n = sel ? n_sel : n_rows;
    memset(counts, 0, (size_t)M * word_bits * sizeof(uint64_t));
    int err = IBP_OK;
    /* Per thread, a 256-bin histogram per byte position: one increment per byte
     * instead of one per bit; bits are summed out of the histograms at the end.
     * Rows too wide for that (2 KB of histogram a byte) count bit by bit. */
    const int by_hist = row_bytes <= IBP_HIST_MAX_ROW_BYTES;
    const size_t cells = by_hist ? (size_t)row_bytes * 256 : (size_t)row_bytes * 8;
#pragma omp parallel num_threads(ibp_threads()) if (n >= 4096)
    {
        uint64_t *local = calloc(cells, sizeof(uint64_t));
        if (!local)
            __atomic_store_n(&err, IBP_E_NOMEM, __ATOMIC_RELAXED);
#pragma omp for schedule(static)
        for (uint64_t s = 0; s < n; s++) {
            if (!local)
                continue; /* every thread must reach the loop; the error is set */
            const uint8_t *row = rows + (uint64_t)(sel ? (uint64_t)sel[s] : s) * row_bytes;
            if (by_hist)
                for (uint32_t c = 0; c < row_bytes; c++)
                    local[(size_t)c * 256 + row[c]]++;
            else
                for (uint32_t c = 0; c < row_bytes; c++)
                    for (uint32_t b = 0; b < 8; b++)
                        local[(size_t)c * 8 + b] += row[c] >> b & 1;
        }
        if (local) {
#pragma omp critical
            for (uint32_t c = 0; c < row_bytes; c++) {
                /* byte c, bit b is word c / B, bit 8 (c % B) + b: index c * 8 + b */
                if (!by_hist) {
                    for (uint32_t b = 0; b < 8; b++)
                        counts[(size_t)c * 8 + b] += local[(size_t)c * 8 + b];
                    continue;
                }
                for (uint32_t v = 1; v < 256; v++) {
                    uint64_t h = local[(size_t)c * 256 + v];
                    if (!h)
                        continue;
                    for (uint32_t b = 0; b < 8; b++)
                        if (v >> b & 1)
                            counts[(size_t)c * 8 + b] += h;
                }
            }
            free(local);
        }
    }
    return err;
}

int ibp_word_costs(const uint8_t *rows, uint64_t n_rows, uint32_t row_bytes, uint32_t word_bits,
                   const int64_t *sel, uint64_t n_sel, const uint64_t *cand_masks,
                   const uint64_t *cand_bitvals, uint32_t n_cand, uint64_t *costs)
{
    int rc = check_shape(row_bytes, word_bits);
    if (rc == IBP_OK)
        rc = check_sel(sel, n_sel, n_rows);
    if (rc != IBP_OK || !costs || !cand_masks || !cand_bitvals || (n_rows && !rows))
        return rc != IBP_OK ? rc : IBP_E_ARG;
    const uint32_t W = word_bits, B = W / 8, M = (row_bytes + B - 1) / B;
    const uint64_t n = sel ? n_sel : n_rows;
    const size_t nc = (size_t)n_cand * M;
    uint8_t *vb = malloc(nc ? nc : 1);
    if (!vb)
        return IBP_E_NOMEM;
    for (size_t q = 0; q < nc; q++)
        vb[q] = (uint8_t)(W - ibp_popcount64(cand_masks[q] & ibp_low_bits(W)));
    memset(costs, 0, nc * sizeof(uint64_t));
    int err = IBP_OK;
#pragma omp parallel num_threads(ibp_threads()) if (n >= 1024)
    {
        uint64_t *local = calloc(nc ? nc : 1, sizeof(uint64_t));
        if (!local)
            __atomic_store_n(&err, IBP_E_NOMEM, __ATOMIC_RELAXED);
#pragma omp for schedule(static)
            for (uint64_t s = 0; s < n; s++) {
                if (!local)
                    continue; /* every thread must reach the loop; the error is set */
                const uint8_t *row = rows + (uint64_t)(sel ? (uint64_t)sel[s] : s) * row_bytes;
                for (uint32_t j = 0; j < M; j++) {
                    uint64_t w = 0;
                    uint32_t at = j * B;
                    memcpy(&w, row + at, at + B <= row_bytes ? B : row_bytes - at);
                    for (uint32_t c = 0; c < n_cand; c++) {
                        size_t q = (size_t)c * M + j;
                        local[q] += ibp_word_cost(w, cand_masks[q], cand_bitvals[q], vb[q], W);
                    }
                }
            }
        if (local) {
#pragma omp critical
            for (size_t q = 0; q < nc; q++)
                costs[q] += local[q];
            free(local);
        }
    }
    free(vb);
    return err;
}

/* ---- encode / decode ---- */

int ibp_assign(const ibp_codebook *cb, const uint8_t *rows, uint64_t n_rows,
               uint8_t *cluster_out, uint32_t *length_out)
{
    int rc = check_codebook(cb);
    if (rc != IBP_OK)
        return rc;
    if (n_rows && !rows)
        return IBP_E_ARG;
    return kernels()->assign(cb, rows, n_rows, cluster_out, length_out);
}

int ibp_encode(const ibp_codebook *cb, const uint8_t *rows, uint64_t n_rows,
               const uint8_t *clusters, const uint64_t *offsets, uint8_t *payload)
{
    int rc = check_codebook(cb);
    if (rc != IBP_OK)
        return rc;
    if ((n_rows && (!rows || !payload)) || !offsets || (cb->n_clusters > 1 && !clusters))
        return IBP_E_ARG;
    return kernels()->encode(cb, rows, n_rows, clusters, offsets, NULL, payload);
}

int ibp_validate(const ibp_table *t, uint64_t *bad_row)
{
    if (bad_row)
        *bad_row = 0;
    if (!t)
        return IBP_E_ARG;
    int rc = check_codebook(&t->cb);
    if (rc != IBP_OK)
        return rc;
    const uint32_t R = t->cb.row_bytes, K = t->cb.n_clusters;
    if (t->block_len) /* store-mode views are built by ibp_store.c, never from outside */
        return IBP_E_ARG;
    if (t->payload_bytes && !t->payload)
        return IBP_E_ARG;
    if (K == 0) /* raw: the rows back to back, nothing else */
        return t->fixed_len                                                 ? IBP_E_ARG
               : t->n_rows <= UINT64_MAX / R && t->payload_bytes == t->n_rows * R ? IBP_OK
                                                                                  : IBP_E_CORRUPT;
    if (!t->block_base || !t->rel)
        return IBP_E_ARG;
    if (t->rel_bytes != ibp_rel_bytes(t->cb.row_bytes))
        return IBP_E_CORRUPT;
    const uint32_t hdr = (K > 1) + (t->cb.n_words + 7) / 8;
    if (ibp_row_start(t, 0) != 0 || ibp_row_start(t, t->n_rows) != t->payload_bytes)
        return IBP_E_CORRUPT;
    /* Lengths fit the payload and are either raw (== R) or at least a header;
     * a decoder reading any row then stays inside payload + tail pad. */
    uint64_t prev = 0;
    for (uint64_t i = 0; i < t->n_rows; i++) {
        uint64_t next = ibp_row_start(t, i + 1);
        uint64_t start = prev, len = next - prev;
        int bad = next < prev;
        prev = next;
        if (bad || len > R || (len < R && (len < hdr || (K > 1 && t->payload[start] >= K))) ||
            (t->fixed_len && len != t->fixed_len)) { /* the rows are read at i * fixed_len */
            if (bad_row)
                *bad_row = i;
            return IBP_E_CORRUPT;
        }
    }
    return IBP_OK;
}

uint32_t ibp_fixed_row_bytes(const ibp_table *t)
{
    if (!t || t->block_len || t->cb.n_clusters == 0 || !t->n_rows || !t->block_base || !t->rel ||
        t->rel_bytes != ibp_rel_bytes(t->cb.row_bytes) || ibp_row_start(t, 0) != 0)
        return 0;
    const uint64_t L = ibp_row_start(t, 1); /* every span then lies in the payload: */
    if (L == 0 || L > t->cb.row_bytes || t->n_rows > UINT64_MAX / L || t->n_rows * L != t->payload_bytes)
        return 0;
    for (uint64_t i = 2, at = 2 * L; i <= t->n_rows; i++, at += L)
        if (ibp_row_start(t, i) != at)
            return 0;
    return (uint32_t)L;
}

int ibp_decode(const ibp_table *t, const int64_t *idx, uint64_t n_idx, uint8_t *out)
{
    if (!t || (!out && (idx ? n_idx : t->n_rows)))
        return IBP_E_ARG;
    return kernels()->decode(t, idx, n_idx, out);
}

static int check_lookup_job(const ibp_lookup_job *j)
{
    if (!j->table || !j->offsets || (j->n_bags && !j->out))
        return IBP_E_ARG;
    if (j->dtype != IBP_DTYPE_F32 && j->dtype != IBP_DTYPE_F16 && j->dtype != IBP_DTYPE_BF16)
        return IBP_E_ARG;
    if (j->mode != IBP_POOL_SUM && j->mode != IBP_POOL_MEAN)
        return IBP_E_ARG;
    uint32_t esize = j->dtype == IBP_DTYPE_F32 ? 4 : 2;
    if ((uint64_t)j->dim * esize != j->table->cb.row_bytes || j->out_stride < j->dim)
        return IBP_E_ARG;
    if (j->offsets[0] != 0 || (uint64_t)j->offsets[j->n_bags] != j->n_indices)
        return IBP_E_ARG;
    for (uint64_t b = 0; b < j->n_bags; b++)
        if (j->offsets[b + 1] < j->offsets[b])
            return IBP_E_ARG;
    if (j->n_indices && !j->indices)
        return IBP_E_ARG;
    return IBP_OK;
}

int ibp_lookup_many(const ibp_lookup_job *jobs, uint64_t n_jobs, uint64_t *failed_job)
{
    if (n_jobs && !jobs)
        return IBP_E_ARG;
    for (uint64_t j = 0; j < n_jobs; j++) {
        int rc = check_lookup_job(&jobs[j]);
        if (rc != IBP_OK) {
            if (failed_job)
                *failed_job = j;
            return rc;
        }
    }
    int stack_errs[64];
    int *errs = n_jobs <= 64 ? stack_errs : malloc(n_jobs * sizeof(int));
    if (!errs)
        return IBP_E_NOMEM;
    for (uint64_t j = 0; j < n_jobs; j++) errs[j] = IBP_OK;
    kernels()->lookup_many(jobs, n_jobs, errs);
    int rc = IBP_OK;
    for (uint64_t j = 0; j < n_jobs && rc == IBP_OK; j++)
        if (errs[j] != IBP_OK) {
            rc = errs[j];
            if (failed_job)
                *failed_job = j;
        }
    if (errs != stack_errs)
        free(errs);
    return rc;
}

/* The table job kj pools its n ids from: its copy where it has fewer than copy_below
 * (and some), counted in *wanted where it has none. */
static const ibp_table *keyed_source(const ibp_keyed_job *kj, uint64_t n, uint64_t *wanted)
{
    if (n > 0 && n < kj->copy_below) {
        if (kj->copy)
            return kj->copy;
        if (wanted)
            (*wanted)++;
    }
    return kj->table;
}

/* The jobs are filled here rather than by the caller: in Python, NumPy's stores of a
 * batch's pointers and counts into the jobs took 26 of the 33 us a B1 x P20 call into
 * the 26 Criteo tables took (the lookup 7 of them; ad-hoc timings, a Zen 4 EPYC). */
int ibp_lookup_keyed(const ibp_keyed_job *jobs, uint64_t n_jobs, const int64_t *values, uint64_t n_values,
                     const int64_t *offsets, uint64_t n_keys, uint64_t n_bags, const float *weights,
                     float *out, uint64_t *failed_job, uint64_t *copies_wanted)
{
    if (copies_wanted)
        *copies_wanted = 0;
    if (failed_job)
        *failed_job = n_jobs;
    if (n_jobs == 0)
        return IBP_OK;
    const uint64_t cap = SIZE_MAX / sizeof(int64_t) / 4; /* keeps the sizes below from overflowing */
    if (!jobs || !offsets || (n_values && !values) || (n_bags && !out) || n_bags >= cap ||
        n_keys >= cap / (n_bags + 2))
        return IBP_E_ARG;
    uint64_t width = 0;
    for (uint64_t j = 0; j < n_jobs; j++) {
        if (jobs[j].key >= n_keys || !jobs[j].table) {
            if (failed_job)
                *failed_job = j;
            return IBP_E_ARG;
        }
        width += jobs[j].dim;
    }
    /* One read of the offsets, which the checks and the jobs share: each key's first
     * offset (los) and its bags' offsets from it (rel: a job's offsets start at 0). */
    ibp_lookup_job stack_jobs[32];
    ibp_lookup_job *lj = n_jobs <= 32 ? stack_jobs : malloc(n_jobs * sizeof(ibp_lookup_job));
    int64_t *rel = malloc(n_keys * (n_bags + 2) * sizeof(int64_t) + sizeof(int64_t));
    int rc = lj && rel ? IBP_OK : IBP_E_NOMEM;
    int64_t *los = rel ? rel + n_keys * (n_bags + 1) : NULL, end = rc == IBP_OK ? offsets[0] : 0;
    if (end != 0)
        rc = IBP_E_ARG;
    for (uint64_t k = 0; k < n_keys && rc == IBP_OK; k++) {
        int64_t *r = rel + k * (n_bags + 1);
        los[k] = end;
        r[0] = 0;
        for (uint64_t b = 1; b <= n_bags; b++) {
            const int64_t v = offsets[k * n_bags + b];
            if (v < end) { /* (before v - los[k], which could overflow) */
                rc = IBP_E_ARG;
                break;
            }
            r[b] = v - los[k];
            end = v;
        }
    }
    if (rc == IBP_OK && (uint64_t)end != n_values)
        rc = IBP_E_ARG;
    if (rc == IBP_OK) {
        uint64_t col = 0;
        for (uint64_t j = 0; j < n_jobs; j++) {
            const ibp_keyed_job *kj = &jobs[j];
            const int64_t *r = rel + kj->key * (n_bags + 1);
            const uint64_t lo = (uint64_t)los[kj->key], n = (uint64_t)r[n_bags];
            lj[j] = (ibp_lookup_job){keyed_source(kj, n, copies_wanted), kj->dtype, kj->dim,
                                     values ? values + lo : NULL, n, r, n_bags, weights ? weights + lo : NULL,
                                     kj->mode, out ? out + col : NULL, width};
            col += kj->dim;
        }
        rc = ibp_lookup_many(lj, n_jobs, failed_job);
    }
    if (lj != stack_jobs)
        free(lj);
    free(rel);
    return rc;
}

int ibp_lookup_lists(const ibp_keyed_job *jobs, uint64_t n_jobs, const int64_t *const *indices,
                     const uint64_t *n_indices, const int64_t *const *offsets, const float *const *weights,
                     uint64_t n_bags, float *out, uint64_t *failed_job, uint64_t *copies_wanted)
{
    if (copies_wanted)
        *copies_wanted = 0;
    if (failed_job)
        *failed_job = n_jobs;
    if (n_jobs == 0)
        return IBP_OK;
    if (!jobs || !indices || !n_indices || !offsets)
        return IBP_E_ARG;
    uint64_t width = 0;
    for (uint64_t j = 0; j < n_jobs; j++) width += jobs[j].dim;
    ibp_lookup_job stack_jobs[32];
    ibp_lookup_job *lj = n_jobs <= 32 ? stack_jobs : malloc(n_jobs * sizeof(ibp_lookup_job));
    if (!lj)
        return IBP_E_NOMEM;
    uint64_t col = 0;
    for (uint64_t j = 0; j < n_jobs; j++) {
        const ibp_keyed_job *kj = &jobs[j];
        lj[j] = (ibp_lookup_job){kj->table ? keyed_source(kj, n_indices[j], copies_wanted) : NULL, kj->dtype,
                                 kj->dim, indices[j], n_indices[j], offsets[j], n_bags, weights ? weights[j] : NULL,
                                 kj->mode, out ? out + col : NULL, width};
        col += kj->dim;
    }
    int rc = ibp_lookup_many(lj, n_jobs, failed_job); /* checks each job (its offsets: from 0 to n_indices) */
    if (lj != stack_jobs)
        free(lj);
    return rc;
}

int ibp_lookup(const ibp_table *t, int dtype, uint32_t dim, const int64_t *indices,
               const int64_t *offsets, uint64_t n_bags, const float *weights, int mode,
               float *out)
{
    /* the offsets are trusted to end within indices, as this function always did */
    const uint64_t n_indices = offsets && offsets[n_bags] > 0 ? (uint64_t)offsets[n_bags] : 0;
    const ibp_lookup_job job = {t, dtype, dim, indices, n_indices, offsets, n_bags, weights, mode, out, dim};
    return ibp_lookup_many(&job, 1, NULL);
}
