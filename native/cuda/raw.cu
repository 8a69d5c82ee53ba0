/* raw.cu - ibp_cuda_raw_lookup: pooled lookups over raw (uncompressed) rows,
 * the baseline the GPU benchmark sets beside the IBP kernels.
 *
 * FBGEMM's UVM placement (rows in host memory mapped into the GPU, read over
 * PCIe by the lookup kernel) cannot be installed on the GPU machine, so this is
 * its stand-in, built to differ from the IBP fused lookup in one thing only:
 * rows are not decoded. The same pool_loop (loops.cuh) runs one warp per bag,
 * the grid sized to fill the GPU, each next row's cp.async copy (16-byte
 * granules, raw bytes) issued before the current row is added, the same fma
 * pooling in index order. With rows in pinned host memory (its device
 * pointer), PCIe carries row_bytes per index; in device memory this is an HBM
 * lookup of the same structure. Its host emulation is ibp_cuda_emulate_raw_lookup.
 */
#include "cuda/ibp_cuda_internal.cuh"
#include "cuda/warp_decode.cuh"

namespace ibpcuda {
namespace {

/* The raw kernel's Warp (loops.cuh). */
struct RawWarp {
    const RawTable &t;
    uint8_t *stage0, *stage1;
    float *acc;
    uint32_t lane;
    static constexpr uint32_t lanes = kWarp;

    __device__ __forceinline__ RowRef issue(uint64_t row, uint8_t *stage)
    {
        RowRef r = locate_raw_row(t, row);
        if (r.len) {
            const uint8_t *from = r.src - r.offset; /* 16-byte aligned: the base is */
            const uint32_t chunks = stage_chunks(r);
            for (uint32_t c = lane; c < chunks; c += kWarp) {
                const uint32_t nb = raw_granule_bytes(t, r, c);
                if (nb == kChunk) {
                    __pipeline_memcpy_async(stage + c * kChunk, from + c * kChunk, kChunk);
                } else { /* the table's last bytes: nothing past its end is read */
                    for (uint32_t i = 0; i < nb; i++)
                        stage[c * kChunk + i] = from[c * kChunk + i];
                }
            }
        }
        return r;
    }
    __device__ __forceinline__ void commit() { __pipeline_commit(); }
    __device__ __forceinline__ void wait()
    {
        __pipeline_wait_prior(1);
        __syncwarp();
    }
    __device__ __forceinline__ void sync() { __syncwarp(); }
    __device__ __forceinline__ const uint8_t *decode(const RowRef &ref, const uint8_t *stage,
                                                     int &status)
    {
        status |= ref.status;
        return ref.len ? stage + ref.offset : nullptr;
    }
};

__global__ void IBPC_ROW_KERNEL_BOUNDS
ibp_raw_lookup_kernel(RawTable t, uint32_t stage_bytes, uint32_t warp_bytes, uint32_t warps,
                      FusedArgs a, int *status_out)
{
    extern __shared__ __align__(16) uint8_t smem[];
    const uint32_t lane = threadIdx.x & (kWarp - 1), warp = threadIdx.x / kWarp;
    uint8_t *stage = smem + warp * warp_bytes;
    float *acc = (float *)(void *)(stage + 2 * stage_bytes);
    RawWarp w{t, stage, stage + stage_bytes, acc, lane};
    const int status = pool_loop(w, a, (uint64_t)blockIdx.x * warps + warp,
                                 (uint64_t)gridDim.x * warps);
    if (status && lane == 0 && status_out)
        atomicOr(status_out, status);
}

/* Shared memory the raw kernel aims to stay under per block (as the IBP kernels). */
constexpr uint64_t kRawSmemTarget = 64 * 1024;

} /* namespace */
} /* namespace ibpcuda */

using namespace ibpcuda;

