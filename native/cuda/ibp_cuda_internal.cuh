/* ibp_cuda_internal.cuh - declarations shared by the library's .cu files (not public). */
#ifndef IBP_CUDA_INTERNAL_CUH
#define IBP_CUDA_INTERNAL_CUH

#include <cuda_runtime.h>

#include "cuda/decode.cuh"
#include "cuda/ibp_cuda.h"

/* A table placed on a device. */
struct ibp_cuda_table {
    int device;
    int placement;
    int payload_mode;
    ibpcuda::DevTable dev;     /* what the kernels read */
    uint64_t payload_bytes;    /* without the tail pad */
    uint64_t payload_span;     /* with it: what is registered or copied */
    void *registered;          /* host pointer we cudaHostRegister'ed (to unregister) */
    void *pinned_copy;         /* cudaHostAlloc'ed copy of the payload */
    void *device_copy;         /* cudaMalloc'ed copy of the payload */
    void *metadata;            /* one cudaMalloc block: masks, bitvals, vbits, block_base, rel, status */
    int *host_status;          /* pinned int the status word is read into */
    uint64_t device_bytes, pinned_bytes;
    int sm_count;
    int smem_optin;            /* max dynamic shared memory per block */
    ibpcuda::Geometry gather;  /* geometry of the row-decoding kernels */
};

namespace ibpcuda {

/* Set the calling thread's error message and return code. */
int fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Turn a CUDA error into a code (E_NOMEM, E_NO_DEVICE or E_CUDA) and a message
 * naming the call; clears the runtime's (non-sticky) last error. */
int cuda_fail(cudaError_t e, const char *what, const char *file, int line);

#define IBPC_TRY(call)                                                            \
    do {                                                                          \
        cudaError_t e_ = (call);                                                  \
        if (e_ != cudaSuccess)                                                    \
            return ::ibpcuda::cuda_fail(e_, #call, __FILE__, __LINE__);           \
    } while (0)

/* A kernel launch: checks the launch itself (configuration, no kernel image). */
#define IBPC_LAUNCHED(what)                                                       \
    do {                                                                          \
        cudaError_t e_ = cudaGetLastError();                                      \
        if (e_ != cudaSuccess)                                                    \
            return ::ibpcuda::cuda_fail(e_, what, __FILE__, __LINE__);            \
    } while (0)

/* Table placement (placement.cu). upload_metadata: the codebook, offsets index
 * and status word to one device block. place_payload: the payload as a device
 * copy, registered in place or a pinned, mapped copy (IBP_CUDA_PAYLOAD_*).
 * release_registration: drop a table's reference to a host range it registered. */
int upload_metadata(ibp_cuda_table *t, const ibp_table *h);
int place_payload(ibp_cuda_table *t, const uint8_t *p, int placement);
void release_registration(const void *p);

/* The error code (and message) of a status word the kernels wrote; OK for 0. */
int status_error(int status);

/* Geometry of the fused pooling kernel for rows of dim elements (warps == 0: does not fit). */
Geometry fused_geometry(const ibp_cuda_table *t, uint32_t dim);

/* Bytes of the dedup lookup's workspace for n indices. */
int dedup_workspace_bytes(const ibp_cuda_table *t, uint64_t n, uint64_t *bytes);

/* Kernel launchers (decode.cu, lookup.cu). Rows come from idx (int64, n of them)
 * or, when idx is NULL, from urows (uint32) of which *count (device) are used, at
 * most n. Rows are written to out, row_bytes apart. */
int launch_gather(ibp_cuda_table *t, const int64_t *idx, const uint32_t *urows,
                  const uint32_t *count, uint64_t n, uint8_t *out, cudaStream_t stream);
int launch_lookup_fused(ibp_cuda_table *t, const Geometry &g, int dtype, uint32_t dim,
                        const int64_t *indices, uint64_t n_indices, const int64_t *offsets,
                        uint64_t n_bags, const float *weights, int mode, float *out,
                        cudaStream_t stream);
int launch_lookup_dedup(ibp_cuda_table *t, int dtype, uint32_t dim, const int64_t *indices,
                        uint64_t n_indices, const int64_t *offsets, uint64_t n_bags,
                        const float *weights, int mode, float *out, void *workspace,
                        uint64_t workspace_bytes, cudaStream_t stream);

/* Blocks to launch for n warp-sized work items: enough to fill every SM (the
 * kernels loop over their items), never more than the items need. */
int grid_blocks(const ibp_cuda_table *t, const void *kernel, uint32_t threads, uint32_t smem,
                uint64_t n_items, uint32_t items_per_block, int *blocks);

} /* namespace ibpcuda */

#endif /* IBP_CUDA_INTERNAL_CUH */
