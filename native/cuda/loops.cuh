/* loops.cuh - the per-warp loops of the row kernels, shared by the kernels and
 * their host emulation.
 *
 * A warp of the row-decoding kernel (decode.cu) walks rows first, first +
 * stride, ... and a warp of a pooling kernel (lookup.cu, raw.cu) walks bags
 * the same way, the grid sized to fill the GPU once (grid_blocks), so a warp
 * has many items whenever a batch is larger than the grid. The loops below are
 * that walk: the copy of each next row is issued into the second stage buffer
 * before the current row is decoded (double buffering: the read, over PCIe for
 * a payload in host memory, overlaps the decode), then the buffers swap, and a
 * pooling warp moves on to its next non-empty bag when a bag ends.
 *
 * They are written once, for any `Warp`: the kernels pass one whose operations
 * are cp.async copies, pipeline waits, __syncwarp and the warp-cooperative
 * decode (warp_decode.cuh), with lane = the thread's lane and lanes = 32;
 * emulate.cu passes one whose operations are host copies (into buffers filled
 * with junk first, as shared memory would be) and a lane-by-lane decode, with
 * lane = 0 and lanes = 1, and runs the grid's warps one after the other. So the
 * emulation runs the kernels' own loop control (cursor, next-row prefetch,
 * buffer swap, bag changes, when a bag's output is written) on machines without
 * a GPU. What a Warp provides:
 *
 *   uint8_t *stage0, *stage1;          two stage buffers
 *   uint32_t lane, lanes;              this thread's first element and step
 *   RowRef issue(uint64_t row, uint8_t *stage);  find a row, start its copy
 *   void commit();                     close the copies issued (a pipeline group)
 *   void wait();                       the current row's copies have landed
 *   void sync();                       a warp barrier
 * gather_loop also needs
 *   uint64_t row_id(uint64_t r);       the r-th row to decode
 *   int decode_to(const RowRef &, const uint8_t *stage, uint64_t r);  decode into output row r
 * pool_loop also needs
 *   float *acc;                        the warp's dim float sums (shared memory)
 *   const uint8_t *decode(const RowRef &, const uint8_t *stage, int &status);
 *                                      the row's elements, or NULL: add nothing
 */
#ifndef IBP_CUDA_LOOPS_CUH
#define IBP_CUDA_LOOPS_CUH

#include "cuda/decode.cuh"

/* The loops are host+device templates instantiated with host-only Warps (the
 * emulation) and device-only ones (the kernels): each instantiation only ever
 * runs on its own side, which nvcc's cross-execution-space check cannot see. */
#if defined(__CUDACC__)
#define IBPC_EXEC_CHECK_DISABLE _Pragma("nv_exec_check_disable")
#else
#define IBPC_EXEC_CHECK_DISABLE
#endif

