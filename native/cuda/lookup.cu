/* lookup.cu - pooled lookups: index deduplication and pooling.
 *
 * Dedup path (IBP_CUDA_DEDUP, the default of the Python API):
 *   1. keys: each index becomes a uint32 row id (out of range -> the sentinel
 *      n_rows, and the status word records it), paired with its position;
 *   2. a CUB radix sort of (row id, position) over only the bits row ids use;
 *   3. head flags and an inclusive scan give every sorted entry its distinct-row
 *      number: inverse[position] = number, urows[number] = row id, and the count;
 *   4. the row decode kernel (decode.cu) decodes each distinct row once, in
 *      ascending row order, i.e. ascending payload addresses, into the workspace;
 *   5. one warp per bag pools its rows from there: lane l sums element l, l+32,
 *      ... over the bag's indices in order (the order libibp sums in), reading
 *      32 consecutive elements of a row per step (coalesced, from HBM/L2).
 * Every row crosses PCIe once per batch however often the batch names it.
 *
 * Fused path (no dedup): one warp per bag decodes the bag's rows one after the
 * other (cp.async double buffering as in decode.cu, the next row's copy running
 * while the current row is decoded) into a shared-memory row, and adds it into
 * per-warp float sums in shared memory (pool_loop in loops.cuh, which
 * emulate.cu runs too). No workspace, no sort, but a row named k times is read
 * k times.
 */
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include "cuda/ibp_cuda_internal.cuh"
#include "cuda/warp_decode.cuh"

namespace ibpcuda {
namespace {

constexpr uint32_t kThreads = 256;
constexpr uint64_t kAlign = 256;

uint64_t align_up(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

int key_bits(uint64_t n_rows) /* bits of the largest key, the sentinel n_rows */
{
    int b = 1;
    while (b < 32 && (n_rows >> b))
        b++;
    return b;
}

/* ---- dedup ---- */

struct DedupLayout {
    uint64_t keys_in, keys_out, pos_in, pos_out, uid, inverse, urows, count, cub, rows, total;
    uint64_t n_unique_max;
    size_t cub_bytes;
};

int dedup_layout(const ibp_cuda_table *t, uint64_t n, DedupLayout *l)
{
    size_t sort_bytes = 0, scan_bytes = 0;
    const int ni = (int)n, end_bit = key_bits(t->dev.n_rows);
    IBPC_TRY(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, (const uint32_t *)nullptr,
                                             (uint32_t *)nullptr, (const uint32_t *)nullptr,
                                             (uint32_t *)nullptr, ni, 0, end_bit));
    IBPC_TRY(cub::DeviceScan::InclusiveSum(nullptr, scan_bytes, (const uint32_t *)nullptr,
                                           (uint32_t *)nullptr, ni));
    l->cub_bytes = sort_bytes > scan_bytes ? sort_bytes : scan_bytes;
    l->n_unique_max = n < t->dev.n_rows + 1 ? n : t->dev.n_rows + 1;
    uint64_t at = 0;
    const uint64_t a32 = align_up(n * 4);
    l->keys_in = at;  at += a32;
    l->keys_out = at; at += a32;
    l->pos_in = at;   at += a32;
    l->pos_out = at;  at += a32;
    l->uid = at;      at += a32;
    l->inverse = at;  at += a32;
    l->urows = at;    at += align_up(l->n_unique_max * 4);
    l->count = at;    at += kAlign;
    l->cub = at;      at += align_up(l->cub_bytes);
    l->rows = at;     at += align_up(l->n_unique_max * t->dev.row_bytes);
    l->total = at;
    return IBP_CUDA_OK;
}

__global__ void __launch_bounds__(kThreads)
ibp_dedup_keys_kernel(const int64_t *indices, uint64_t n, uint64_t n_rows, uint32_t *keys,
                      uint32_t *pos, int *status)
{
    int bad = 0;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        int64_t v = indices[i];
        bool ok = v >= 0 && (uint64_t)v < n_rows;
        keys[i] = ok ? (uint32_t)v : (uint32_t)n_rows;
        pos[i] = (uint32_t)i;
        bad |= !ok;
    }
    if (bad)
        atomicOr(status, kStatusIndex);
}

__global__ void __launch_bounds__(kThreads)
ibp_dedup_heads_kernel(const uint32_t *keys, uint64_t n, uint32_t *head)
{
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        head[i] = i == 0 || keys[i] != keys[i - 1];
}

__global__ void __launch_bounds__(kThreads)
ibp_dedup_scatter_kernel(const uint32_t *keys, const uint32_t *pos, const uint32_t *uid, uint64_t n,
                         uint32_t *inverse, uint32_t *urows, uint32_t *count)
{
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint32_t u = uid[i] - 1;
        inverse[pos[i]] = u;
        if (i == 0 || keys[i] != keys[i - 1])
            urows[u] = keys[i];
        if (i == n - 1)
            *count = uid[i];
    }
}

