/* warp_decode.cuh - device-only pieces of the row kernels: codebook staging,
 * cp.async row staging and the warp-cooperative row decode (decode.cu, lookup.cu).
 *
 * Memory access reasoning
 * -----------------------
 * - The payload is read once, by cp.async, in 16-byte granules: lane l copies
 *   granules l, l+32, ... of the row, so a warp's copy instruction covers up to
 *   512 contiguous, 16-byte aligned bytes; the memory system turns that into
 *   whole 32-byte sectors / 128-byte lines. For a payload in pinned host memory
 *   these are the PCIe reads, and only the row's compressed bytes (plus under
 *   16 bytes of alignment slack at each end) cross the bus. cp.async.cg goes
 *   around L1 (a row is read once) and lands in shared memory without passing
 *   through registers, so the warp can issue the next row's copy and decode the
 *   current one while the copy is in flight: two stage buffers per warp.
 * - The offsets index (block_base, rel) and the codebook are in device memory.
 *   All lanes of a warp read the same index entries (broadcast); the codebook
 *   is copied once per block into shared memory when it fits (masks, bitvals,
 *   vbits are then read by lane j at word j: consecutive 8-byte or 1-byte
 *   shared loads, no bank conflicts beyond the 2-wavefront 8-byte case).
 * - Bit fields are read from shared memory with aligned 32-bit loads; lanes of
 *   a step read neighbouring words, so most loads are distinct banks or the same
 *   word (broadcast).
 * - Decoded words are stored by lane j at word j of the row: a warp stores 32
 *   consecutive 2-, 4- or 8-byte words (64, 128 or 256 contiguous bytes), fully
 *   coalesced when the row is word aligned (else byte stores, still contiguous).
 */
#ifndef IBP_CUDA_WARP_DECODE_CUH
#define IBP_CUDA_WARP_DECODE_CUH

#include <cuda_pipeline.h>

#include "cuda/loops.cuh"

namespace ibpcuda {

/* Launch bounds of the row kernels: 256 threads, at least 4 blocks an SM, i.e. at
 * most 64 registers a thread and 32 resident warps an SM, each with a row copy in
 * flight (latency hiding for PCIe reads). ptxas fits the kernels in 64 registers
 * without spills at these bounds (tests/test_cuda_library.py checks the spill
 * counts); without the minimum-blocks hint it chose 64 registers by itself and
 * spilled. */
#define IBPC_ROW_KERNEL_BOUNDS __launch_bounds__(256, 4)

/* Copy the codebook into shared memory (block-wide) when the geometry says so. */
__device__ __forceinline__ Meta load_meta(const DevTable &t, const Geometry &g, uint8_t *smem)
{
    Meta m;
    if (!g.meta_bytes) {
        m.masks = t.masks;
        m.bitvals = t.bitvals;
        m.vbits = t.vbits;
        return m;
    }
    const uint32_t km = meta_clusters(t.n_clusters) * t.n_words;
    uint64_t *masks = (uint64_t *)(void *)smem;
    uint64_t *bitvals = (uint64_t *)(void *)(smem + round_up(km * 8, kChunk));
    uint8_t *vbits = smem + 2 * round_up(km * 8, kChunk);
    for (uint32_t i = threadIdx.x; i < km; i += blockDim.x) {
        masks[i] = t.masks[i];
        bitvals[i] = t.bitvals[i];
        vbits[i] = t.vbits[i];
    }
    __syncthreads();
    m.masks = masks;
    m.bitvals = bitvals;
    m.vbits = vbits;
    return m;
}

/* Inclusive prefix sum of v over the warp (all 32 lanes must call it). */
__device__ __forceinline__ uint32_t warp_inclusive_scan(uint32_t v, uint32_t lane)
{
#pragma unroll
    for (uint32_t o = 1; o < kWarp; o <<= 1) {
        uint32_t u = __shfl_up_sync(kFullMask, v, o);
        if (lane >= o)
            v += u;
    }
    return v;
}

/* Find row `row` and, when staged, start copying it into `stage` (this lane's
 * share of the granules). The caller commits the copy group. */
template <bool kStaged>
__device__ __forceinline__ RowRef issue_row(const DevTable &t, uint64_t row, uint8_t *stage,
                                            uint32_t lane)
{
    RowRef r = locate_row(t, row);
    if (kStaged && r.len) {
        const uint8_t *from = r.src - r.offset; /* 16-byte aligned: the payload is */
        const uint32_t chunks = stage_chunks(r);
        for (uint32_t c = lane; c < chunks; c += kWarp)
            __pipeline_memcpy_async(stage + c * kChunk, from + c * kChunk, kChunk);
    }
    return r;
}

/* Decode one row with the whole warp; sink.put(j, word) is called by the lane
 * that decoded word j, sink.zero(j) for every word of a row that cannot be
 * decoded. p: the row's first byte (stage buffer or payload). Returns the
 * row's kStatus* bits (the same in every lane). */
template <uint32_t W, class Sink>
__device__ __forceinline__ int warp_decode_row(const DevTable &t, const Meta &m, const RowRef &r,
                                               const uint8_t *p, uint32_t lane, Sink &sink)
{
    const uint32_t M = t.n_words;
    int status = r.status;
    RowCode c;
    if (!status) {
        c = row_code(m, p, r.len, t.row_bytes, M, t.n_clusters);
        if (c.bad)
            status = kStatusCorrupt;
    }
    if (status) {
        for (uint32_t j = lane; j < M; j += kWarp)
            sink.put(j, 0);
        return status;
    }
    uint64_t base = 0; /* bit offset of this step's first word */
    for (uint32_t j0 = 0; j0 < M; j0 += kWarp) {
        const uint32_t j = j0 + lane;
        uint32_t part;
        const uint32_t n = lane_bits(c, j, M, W, &part);
        const uint32_t incl = warp_inclusive_scan(n, lane);
        const uint32_t step_bits = __shfl_sync(kFullMask, incl, kWarp - 1);
        if (j < M)
            sink.put(j, lane_word<W>(c, j, part, base + (incl - n), n));
        base += step_bits;
    }
    return row_consistent(c, base) ? 0 : kStatusCorrupt;
}

/* The kernels' Warp for the loops of loops.cuh over IBP rows: cp.async stage
 * copies (kStaged) or none (lanes read the payload directly), pipeline waits,
 * __syncwarp, and the warp-cooperative decode. */
template <uint32_t W, bool kStaged>
struct DeviceWarp {
    const DevTable &t;
    const Meta &m;
    uint8_t *stage0, *stage1;
    uint32_t lane;
    static constexpr uint32_t lanes = kWarp;

    __device__ __forceinline__ RowRef issue(uint64_t row, uint8_t *stage)
    {
        return issue_row<kStaged>(t, row, stage, lane);
    }
    __device__ __forceinline__ void commit()
    {
        if (kStaged)
            __pipeline_commit();
    }
    __device__ __forceinline__ void wait()
    {
        if (kStaged) {
            __pipeline_wait_prior(1); /* this lane's copies of the current row have landed */
            __syncwarp();             /* ... and every other lane's */
        }
    }
    __device__ __forceinline__ void sync()
    {
        if (kStaged)
            __syncwarp();
    }
    /* The row's first byte as the decoder reads it: in its stage buffer, or in the payload. */
    __device__ __forceinline__ const uint8_t *row_bytes_at(const RowRef &r, const uint8_t *stage) const
    {
        return kStaged ? stage + r.offset : r.src;
    }
};

} /* namespace ibpcuda */

#endif /* IBP_CUDA_WARP_DECODE_CUH */
