/* ibp_cuda.h - public C interface of libibp_cuda, the CUDA decoder of IBP tables.
 *
 * A table compressed by libibp (docs/format.md) is placed on a GPU: its small
 * metadata (masks, bitvals, vbits and the offsets index, about 2.1 bytes a row)
 * is copied to device memory, and its payload either stays in host memory,
 * pinned and read zero-copy by the kernels through unified virtual addressing
 * (IBP_CUDA_PLACE_HOST: PCIe carries the compressed bytes only), or is copied
 * to device memory (IBP_CUDA_PLACE_DEVICE).
 *
 * All pointers the gather and lookup functions take are device pointers (or
 * pointers the device can read: pinned host memory), and all work is queued on
 * the given stream (a cudaStream_t, NULL for the legacy default stream). The
 * library links cudart statically, so it loads on machines without a GPU;
 * every function that needs one then returns IBP_CUDA_E_NO_DEVICE.
 *
 * Errors: every function returns IBP_CUDA_OK or a negative IBP_CUDA_E_* code,
 * and ibp_cuda_last_error() gives the calling thread's message for the last
 * failure. Index and data errors found by the kernels (an index out of range,
 * a corrupt row, bad offsets) are recorded in the table's device-side status
 * word; with IBP_CUDA_CHECK the call synchronizes its stream and reports them,
 * else ibp_cuda_check() does it later.
 *
 * The block between CFFI_BEGIN and CFFI_END is the cffi cdef of
 * ibp_embed/cuda.py (which includes the cdef of native/ibp.h for ibp_table),
 * so it must stay plain C declarations and integer #defines.
 */
#ifndef IBP_CUDA_H
#define IBP_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "ibp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* CFFI_BEGIN */
#define IBP_CUDA_ABI_VERSION 2

/* Return codes (the first four match libibp's IBP_E_*). */
#define IBP_CUDA_OK 0
#define IBP_CUDA_E_ARG -1         /* invalid argument */
#define IBP_CUDA_E_INDEX -2       /* row index out of range */
#define IBP_CUDA_E_CORRUPT -3     /* compressed data is inconsistent */
#define IBP_CUDA_E_NOMEM -4       /* host or device allocation failed */
#define IBP_CUDA_E_NO_DEVICE -5   /* no CUDA device (or no usable driver) */
#define IBP_CUDA_E_CUDA -6        /* another CUDA runtime error: see ibp_cuda_last_error() */
#define IBP_CUDA_E_UNSUPPORTED -7 /* the device is older than compute capability 8.0 */
#define IBP_CUDA_E_OFFSETS -8     /* lookup offsets out of order or out of range */

/* Where the payload lives. */
#define IBP_CUDA_PLACE_HOST 0   /* pinned host memory, read zero-copy over PCIe */
#define IBP_CUDA_PLACE_DEVICE 1 /* a copy in device memory */

/* How a HOST payload was made readable by the device (ibp_cuda_info.payload_mode). */
#define IBP_CUDA_PAYLOAD_REGISTERED 1 /* the caller's buffer, cudaHostRegister'ed in place */
#define IBP_CUDA_PAYLOAD_SHARED 2     /* the caller's buffer, already registered by someone else */
#define IBP_CUDA_PAYLOAD_PINNED_COPY 3 /* a copy in cudaHostAlloc memory (registering failed) */
#define IBP_CUDA_PAYLOAD_DEVICE_COPY 4 /* a copy in device memory */

/* Flags of ibp_cuda_gather and ibp_cuda_lookup. */
#define IBP_CUDA_CHECK 1 /* synchronize the stream and report the kernels' index/data errors */
#define IBP_CUDA_DEDUP 2 /* lookup: sort and deduplicate the ids, decode each row once */

/* Pooling modes and element types: as IBP_POOL_* and IBP_DTYPE_* in ibp.h. */

typedef struct ibp_cuda_table ibp_cuda_table; /* opaque */

typedef struct ibp_cuda_info {
    int device;                /* CUDA device ordinal */
    int placement;             /* IBP_CUDA_PLACE_* */
    int payload_mode;          /* IBP_CUDA_PAYLOAD_* */
    int metadata_in_shared;    /* 1 if the kernels stage masks/bitvals/vbits in shared memory */
    int staged;                /* 1 if rows are staged in shared memory with cp.async */
    uint32_t warps_per_block;  /* decode kernels' block size in warps */
    uint32_t shared_bytes;     /* decode kernels' dynamic shared memory per block */
    uint32_t stage_bytes;      /* shared-memory bytes of one staged row */
    uint64_t device_bytes;     /* device memory held by the table */
    uint64_t pinned_bytes;     /* host memory pinned (registered or allocated) for it */
    const void *payload_device_ptr; /* the payload as the kernels address it */
} ibp_cuda_info;

int ibp_cuda_abi_version(void);
int ibp_cuda_format_version(void);
const char *ibp_cuda_error_string(int code);
/* Message of the calling thread's last failure ("" if none). */
const char *ibp_cuda_last_error(void);

/* Number of CUDA devices; IBP_CUDA_E_NO_DEVICE (count 0) when there is none or
 * no usable driver, with the reason in ibp_cuda_last_error(). */
int ibp_cuda_device_count(int *count);
/* Name and compute capability of a device; name_buf gets at most name_len bytes. */
int ibp_cuda_device_info(int device, char *name_buf, size_t name_len, int *major, int *minor);