struct PoolArgs {
    const uint8_t *rows;
    const uint32_t *inverse;
    const int64_t *offsets;
    const float *weights;
    float *out;
    uint64_t n_indices, n_bags;
    uint32_t row_bytes, dim;
    int dtype, mode;
    int *status;
};

template <int kDtype>
__device__ __forceinline__ void pool_bag(const PoolArgs &a, uint64_t b, uint64_t lo, uint64_t hi,
                                         uint32_t lane)
{
    for (uint32_t d = lane; d < a.dim; d += kWarp)
        a.out[b * a.dim + d] = pool_bag_elem(a.rows, a.row_bytes, a.inverse, a.weights, kDtype,
                                             a.mode, lo, hi, d);
}

__global__ void __launch_bounds__(kThreads) ibp_pool_kernel(PoolArgs a)
{
    const uint32_t lane = threadIdx.x & (kWarp - 1);
    const uint64_t warps = blockDim.x / kWarp;
    int bad = 0;
    for (uint64_t b = (uint64_t)blockIdx.x * warps + threadIdx.x / kWarp; b < a.n_bags;
         b += (uint64_t)gridDim.x * warps) {
        uint64_t lo, hi;
        bad |= !bag_range(a.offsets, b, a.n_bags, a.n_indices, &lo, &hi);
        if (a.dtype == IBP_DTYPE_F32)
            pool_bag<IBP_DTYPE_F32>(a, b, lo, hi, lane);
        else if (a.dtype == IBP_DTYPE_BF16)
            pool_bag<IBP_DTYPE_BF16>(a, b, lo, hi, lane);
        else
            pool_bag<IBP_DTYPE_F16>(a, b, lo, hi, lane);
    }
    if (bad && lane == 0)
        atomicOr(a.status, kStatusOffsets);
}

int simple_blocks(const ibp_cuda_table *t, uint64_t items, uint64_t per_block)
{
    uint64_t want = (items + per_block - 1) / per_block, cap = (uint64_t)t->sm_count * 16;
    if (want < 1)
        want = 1;
    return (int)(want < cap ? want : cap);
}

/* ---- fused ---- */

/* The fused kernel's Warp (loops.cuh): rows decoded into a shared-memory row. */
template <uint32_t W>
struct FusedWarp : DeviceWarp<W, true> {
    uint8_t *row; /* the decoded row, whole words */
    float *acc;   /* the bag's sums, dim floats */

    __device__ __forceinline__ const uint8_t *decode(const RowRef &ref, const uint8_t *stage,
                                                     int &status)
    {
        RowStore<W> sink{row, this->t.row_bytes, true};
        status |= warp_decode_row<W>(this->t, this->m, ref, stage + ref.offset, this->lane, sink);
        return row;
    }
};

template <uint32_t W>
__global__ void IBPC_ROW_KERNEL_BOUNDS
ibp_lookup_fused_kernel(DevTable t, Geometry g, FusedArgs a)
{
    extern __shared__ __align__(16) uint8_t smem[];
    const Meta m = load_meta(t, g, smem);
    const uint32_t lane = threadIdx.x & (kWarp - 1), warp = threadIdx.x / kWarp;
    uint8_t *stage = smem + g.meta_bytes + warp * g.warp_bytes;
    uint8_t *row = stage + 2 * g.stage_bytes;
    float *acc = (float *)(void *)(row + round_up(t.n_words * (W / 8), kChunk));
    FusedWarp<W> w{{t, m, stage, stage + g.stage_bytes, lane}, row, acc};
    const int status = pool_loop(w, a, (uint64_t)blockIdx.x * g.warps + warp,
                                 (uint64_t)gridDim.x * g.warps);
    if (status && lane == 0)
        atomicOr(t.status, status);
}

template <uint32_t W>
int launch_fused(ibp_cuda_table *t, const Geometry &g, const FusedArgs &a, cudaStream_t stream)
{
    const void *kernel = (const void *)ibp_lookup_fused_kernel<W>;
    if (g.smem_bytes > 48 * 1024)
        IBPC_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)g.smem_bytes));
    int blocks;
    int rc = grid_blocks(t, kernel, g.warps * kWarp, g.smem_bytes, a.n_bags, g.warps, &blocks);
    if (rc)
        return rc;
    ibp_lookup_fused_kernel<W><<<blocks, g.warps * kWarp, g.smem_bytes, stream>>>(t->dev, g, a);
    IBPC_LAUNCHED("launching the fused lookup kernel");
    return IBP_CUDA_OK;
}

} /* namespace */

int dedup_workspace_bytes(const ibp_cuda_table *t, uint64_t n, uint64_t *bytes)
{
    DedupLayout l;
    int rc = dedup_layout(t, n, &l);
    if (rc)
        return rc;
    *bytes = l.total;
    return IBP_CUDA_OK;
}

