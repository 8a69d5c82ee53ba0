/* decode.cu - the warp-cooperative row decode kernel (gathers, and the dedup
 * lookup's decoding of each distinct row).
 *
 * One warp decodes one row at a time and walks its rows with a grid-sized
 * stride (the grid is sized to fill the GPU once, see grid_blocks). While it
 * decodes row r from one stage buffer, the cp.async copy of its next row,
 * r + stride, fills the other: the latency of the read (PCIe for a payload in
 * pinned host memory, about a microsecond) overlaps the decode of the row
 * before. That loop is gather_loop (loops.cuh), which emulate.cu runs too. The rows a warp is given in a lookup are sorted and distinct, so the
 * reads of the grid sweep the payload in address order.
 */
#include "cuda/ibp_cuda_internal.cuh"
#include "cuda/warp_decode.cuh"

namespace ibpcuda {
namespace {

/* The rows to decode: int64 indices, or uint32 row ids with a device-side count. */
struct RowSource {
    const int64_t *idx;
    const uint32_t *urows;
    const uint32_t *count;
    uint64_t n;

    __device__ __forceinline__ uint64_t size() const
    {
        if (!count)
            return n;
        uint64_t c = *count;
        return c < n ? c : n;
    }
    __device__ __forceinline__ uint64_t row(uint64_t r) const
    {
        /* A negative index becomes a huge row id: out of range, decoded as zeros. */
        return idx ? (uint64_t)idx[r] : (uint64_t)urows[r];
    }
};

/* The gather kernel's Warp (loops.cuh): rows from a RowSource, decoded into out. */
template <uint32_t W, bool kStaged>
struct GatherWarp : DeviceWarp<W, kStaged> {
    const RowSource &src;
    uint8_t *out;
    bool aligned;

    __device__ __forceinline__ uint64_t row_id(uint64_t r) const { return src.row(r); }
    __device__ __forceinline__ int decode_to(const RowRef &ref, const uint8_t *stage, uint64_t r)
    {
        RowStore<W> sink{out + r * this->t.row_bytes, this->t.row_bytes, aligned};
        return warp_decode_row<W>(this->t, this->m, ref, this->row_bytes_at(ref, stage), this->lane,
                                  sink);
    }
};

template <uint32_t W, bool kStaged>
__global__ void IBPC_ROW_KERNEL_BOUNDS
ibp_gather_rows_kernel(DevTable t, Geometry g, RowSource src, uint8_t *out)
{
    extern __shared__ __align__(16) uint8_t smem[];
    const Meta m = load_meta(t, g, smem);
    const uint32_t lane = threadIdx.x & (kWarp - 1), warp = threadIdx.x / kWarp;
    uint8_t *stage = smem + g.meta_bytes + warp * g.warp_bytes;
    GatherWarp<W, kStaged> w{{t, m, stage, stage + g.stage_bytes, lane}, src, out,
                             (uintptr_t)out % (W / 8) == 0 && t.row_bytes % (W / 8) == 0};
    const int status = gather_loop(w, (uint64_t)blockIdx.x * g.warps + warp, src.size(),
                                   (uint64_t)gridDim.x * g.warps);
    if (status && lane == 0)
        atomicOr(t.status, status);
}

template <uint32_t W, bool kStaged>
int launch(ibp_cuda_table *t, const RowSource &src, uint8_t *out, cudaStream_t stream)
{
    const Geometry &g = t->gather;
    const void *kernel = (const void *)ibp_gather_rows_kernel<W, kStaged>;
    if (g.smem_bytes > 48 * 1024)
        IBPC_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      (int)g.smem_bytes));
    int blocks;
    int rc = grid_blocks(t, kernel, g.warps * kWarp, g.smem_bytes, src.n, g.warps, &blocks);
    if (rc)
        return rc;
    ibp_gather_rows_kernel<W, kStaged><<<blocks, g.warps * kWarp, g.smem_bytes, stream>>>(
        t->dev, g, src, out);
    IBPC_LAUNCHED("launching the row decode kernel");
    return IBP_CUDA_OK;
}

} /* namespace */

int launch_gather(ibp_cuda_table *t, const int64_t *idx, const uint32_t *urows,
                  const uint32_t *count, uint64_t n, uint8_t *out, cudaStream_t stream)
{
    if (!n)
        return IBP_CUDA_OK;
    RowSource src{idx, urows, count, n};
    const bool staged = t->gather.staged != 0;
    switch (t->dev.word_bits) {
    case 16: return staged ? launch<16, true>(t, src, out, stream) : launch<16, false>(t, src, out, stream);
    case 32: return staged ? launch<32, true>(t, src, out, stream) : launch<32, false>(t, src, out, stream);
    default: return staged ? launch<64, true>(t, src, out, stream) : launch<64, false>(t, src, out, stream);
    }
}

} /* namespace ibpcuda */
