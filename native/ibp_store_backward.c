/* ibp_store_backward.c - the fused backward of updatable tables: one batch's pooled
 * output gradients reduced per distinct row (occurrences sorted by row) and the sparse
 * optimizer's step (ibp_optim.inc, FBGEMM's arithmetic) applied to the decoded rows,
 * which are then re-encoded in place. */
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "ibp_store_internal.h"

/* ---- backward: row gradients and the optimizer step ---- */

/* order <- positions 0..n-1 sorted by key, stably (LSD radix sort, 11 bits a pass). */
static int sort_by_key(const int64_t *key, uint64_t n, uint64_t key_max, uint32_t *order)
{
    enum { BITS = 11, BUCKETS = 1 << BITS };
    uint32_t *tmp = malloc((n + 1) * 4);
    uint64_t *count = malloc(BUCKETS * 8);
    if (!tmp || !count) {
        free(tmp);
        free(count);
        return IBP_E_NOMEM;
    }
    for (uint64_t p = 0; p < n; p++)
        order[p] = (uint32_t)p;
    uint32_t *src = order, *dst = tmp;
    for (uint32_t shift = 0; shift == 0 || (shift < 64 && (key_max >> shift)); shift += BITS) {
        memset(count, 0, BUCKETS * 8);
        for (uint64_t p = 0; p < n; p++)
            count[((uint64_t)key[src[p]] >> shift) & (BUCKETS - 1)]++;
        uint64_t sum = 0;
        for (uint32_t c = 0; c < BUCKETS; c++) {
            uint64_t v = count[c];
            count[c] = sum;
            sum += v;
        }
        for (uint64_t p = 0; p < n; p++)
            dst[count[((uint64_t)key[src[p]] >> shift) & (BUCKETS - 1)]++] = src[p];
        uint32_t *x = src;
        src = dst;
        dst = x;
    }
    if (src != order)
        memcpy(order, src, n * 4);
    free(tmp);
    free(count);
    return IBP_OK;
}

static int check_backward(const store *s, const ibp_sparse_optim *o, int dtype, uint32_t n_features,
                          uint64_t batch, const int64_t *indices, const int64_t *offsets,
                          int mode, const float *grad, const uint64_t *grad_col)
{
    if (dtype != IBP_DTYPE_F32 && dtype != IBP_DTYPE_F16 && dtype != IBP_DTYPE_BF16)
        return IBP_E_ARG;
    if (!o || !offsets || (n_features && !grad_col) || s->view.cb.row_bytes % (dtype == IBP_DTYPE_F32 ? 4 : 2))
        return IBP_E_ARG;
    if (o->kind != IBP_OPT_SGD && o->kind != IBP_OPT_ADAGRAD && o->kind != IBP_OPT_ROWWISE_ADAGRAD)
        return IBP_E_ARG;
    if (o->kind != IBP_OPT_SGD && !o->momentum1 && s->view.n_rows) /* a table of no rows has no state */
        return IBP_E_ARG;
    if (o->weight_decay_mode < IBP_WD_NONE || o->weight_decay_mode > IBP_WD_DECOUPLE ||
        (o->weight_decay_mode != IBP_WD_NONE && o->kind != IBP_OPT_ROWWISE_ADAGRAD))
        return IBP_E_ARG;
    if (mode != IBP_POOL_SUM && mode != IBP_POOL_MEAN)
        return IBP_E_ARG;
    const uint64_t bags = (uint64_t)n_features * batch;
    if (bags >= UINT32_MAX || offsets[0] != 0)
        return IBP_E_ARG;
    for (uint64_t k = 0; k < bags; k++)
        if (offsets[k + 1] < offsets[k])
            return IBP_E_ARG;
    const uint64_t n = (uint64_t)offsets[bags];
    if (n >= UINT32_MAX || (n && (!indices || !grad)))
        return IBP_E_ARG;
    for (uint64_t p = 0; p < n; p++)
        if (indices[p] < 0 || (uint64_t)indices[p] >= s->view.n_rows)
            return IBP_E_INDEX;
    return IBP_OK;
}

/* Distinct rows of the sorted occurrences: ids[u], occurrences seg[u] .. seg[u + 1]. */
static uint64_t distinct_rows(const int64_t *indices, const uint32_t *occ, uint64_t n, int64_t *ids,
                              uint64_t *seg)
{
    uint64_t u = 0;
    for (uint64_t k = 0; k < n; k++) {
        if (k == 0 || indices[occ[k]] != indices[occ[k - 1]]) {
            ids[u] = indices[occ[k]];
            seg[u++] = k;
        }
    }
    seg[u] = n;
    return u;
}

