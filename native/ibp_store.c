/* ibp_store.c - updatable tables: rows rewritten block by block, reads under a lock.
 *
 * Layout. Rows form blocks of 2^shift rows (up to 64, about 4 KB raw: large rows
 * get small blocks, so rewriting a block stays cheap). A block's rows sit back to
 * back at block_base[b] (rel[i] is row i's offset inside its block), and the block
 * owns block_cap[b] >= block_len[b] bytes of the arena: a little headroom, so a
 * row that grows usually still fits. The index costs 2 bytes a row plus 16 a
 * block, about what the packed format's offsets cost.
 *
 * Updates. New rows are sized and encoded first (no lock held); then, per touched
 * block, rows keep their place when no length changed, the block is rebuilt in
 * place when it still fits its capacity, and otherwise it moves to the end of the
 * arena with fresh headroom (its old bytes become dead). When the arena is full,
 * it is compacted in place (blocks slide down in address order, headroom trimmed)
 * if the dead space is worth it, else grown. Headroom, dead space and the growth
 * step are each bounded by 1/64 of the encoded rows (SLACK_SHIFT), so the store
 * holds at most ~5% more than the packed table it started from.
 *
 * Concurrency. write_mutex orders writers; the rwlock (writer-preferring) guards
 * the arena and index: readers hold it shared for the whole read, writers take it
 * exclusively only while they move bytes. Sizing, encoding and the optimizer
 * arithmetic of a backward run under write_mutex alone, so lookups continue
 * meanwhile.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <omp.h>

#include "ibp_store_internal.h"

#define BLOCK_RAW_BYTES 4096
#define MAX_BLOCK_SHIFT 6
#define SLACK_SHIFT 6 /* headroom, dead space and growth: live >> SLACK_SHIFT each */
#define PARALLEL_MIN_BLOCKS 64

static uint64_t headroom(uint64_t len) { return (len >> SLACK_SHIFT) + 8; }

static uint32_t block_shift_for(uint32_t row_bytes)
{
    uint32_t shift = 0;
    while (shift < MAX_BLOCK_SHIFT && ((uint64_t)2 << shift) * row_bytes <= BLOCK_RAW_BYTES)
        shift++;
    return shift;
}

/* Rows [first, last) of block b. */
static void block_rows(const store *s, uint64_t b, uint64_t *first, uint64_t *last)
{
    uint32_t shift = s->view.block_shift;
    *first = b << shift;
    *last = *first + ((uint64_t)1 << shift) < s->view.n_rows ? *first + ((uint64_t)1 << shift)
                                                              : s->view.n_rows;
}

static void store_bind(store *s)
{
    s->view.payload = s->arena;
    s->view.payload_bytes = s->end;
    s->view.block_base = s->block_base;
    s->view.rel = s->rel;
    s->view.block_len = s->block_len;
}

static void store_release(store *s)
{
    free(s->masks);
    free(s->bitvals);
    free(s->vbits);
    free(s->block_base);
    free(s->block_len);
    free(s->block_cap);
    free(s->rel);
    free(s->arena);
    memset(s, 0, sizeof(*s));
}

/* Asks for transparent huge pages for an arena of 2 MiB or more (ibp_embed/hostmem.py
 * has why: lookups from memory into 4 KiB pages wait on a page walk a row). glibc serves
 * such blocks from a fresh mapping, not yet touched, unless told otherwise (mallopt);
 * where its pages were touched, they stay 4 KiB, as before. Every page the block touches
 * is advised, its first (glibc's header) included: advising only the whole pages inside
 * would split glibc's mapping in three, and realloc's mremap fails across mappings (it
 * then copies the arena to a new, unadvised one). */
static void advise_huge_pages(void *p, uint64_t bytes)
{
#ifdef MADV_HUGEPAGE /* Linux */
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), lo = (uintptr_t)p / page * page;
    if (bytes >= ((uint64_t)2 << 20))
        madvise((void *)lo, (uintptr_t)p + bytes - lo, MADV_HUGEPAGE); /* advice: a refusal changes nothing */
#else
    (void)p, (void)bytes;
#endif
}