/* Pin host memory in place (cudaHostRegister, portable and mapped) and give
 * the pointer kernels use for it. */
int ibp_cuda_host_register(void *ptr, uint64_t bytes, void **device_ptr);
int ibp_cuda_host_unregister(void *ptr);

/* Place a table on a device. The host table's payload must stay alive and
 * unchanged while the CUDA table exists (for IBP_CUDA_PLACE_HOST the kernels
 * read it in place); its metadata is copied and may go. */
int ibp_cuda_table_create(const ibp_table *table, int device, int placement,
                          ibp_cuda_table **out);
int ibp_cuda_table_destroy(ibp_cuda_table *t);
int ibp_cuda_table_info(const ibp_cuda_table *t, ibp_cuda_info *info);
/* Device bytes ibp_cuda_table_create allocates for `table` with `placement` (the
 * metadata block, plus the payload for IBP_CUDA_PLACE_DEVICE); needs no GPU. */
int ibp_cuda_table_device_bytes(const ibp_table *table, int placement, uint64_t *bytes);

/* Decode rows indices[0..n) (int64, device memory) into out (n * row_bytes
 * bytes, device memory), bit-exact. */
int ibp_cuda_gather(ibp_cuda_table *t, const int64_t *indices, uint64_t n, void *out,
                    void *stream, int flags);

/* Device workspace bytes ibp_cuda_lookup needs for n_indices ids. */
int ibp_cuda_lookup_workspace(const ibp_cuda_table *t, uint64_t n_indices, int flags,
                              uint64_t *bytes);
/* Pooled lookup, as ibp_lookup in ibp.h but on the device: bag b pools rows
 * indices[offsets[b] .. offsets[b+1]) (int64), each scaled by weights[i] when
 * weights is not NULL; IBP_POOL_MEAN divides by the bag size; empty bags give
 * zeros; out is [n_bags][dim] float32. With IBP_CUDA_DEDUP the ids are sorted
 * and deduplicated on the device and each distinct row is decoded once (into
 * the workspace); without, each warp decodes and pools its bags' rows directly.
 * workspace may be NULL: the library then allocates it on the stream
 * (cudaMallocAsync). */
int ibp_cuda_lookup(ibp_cuda_table *t, int dtype, uint32_t dim, const int64_t *indices,
                    uint64_t n_indices, const int64_t *offsets, uint64_t n_bags,
                    const float *weights, int mode, float *out, void *workspace,
                    uint64_t workspace_bytes, void *stream, int flags);

/* Synchronize the stream and report (then clear) the errors the kernels found. */
int ibp_cuda_check(ibp_cuda_table *t, void *stream);

/* A baseline for benchmarks, no IBP: the fused lookup's kernel structure over
 * raw rows (one warp per bag, each next row's cp.async copy issued before the
 * current row is added, the same pooling arithmetic), without decoding. rows:
 * n_rows rows of dim dtype elements back to back, 16-byte aligned, readable by
 * the current device: device memory, or pinned host memory through its device
 * pointer (ibp_cuda_host_register), which the kernel then reads zero-copy over
 * PCIe as FBGEMM's UVM placement does. Pools as ibp_cuda_lookup into out
 * [n_bags][dim] float32 on the given stream. status: a device int the kernel
 * ORs its errors into (NULL: none recorded); with IBP_CUDA_CHECK the call
 * synchronizes the stream and reports, then clears, them. */
int ibp_cuda_raw_lookup(const void *rows, uint64_t n_rows, int dtype, uint32_t dim,
                        const int64_t *indices, uint64_t n_indices, const int64_t *offsets,
                        uint64_t n_bags, const float *weights, int mode, float *out, int *status,
                        void *stream, int flags);

/* The kernels' code run on the host (no device needed): for tests of the
 * decoding logic and the kernels' loops on machines without a GPU. Every warp
 * of an emulated grid runs the kernels' own per-warp loop (rows or bags first,
 * first + grid, ...; each next row staged before the current one is decoded),
 * with the per-lane code run lane by lane from a staged copy of each row laid
 * out as the kernels lay it out. Same arguments and results as ibp_decode /
 * ibp_lookup (dedup selects the sort-and-pool path) and ibp_cuda_raw_lookup
 * (host pointers). ibp_cuda_emulate_grid sets the emulated grid's warps for
 * later calls (0: the default, 16) and returns the previous value. */
int ibp_cuda_emulate_gather(const ibp_table *table, const int64_t *indices, uint64_t n,
                            uint8_t *out);
int ibp_cuda_emulate_lookup(const ibp_table *table, int dtype, uint32_t dim,
                            const int64_t *indices, uint64_t n_indices,
                            const int64_t *offsets, uint64_t n_bags, const float *weights,
                            int mode, float *out, int dedup);
int ibp_cuda_emulate_raw_lookup(const void *rows, uint64_t n_rows, int dtype, uint32_t dim,
                                const int64_t *indices, uint64_t n_indices,
                                const int64_t *offsets, uint64_t n_bags, const float *weights,
                                int mode, float *out);
uint32_t ibp_cuda_emulate_grid(uint32_t warps);
/* CFFI_END */

#ifdef __cplusplus
}
#endif
#endif /* IBP_CUDA_H */