static int run_train_rows(const ibp_train_job *job, uint64_t n_rows)
{
    const ibp_kernels *k = ibp_active_kernels();
    const uint64_t chunk = 256, n_chunks = (n_rows + chunk - 1) / chunk;
    int err = IBP_OK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(ibp_threads()) if (n_chunks >= 2)
    for (uint64_t c = 0; c < n_chunks; c++) {
        uint64_t last = (c + 1) * chunk < n_rows ? (c + 1) * chunk : n_rows;
        int rc = k->train_rows(job, c * chunk, last);
        if (rc != IBP_OK)
            __atomic_store_n(&err, rc, __ATOMIC_RELAXED);
    }
    return err;
}

int ibp_store_backward(ibp_store *st, const ibp_sparse_optim *opt, int dtype, uint32_t n_features,
                       uint64_t batch, const int64_t *indices, const int64_t *offsets,
                       const float *weights, int mode, const float *grad,
                       uint64_t grad_stride, const uint64_t *grad_col)
{
    if (!st)
        return IBP_E_ARG;
    pthread_mutex_lock(&st->write_mutex);
    int rc = check_backward(&st->d, opt, dtype, n_features, batch, indices, offsets, mode, grad, grad_col);
    const uint64_t bags = (uint64_t)n_features * batch;
    if (rc != IBP_OK || !offsets[bags]) {
        pthread_mutex_unlock(&st->write_mutex);
        return rc;
    }
    const uint64_t n = (uint64_t)offsets[bags];
    const int scaled = weights || mode == IBP_POOL_MEAN;
    uint32_t *occ_bag = malloc(n * 4), *occ = malloc(n * 4);
    float *occ_scale = scaled ? malloc(n * 4) : NULL;
    uint64_t *seg = malloc((n + 1) * 8);
    int64_t *ids = malloc(n * 8);
    uint8_t *rows = NULL;
    float *wide = NULL; /* float32 copies of 16-bit rows */
    if (!occ_bag || !occ || (scaled && !occ_scale) || !seg || !ids) {
        rc = IBP_E_NOMEM;
        goto done;
    }
    for (uint64_t fb = 0; fb < bags; fb++) {
        int64_t lo = offsets[fb], hi = offsets[fb + 1];
        /* As FBGEMM: 1/L in double, times the weight, rounded once. (FBGEMM's CPU
         * backward drops 1/L when there are weights; a weighted MEAN bag's rows get
         * w/L here, the gradient of what the forward computes.) */
        double inv = mode == IBP_POOL_MEAN && hi > lo ? 1.0 / (double)(hi - lo) : 1.0;
        for (int64_t p = lo; p < hi; p++) {
            occ_bag[p] = (uint32_t)fb;
            if (scaled)
                occ_scale[p] = (float)(inv * (weights ? (double)weights[p] : 1.0));
        }
    }
    rc = sort_by_key(indices, n, st->d.view.n_rows - 1, occ);
    const uint32_t dim = st->d.view.cb.row_bytes / (dtype == IBP_DTYPE_F32 ? 4 : 2);
    const ibp_kernels *k = ibp_active_kernels();
    uint64_t u_count = 0;
    if (rc == IBP_OK) {
        u_count = distinct_rows(indices, occ, n, ids, seg);
        rows = malloc(u_count * (uint64_t)st->d.view.cb.row_bytes + 1);
        rc = rows ? ibp_store_decode(st, ids, u_count, rows) : IBP_E_NOMEM;
    }
    if (rc == IBP_OK && dtype != IBP_DTYPE_F32) {
        wide = malloc(u_count * (uint64_t)dim * 4 + 1);
        if (wide)
            k->convert(dtype, 1, rows, u_count * dim, wide);
        else
            rc = IBP_E_NOMEM;
    }
    if (rc == IBP_OK) {
        ibp_train_job job = {opt, dim, n_features > 1 || dtype != IBP_DTYPE_F32, ids, seg, occ, occ_bag,
                             occ_scale, grad, grad_stride, grad_col, batch, wide ? wide : (float *)(void *)rows};
        rc = run_train_rows(&job, u_count);
    }
    if (rc == IBP_OK && wide)
        k->convert(dtype, 0, wide, u_count * dim, rows);
    if (rc == IBP_OK)
        rc = ibp_store_write_rows(st, ids, u_count, rows);
done:
    pthread_mutex_unlock(&st->write_mutex);
    free(occ_bag);
    free(occ);
    free(occ_scale);
    free(seg);
    free(ids);
    free(rows);
    free(wide);
    return rc;
}