/* s <- the codebook and rows of packed table t, each block with fresh headroom. */
static int store_build(store *s, const ibp_table *t)
{
    const ibp_codebook *cb = &t->cb;
    const uint64_t n = t->n_rows, km = (uint64_t)cb->n_clusters * cb->n_words;
    const uint32_t shift = block_shift_for(cb->row_bytes);
    const uint64_t nb = (n + ((uint64_t)1 << shift) - 1) >> shift;
    memset(s, 0, sizeof(*s));
    s->view.n_rows = n;
    s->view.block_shift = shift;
    s->masks = malloc(km ? km * 8 : 1); /* K = 0 (raw table): no masks */
    s->bitvals = malloc(km ? km * 8 : 1);
    s->vbits = malloc(km ? km : 1);
    s->block_base = malloc((nb + 1) * 8);
    s->block_len = malloc((nb + 1) * 4);
    s->block_cap = malloc((nb + 1) * 4);
    s->rel = malloc((n + 1) * 2);
    if (!s->masks || !s->bitvals || !s->vbits || !s->block_base || !s->block_len ||
        !s->block_cap || !s->rel)
        return IBP_E_NOMEM;
    if (km) {
        memcpy(s->masks, cb->masks, km * 8);
        memcpy(s->bitvals, cb->bitvals, km * 8);
        memcpy(s->vbits, cb->vbits, km);
    }
    s->n_blocks = nb;
    s->pad = ibp_tail_pad(cb->row_bytes, cb->word_bits);
    for (uint64_t b = 0; b < nb; b++) {
        uint64_t r0, r1;
        block_rows(s, b, &r0, &r1);
        uint64_t first = ibp_row_start(t, r0), len = ibp_row_start(t, r1) - first;
        for (uint64_t i = r0; i < r1; i++)
            s->rel[i] = (uint16_t)(ibp_row_start(t, i) - first);
        s->block_base[b] = s->end;
        s->block_len[b] = (uint32_t)len;
        s->block_cap[b] = (uint32_t)(len + headroom(len));
        s->live += len;
        s->slack += s->block_cap[b] - len;
        s->end += s->block_cap[b];
    }
    s->arena_bytes = s->end + s->pad + (s->live >> SLACK_SHIFT);
    s->arena = calloc(s->arena_bytes, 1);
    if (!s->arena)
        return IBP_E_NOMEM;
    advise_huge_pages(s->arena, s->arena_bytes);
    for (uint64_t b = 0; b < nb; b++)
        memcpy(s->arena + s->block_base[b], t->payload + ibp_row_start(t, b << shift), s->block_len[b]);
    s->view.cb = *cb;
    s->view.cb.masks = s->masks;
    s->view.cb.bitvals = s->bitvals;
    s->view.cb.vbits = s->vbits;
    s->view.rel_bytes = 2;
    store_bind(s);
    return IBP_OK;
}

static int check_packed(const ibp_table *t)
{
    if (!t || t->block_len)
        return IBP_E_ARG;
    uint64_t bad;
    return ibp_validate(t, &bad);
}