namespace ibpcuda {

/* Arguments of a pooling kernel (fused IBP lookup, raw baseline). */
struct FusedArgs {
    const int64_t *indices;
    const int64_t *offsets;
    const float *weights;
    float *out;
    uint64_t n_indices, n_bags;
    uint32_t dim;
    int dtype, mode;
};

/* A warp's position: bag b, its index range [lo, hi), the current index p. */
struct Cursor {
    uint64_t b, lo, hi, p;
};

/* Move to bag c.b, or the first later bag of this warp (step stride) with rows.
 * Every bag is visited by exactly one warp, so every bag's offsets are checked;
 * bags passed over are empty (their output is zeroed before the launch). */
IBPC_HD bool seek_bag(Cursor &c, const FusedArgs &a, uint64_t stride, int &status)
{
    for (; c.b < a.n_bags; c.b += stride) {
        if (!bag_range(a.offsets, c.b, a.n_bags, a.n_indices, &c.lo, &c.hi))
            status |= kStatusOffsets;
        if (c.hi > c.lo) {
            c.p = c.lo;
            return true;
        }
    }
    return false;
}

/* One warp of the row-decoding kernel: rows first, first + stride, ... < n.
 * Returns the kStatus* bits of its rows. Warp-uniform (r is the same in all lanes). */
IBPC_EXEC_CHECK_DISABLE
template <class Warp>
IBPC_HD int gather_loop(Warp &w, uint64_t first, uint64_t n, uint64_t stride)
{
    int status = 0;
    uint8_t *stage = w.stage0, *next_stage = w.stage1;
    uint64_t r = first;
    RowRef cur = {};
    if (r < n)
        cur = w.issue(w.row_id(r), stage);
    w.commit();
    for (; r < n; r += stride) {
        RowRef nxt = {};
        if (r + stride < n)
            nxt = w.issue(w.row_id(r + stride), next_stage);
        w.commit();
        w.wait(); /* row r's copies (all lanes') have landed; row r + stride's may be in flight */
        status |= w.decode_to(cur, stage, r);
        w.sync(); /* all lanes are done with `stage` before it is refilled */
        uint8_t *s = stage;
        stage = next_stage;
        next_stage = s;
        cur = nxt;
    }
    return status;
}

/* One warp of a pooling kernel: bags first, first + stride, ... < n_bags; each
 * bag's rows are added in index order (libibp's order) into acc, and the bag's
 * output is written after its last row. Returns the kStatus* bits. Warp-uniform. */
IBPC_EXEC_CHECK_DISABLE
template <class Warp>
IBPC_HD int pool_loop(Warp &w, const FusedArgs &a, uint64_t first, uint64_t stride)
{
    int status = 0;
    uint8_t *stage = w.stage0, *next_stage = w.stage1;
    float *acc = w.acc;
    for (uint32_t d = w.lane; d < a.dim; d += w.lanes)
        acc[d] = 0.0f;
    Cursor cur = {first, 0, 0, 0};
    bool valid = seek_bag(cur, a, stride, status);
    RowRef ref = {};
    if (valid)
        ref = w.issue((uint64_t)a.indices[cur.p], stage);
    w.commit();
    while (valid) {
        Cursor nc = cur;
        bool has_next = ++nc.p < nc.hi;
        if (!has_next) {
            nc.b += stride;
            has_next = seek_bag(nc, a, stride, status);
        }
        RowRef nref = {};
        if (has_next)
            nref = w.issue((uint64_t)a.indices[nc.p], next_stage);
        w.commit();
        w.wait();
        const uint8_t *row = w.decode(ref, stage, status);
        w.sync(); /* the row is whole before lanes read elements other lanes wrote */
        if (row)
            for (uint32_t d = w.lane; d < a.dim; d += w.lanes)
                acc[d] = pool_step(acc[d], row_elem(row, d, a.dtype), a.weights, cur.p);
        if (cur.p + 1 == cur.hi) {
            for (uint32_t d = w.lane; d < a.dim; d += w.lanes) {
                a.out[cur.b * a.dim + d] = pool_finish(acc[d], a.mode, cur.lo, cur.hi);
                acc[d] = 0.0f;
            }
        }
        w.sync(); /* the row and `stage` are free before they are written again */
        uint8_t *s = stage;
        stage = next_stage;
        next_stage = s;
        cur = nc;
        ref = nref;
        valid = has_next;
    }
    return status;
}

/* ---- raw rows (the benchmarks' baseline: the same loops with no decoding) ---- */

/* n_rows rows of row_bytes bytes back to back from a 16-byte aligned base. */
struct RawTable {
    const uint8_t *base;
    uint64_t n_rows;
    uint32_t row_bytes;
};

IBPC_HD RowRef locate_raw_row(const RawTable &t, uint64_t row)
{
    RowRef r;
    r.src = t.base;
    r.len = 0;
    r.offset = 0;
    r.status = 0;
    if (row >= t.n_rows) {
        r.status = kStatusIndex;
        return r;
    }
    r.src = t.base + row * t.row_bytes;
    r.len = t.row_bytes;
    r.offset = (uint32_t)((uintptr_t)r.src & (kChunk - 1));
    return r;
}

/* Bytes of granule c of a staged raw row that lie inside the table: 16, except
 * in the last granule of the table's last row when the table does not end on a
 * 16-byte boundary (nothing past the table is read: it may end a mapping). */
IBPC_HD uint32_t raw_granule_bytes(const RawTable &t, const RowRef &r, uint32_t c)
{
    const uint8_t *g = r.src - r.offset + (uint64_t)c * kChunk;
    const uint8_t *end = t.base + t.n_rows * t.row_bytes;
    return g + kChunk <= end ? kChunk : (uint32_t)(end - g);
}

/* Shared bytes of one staged raw row: up to 15 bytes of offset, whole granules. */
IBPC_HD uint32_t raw_stage_bytes(uint32_t row_bytes)
{
    return round_up(row_bytes + kChunk - 1, kChunk);
}

} /* namespace ibpcuda */

#endif /* IBP_CUDA_LOOPS_CUH */