extern "C" int ibp_cuda_raw_lookup(const void *rows, uint64_t n_rows, int dtype, uint32_t dim,
                                   const int64_t *indices, uint64_t n_indices,
                                   const int64_t *offsets, uint64_t n_bags, const float *weights,
                                   int mode, float *out, int *status, void *stream, int flags)
{
    if (dtype != IBP_DTYPE_F32 && dtype != IBP_DTYPE_F16 && dtype != IBP_DTYPE_BF16)
        return fail(IBP_CUDA_E_ARG, "raw_lookup: element type %d (F32, F16 or BF16)", dtype);
    if (!dim || dim > (1u << 28))
        return fail(IBP_CUDA_E_ARG, "raw_lookup: dim %u", dim);
    if (mode != IBP_POOL_SUM && mode != IBP_POOL_MEAN)
        return fail(IBP_CUDA_E_ARG, "raw_lookup: pooling mode %d", mode);
    if ((n_bags && (!offsets || !out)) || (n_indices && !indices) || (n_rows && !rows))
        return fail(IBP_CUDA_E_ARG, "raw_lookup: null pointer");
    if ((uintptr_t)rows % kChunk)
        return fail(IBP_CUDA_E_ARG, "raw_lookup: rows must be 16-byte aligned");
    if (!n_bags)
        return IBP_CUDA_OK;
    int n_dev, rc = ibp_cuda_device_count(&n_dev);
    if (rc)
        return rc;
    const uint32_t R = dim * (dtype == IBP_DTYPE_F32 ? 4u : 2u);
    const uint32_t sb = raw_stage_bytes(R);
    const uint64_t warp_bytes = 2ull * sb + round_up(4 * dim, kChunk);
    int dev = 0, sms = 0, optin = 0;
    IBPC_TRY(cudaGetDevice(&dev));
    IBPC_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    IBPC_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    uint32_t warps = 8;
    while (warps > 1 && warps * warp_bytes > kRawSmemTarget)
        warps /= 2;
    if (warps * warp_bytes > (uint64_t)optin)
        return fail(IBP_CUDA_E_ARG, "raw_lookup: rows of %u bytes do not fit the kernel's shared "
                    "memory (%llu bytes a warp, %d available)", R, (unsigned long long)warp_bytes,
                    optin);
    const uint32_t smem = (uint32_t)(warps * warp_bytes);
    const void *kernel = (const void *)ibp_raw_lookup_kernel;
    if (smem > 48 * 1024)
        IBPC_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int per_sm = 0;
    IBPC_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, (int)(warps * kWarp), smem));
    if (per_sm < 1)
        return fail(IBP_CUDA_E_CUDA, "raw_lookup: a block of %u warps with %u bytes of shared "
                    "memory does not fit on device %d", warps, smem, dev);
    const uint64_t want = (n_bags + warps - 1) / warps, cap = (uint64_t)per_sm * (uint64_t)sms;
    const int blocks = (int)(want < cap ? want : cap);
    cudaStream_t s = (cudaStream_t)stream;
    /* Bags without rows are never visited: their output is zeros from here. */
    IBPC_TRY(cudaMemsetAsync(out, 0, n_bags * dim * sizeof(float), s));
    RawTable t{(const uint8_t *)rows, n_rows, R};
    FusedArgs a{indices, offsets, weights, out, n_indices, n_bags, dim, dtype, mode};
    ibp_raw_lookup_kernel<<<blocks, warps * kWarp, smem, s>>>(t, sb, (uint32_t)warp_bytes, warps, a,
                                                              status);
    IBPC_LAUNCHED("launching the raw lookup kernel");
    if (!(flags & IBP_CUDA_CHECK))
        return IBP_CUDA_OK;
    if (!status) {
        IBPC_TRY(cudaStreamSynchronize(s));
        return IBP_CUDA_OK;
    }
    int host = 0;
    IBPC_TRY(cudaMemcpyAsync(&host, status, sizeof host, cudaMemcpyDeviceToHost, s));
    IBPC_TRY(cudaStreamSynchronize(s));
    if (host)
        IBPC_TRY(cudaMemsetAsync(status, 0, sizeof host, s));
    return status_error(host);
}