int ibp_store_create(const ibp_table *t, ibp_store **out)
{
    if (!out)
        return IBP_E_ARG;
    *out = NULL;
    int rc = check_packed(t);
    if (rc != IBP_OK)
        return rc;
    ibp_store *st = calloc(1, sizeof(*st));
    if (!st)
        return IBP_E_NOMEM;
    rc = store_build(&st->d, t);
    if (rc != IBP_OK) {
        store_release(&st->d);
        free(st);
        return rc;
    }
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
#ifdef __GLIBC__
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
#endif
    pthread_rwlock_init(&st->lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    pthread_mutex_init(&st->write_mutex, NULL);
    *out = st;
    return IBP_OK;
}

void ibp_store_destroy(ibp_store *st)
{
    if (!st)
        return;
    pthread_rwlock_destroy(&st->lock);
    pthread_mutex_destroy(&st->write_mutex);
    store_release(&st->d);
    free(st);
}

int ibp_store_reset(ibp_store *st, const ibp_table *t)
{
    if (!st)
        return IBP_E_ARG;
    int rc = check_packed(t);
    if (rc != IBP_OK)
        return rc;
    store fresh;
    pthread_mutex_lock(&st->write_mutex);
    rc = store_build(&fresh, t);
    if (rc == IBP_OK) {
        pthread_rwlock_wrlock(&st->lock);
        fresh.moves = st->d.moves;
        fresh.compactions = st->d.compactions;
        store_release(&st->d);
        st->d = fresh;
        pthread_rwlock_unlock(&st->lock);
    } else {
        store_release(&fresh);
    }
    pthread_mutex_unlock(&st->write_mutex);
    return rc;
}

int ibp_store_info_get(ibp_store *st, ibp_store_info *out)
{
    if (!st || !out)
        return IBP_E_ARG;
    pthread_rwlock_rdlock(&st->lock);
    const store *s = &st->d;
    const ibp_codebook *cb = &s->view.cb;
    out->n_rows = s->view.n_rows;
    out->row_bytes = cb->row_bytes;
    out->word_bits = cb->word_bits;
    out->n_clusters = cb->n_clusters;
    out->block_rows = 1u << s->view.block_shift;
    out->live_bytes = s->live;
    out->slack_bytes = s->slack;
    out->dead_bytes = s->dead;
    out->free_bytes = s->arena_bytes - s->end;
    out->arena_bytes = s->arena_bytes;
    out->index_bytes = (s->view.n_rows + 1) * 2 + (s->n_blocks + 1) * 16;
    out->meta_bytes = (uint64_t)cb->n_clusters * cb->n_words * 17;
    out->moves = s->moves;
    out->compactions = s->compactions;
    pthread_rwlock_unlock(&st->lock);
    return IBP_OK;
}

/* ---- reads ---- */

int ibp_store_decode(ibp_store *st, const int64_t *idx, uint64_t n_idx, uint8_t *out)
{
    if (!st)
        return IBP_E_ARG;
    pthread_rwlock_rdlock(&st->lock);
    int rc = ibp_decode(&st->d.view, idx, n_idx, out);
    pthread_rwlock_unlock(&st->lock);
    return rc;
}

int ibp_store_lookup(ibp_store *st, int dtype, uint32_t dim, const int64_t *indices,
                     const int64_t *offsets, uint64_t n_bags, const float *weights, int mode,
                     float *out)
{
    if (!st)
        return IBP_E_ARG;
    pthread_rwlock_rdlock(&st->lock);
    int rc = ibp_lookup(&st->d.view, dtype, dim, indices, offsets, n_bags, weights, mode, out);
    pthread_rwlock_unlock(&st->lock);
    return rc;
}

int ibp_store_export(ibp_store *st, uint64_t *offsets, uint8_t *payload, uint64_t payload_cap)
{
    if (!st || !offsets)
        return IBP_E_ARG;
    pthread_rwlock_rdlock(&st->lock);
    const store *s = &st->d;
    int rc = IBP_OK;
    if (payload_cap < s->live + s->pad || !payload) {
        offsets[0] = s->live + s->pad;
        rc = IBP_E_ARG;
    } else {
        uint64_t at = 0;
        for (uint64_t b = 0; b < s->n_blocks; b++) {
            uint64_t r0, r1;
            block_rows(s, b, &r0, &r1);
            for (uint64_t i = r0; i < r1; i++)
                offsets[i] = at + s->rel[i];
            memcpy(payload + at, s->arena + s->block_base[b], s->block_len[b]);
            at += s->block_len[b];
        }
        offsets[s->view.n_rows] = at;
        memset(payload + at, 0, payload_cap - at);
    }
    pthread_rwlock_unlock(&st->lock);
    return rc;
}

/* ---- writes ---- */

static int arena_resize(store *s, uint64_t bytes)
{
    uint8_t *a = realloc(s->arena, bytes);
    if (!a)
        return IBP_E_NOMEM;
    advise_huge_pages(a, bytes);
    if (bytes > s->arena_bytes)
        memset(a + s->arena_bytes, 0, bytes - s->arena_bytes);
    s->arena = a;
    s->arena_bytes = bytes;
    store_bind(s);
    return IBP_OK;
}

static int cmp_base(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* Slide every block down to the lowest free address, in address order (a block
 * only ever moves down, so memmove is safe), trimming its headroom. */
static int store_compact(store *s)
{
    const uint64_t nb = s->n_blocks;
    uint64_t *order = malloc((nb + 1) * 16);
    if (!order)
        return IBP_E_NOMEM;
    for (uint64_t b = 0; b < nb; b++) {
        order[2 * b] = s->block_base[b];
        order[2 * b + 1] = b;
    }
    qsort(order, nb, 16, cmp_base);
    uint64_t cursor = 0;
    s->slack = 0;
    for (uint64_t k = 0; k < nb; k++) {
        uint64_t b = order[2 * k + 1], len = s->block_len[b];
        uint64_t cap = len + headroom(len) < s->block_cap[b] ? len + headroom(len) : s->block_cap[b];
        if (cursor != s->block_base[b])
            memmove(s->arena + cursor, s->arena + s->block_base[b], len);
        s->block_base[b] = cursor;
        s->block_cap[b] = (uint32_t)cap;
        s->slack += cap - len;
        cursor += cap;
    }
    free(order);
    memset(s->arena + cursor, 0, s->end - cursor);
    s->end = cursor;
    s->dead = 0;
    s->compactions++;
    store_bind(s);
    /* Hand back what lies well beyond the growth step. */
    uint64_t keep = s->end + s->pad + (s->live >> SLACK_SHIFT);
    return s->arena_bytes > keep + (s->live >> SLACK_SHIFT) ? arena_resize(s, keep) : IBP_OK;
}

/* A block whose rows change: its rows ids[u0 .. u1), new length, capacity, place. */
typedef struct touched {
    uint64_t block, u0, u1, len, dest;
    uint64_t cap;
    int same_lengths, moves;
} touched;

/* Group the rows by block and decide, per block, whether it stays or moves;
 * returns the bytes the moving blocks need past the end. */
static uint64_t plan_blocks(const store *s, const int64_t *ids, uint64_t n, const uint64_t *eoff,
                            touched *ts, uint64_t *n_touched)
{
    const uint32_t shift = s->view.block_shift;
    uint64_t nt = 0, need = 0;
    for (uint64_t u = 0; u < n;) {
        touched *t = &ts[nt++];
        t->block = (uint64_t)ids[u] >> shift;
        t->u0 = u;
        t->same_lengths = 1;
        int64_t delta = 0;
        for (; u < n && ((uint64_t)ids[u] >> shift) == t->block; u++) {
            uint64_t start, len;
            ibp_row_span(&s->view, (uint64_t)ids[u], &start, &len);
            int64_t d = (int64_t)(eoff[u + 1] - eoff[u]) - (int64_t)len;
            t->same_lengths &= d == 0;
            delta += d;
        }
        t->u1 = u;
        t->len = (uint64_t)((int64_t)s->block_len[t->block] + delta);
        t->moves = t->len > s->block_cap[t->block];
        t->cap = t->moves ? t->len + headroom(t->len) : s->block_cap[t->block];
        if (t->moves)
            need += t->cap;
    }
    *n_touched = nt;
    return need;
}

/* Write block t->block's rows into dst: rows ids[u] from enc, the others from their
 * current place; rewrite the block's rel entries. */
static void assemble_block(store *s, const touched *t, const int64_t *ids, const uint8_t *enc,
                           const uint64_t *eoff, uint8_t *dst)
{
    uint64_t r0, r1, at = 0, u = t->u0;
    block_rows(s, t->block, &r0, &r1);
    for (uint64_t i = r0; i < r1; i++) {
        uint64_t start, len;
        ibp_row_span(&s->view, i, &start, &len); /* reads rel[i + 1]: rewritten next round */
        if (u < t->u1 && (uint64_t)ids[u] == i) {
            len = eoff[u + 1] - eoff[u];
            memcpy(dst + at, enc + eoff[u], len);
            u++;
        } else {
            memcpy(dst + at, s->arena + start, len);
        }
        s->rel[i] = (uint16_t)at;
        at += len;
    }
}

/* Put n encoded rows in place (ids increasing; row u is enc[eoff[u] .. eoff[u + 1])). */
static int store_place(store *s, const int64_t *ids, uint64_t n, const uint8_t *enc,
                       const uint64_t *eoff)
{
    touched *ts = malloc((n + 1) * sizeof(touched));
    if (!ts)
        return IBP_E_NOMEM;
    uint64_t nt;
    uint64_t need = plan_blocks(s, ids, n, eoff, ts, &nt);
    int rc = IBP_OK;
    if (s->end + need + s->pad > s->arena_bytes && s->dead > (s->live >> SLACK_SHIFT)) {
        rc = store_compact(s); /* trims capacities: plan again */
        if (rc == IBP_OK)
            need = plan_blocks(s, ids, n, eoff, ts, &nt);
    }
    if (rc == IBP_OK && s->end + need + s->pad > s->arena_bytes)
        rc = arena_resize(s, s->end + need + s->pad + (s->live >> SLACK_SHIFT));
    if (rc != IBP_OK) {
        free(ts);
        return rc;
    }
    uint64_t max_len = 0;
    for (uint64_t k = 0; k < nt; k++) {
        touched *t = &ts[k];
        uint64_t b = t->block, old_len = s->block_len[b], old_cap = s->block_cap[b];
        if (t->moves) {
            t->dest = s->end;
            s->end += t->cap;
            s->dead += old_cap;
            s->moves++;
        } else {
            t->dest = s->block_base[b];
        }
        s->slack += (t->cap - t->len) - (old_cap - old_len);
        s->live += t->len - old_len;
        if (t->len > max_len)
            max_len = t->len;
    }
    int err = IBP_OK;
#pragma omp parallel num_threads(ibp_threads()) if (nt >= PARALLEL_MIN_BLOCKS)
    {
        uint8_t *scratch = malloc(max_len + 1);
        if (!scratch)
            __atomic_store_n(&err, IBP_E_NOMEM, __ATOMIC_RELAXED);
#pragma omp for schedule(dynamic, 16)
        for (uint64_t k = 0; k < nt; k++) {
            const touched *t = &ts[k];
            if (t->same_lengths) { /* every row keeps its place */
                for (uint64_t u = t->u0; u < t->u1; u++) {
                    uint64_t start, len;
                    ibp_row_span(&s->view, (uint64_t)ids[u], &start, &len);
                    memcpy(s->arena + start, enc + eoff[u], len);
                }
            } else if (scratch) {
                assemble_block(s, t, ids, enc, eoff, scratch);
                memcpy(s->arena + t->dest, scratch, t->len);
                s->block_base[t->block] = t->dest;
                s->block_len[t->block] = (uint32_t)t->len;
                s->block_cap[t->block] = (uint32_t)t->cap;
            }
        }
        free(scratch);
    }
    s->view.payload_bytes = s->end;
    free(ts);
    return err;
}

/* Size, encode and place n raw rows (ids strictly increasing, in range). The
 * caller holds write_mutex; the rwlock is taken only to move bytes. */
int ibp_store_write_rows(ibp_store *st, const int64_t *ids, uint64_t n, const uint8_t *rows)
{
    const ibp_kernels *k = ibp_active_kernels();
    const ibp_codebook *cb = &st->d.view.cb;
    uint8_t *clusters = malloc(n + 1);
    uint32_t *lengths = malloc((n + 1) * 4);
    uint64_t *eoff = malloc((n + 1) * 8);
    uint8_t *enc = NULL;
    int rc = clusters && lengths && eoff ? IBP_OK : IBP_E_NOMEM;
    if (rc == IBP_OK)
        rc = k->assign(cb, rows, n, clusters, lengths);
    if (rc == IBP_OK) {
        eoff[0] = 0;
        for (uint64_t u = 0; u < n; u++)
            eoff[u + 1] = eoff[u] + lengths[u];
        enc = malloc(eoff[n] + 1);
        rc = enc ? k->encode(cb, rows, n, clusters, eoff, NULL, enc) : IBP_E_NOMEM;
    }
    if (rc == IBP_OK) {
        pthread_rwlock_wrlock(&st->lock);
        rc = store_place(&st->d, ids, n, enc, eoff);
        pthread_rwlock_unlock(&st->lock);
    }
    free(clusters);
    free(lengths);
    free(eoff);
    free(enc);
    return rc;
}

int ibp_store_update(ibp_store *st, const int64_t *ids, uint64_t n, const uint8_t *rows)
{
    if (!st || (n && (!ids || !rows)))
        return IBP_E_ARG;
    for (uint64_t u = 0; u < n; u++) {
        if (ids[u] < 0 || (uint64_t)ids[u] >= st->d.view.n_rows)
            return IBP_E_INDEX;
        if (u && ids[u] <= ids[u - 1])
            return IBP_E_ARG;
    }
    if (!n)
        return IBP_OK;
    pthread_mutex_lock(&st->write_mutex);
    int rc = ibp_store_write_rows(st, ids, n, rows);
    pthread_mutex_unlock(&st->write_mutex);
    return rc;
}

int ibp_store_compact(ibp_store *st)
{
    if (!st)
        return IBP_E_ARG;
    pthread_mutex_lock(&st->write_mutex);
    pthread_rwlock_wrlock(&st->lock);
    int rc = store_compact(&st->d);
    pthread_rwlock_unlock(&st->lock);
    pthread_mutex_unlock(&st->write_mutex);
    return rc;
}