int launch_lookup_fused(ibp_cuda_table *t, const Geometry &g, int dtype, uint32_t dim,
                        const int64_t *indices, uint64_t n_indices, const int64_t *offsets,
                        uint64_t n_bags, const float *weights, int mode, float *out,
                        cudaStream_t stream)
{
    /* Bags without rows are never visited: their output is zeros from here. */
    IBPC_TRY(cudaMemsetAsync(out, 0, n_bags * dim * sizeof(float), stream));
    FusedArgs a{indices, offsets, weights, out, n_indices, n_bags, dim, dtype, mode};
    switch (t->dev.word_bits) {
    case 16: return launch_fused<16>(t, g, a, stream);
    case 32: return launch_fused<32>(t, g, a, stream);
    default: return launch_fused<64>(t, g, a, stream);
    }
}

int launch_lookup_dedup(ibp_cuda_table *t, int dtype, uint32_t dim, const int64_t *indices,
                        uint64_t n_indices, const int64_t *offsets, uint64_t n_bags,
                        const float *weights, int mode, float *out, void *workspace,
                        uint64_t workspace_bytes, cudaStream_t stream)
{
    DedupLayout l;
    int rc = dedup_layout(t, n_indices, &l);
    if (rc)
        return rc;
    void *own = nullptr;
    if (!workspace) {
        IBPC_TRY(cudaMallocAsync(&own, l.total, stream));
        workspace = own;
    } else if (workspace_bytes < l.total) {
        return fail(IBP_CUDA_E_ARG, "lookup workspace of %llu bytes, %llu needed",
                    (unsigned long long)workspace_bytes, (unsigned long long)l.total);
    }
    uint8_t *ws = (uint8_t *)workspace;
    uint32_t *keys_in = (uint32_t *)(void *)(ws + l.keys_in);
    uint32_t *keys_out = (uint32_t *)(void *)(ws + l.keys_out);
    uint32_t *pos_in = (uint32_t *)(void *)(ws + l.pos_in);
    uint32_t *pos_out = (uint32_t *)(void *)(ws + l.pos_out);
    uint32_t *uid = (uint32_t *)(void *)(ws + l.uid);
    uint32_t *inverse = (uint32_t *)(void *)(ws + l.inverse);
    uint32_t *urows = (uint32_t *)(void *)(ws + l.urows);
    uint32_t *count = (uint32_t *)(void *)(ws + l.count);
    uint8_t *rows = ws + l.rows;

    rc = IBP_CUDA_OK;
    if (n_indices) {
        const int blocks = simple_blocks(t, n_indices, kThreads);
        size_t cub_bytes = l.cub_bytes;
        const int ni = (int)n_indices;
        ibp_dedup_keys_kernel<<<blocks, kThreads, 0, stream>>>(indices, n_indices, t->dev.n_rows,
                                                               keys_in, pos_in, t->dev.status);
        cudaError_t e = cudaGetLastError();
        if (e == cudaSuccess)
            e = cub::DeviceRadixSort::SortPairs(ws + l.cub, cub_bytes, keys_in, keys_out, pos_in,
                                                pos_out, ni, 0, key_bits(t->dev.n_rows), stream);
        if (e == cudaSuccess) {
            /* pos_in is free after the sort: it holds the head flags. */
            ibp_dedup_heads_kernel<<<blocks, kThreads, 0, stream>>>(keys_out, n_indices, pos_in);
            e = cudaGetLastError();
        }
        cub_bytes = l.cub_bytes;
        if (e == cudaSuccess)
            e = cub::DeviceScan::InclusiveSum(ws + l.cub, cub_bytes, pos_in, uid, ni, stream);
        if (e == cudaSuccess) {
            ibp_dedup_scatter_kernel<<<blocks, kThreads, 0, stream>>>(keys_out, pos_out, uid,
                                                                      n_indices, inverse, urows,
                                                                      count);
            e = cudaGetLastError();
        }
        if (e != cudaSuccess)
            rc = cuda_fail(e, "deduplicating the lookup's indices", __FILE__, __LINE__);
        if (!rc)
            rc = launch_gather(t, nullptr, urows, count, l.n_unique_max, rows, stream);
    }
    if (!rc) {
        PoolArgs a{rows, inverse, offsets, weights, out, n_indices, n_bags,
                   t->dev.row_bytes, dim, dtype, mode, t->dev.status};
        ibp_pool_kernel<<<simple_blocks(t, n_bags, kThreads / kWarp), kThreads, 0, stream>>>(a);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            rc = cuda_fail(e, "launching the pooling kernel", __FILE__, __LINE__);
    }
    if (own) {
        cudaError_t e = cudaFreeAsync(own, stream);
        if (e != cudaSuccess && !rc)
            rc = cuda_fail(e, "cudaFreeAsync(workspace)", __FILE__, __LINE__);
    }
    return rc;
}

} /* namespace ibpcuda */
