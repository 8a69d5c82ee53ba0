/* ibp_store_internal.h - the updatable store's layout, shared by ibp_store.c (layout,
 * updates, reads) and ibp_store_backward.c (the fused backward). Not public. */
#ifndef IBP_STORE_INTERNAL_H
#define IBP_STORE_INTERNAL_H

#include <pthread.h>

#include "ibp_internal.h"

typedef struct store {
    ibp_table view; /* what the row kernels read: store mode over the fields below */
    uint64_t *masks, *bitvals;
    uint8_t *vbits;
    uint64_t n_blocks;
    uint64_t *block_base;
    uint32_t *block_len, *block_cap;
    uint16_t *rel;
    uint8_t *arena;
    uint64_t arena_bytes; /* allocated */
    uint64_t end;         /* past the last block's capacity */
    uint64_t live, slack, dead;
    uint64_t pad;
    uint64_t moves, compactions;
} store;

struct ibp_store {
    pthread_mutex_t write_mutex;
    pthread_rwlock_t lock;
    store d;
};

/* Size, encode and place n raw rows (ids strictly increasing, in range); the caller
 * holds write_mutex (ibp_store.c). */
int ibp_store_write_rows(ibp_store *st, const int64_t *ids, uint64_t n, const uint8_t *rows);

#endif
