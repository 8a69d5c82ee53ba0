/* emulate.cu - the kernels' decoding and pooling code run on the host.
 *
 * ibp_cuda_emulate_gather / _lookup / _raw_lookup take host memory and do what
 * the kernels do, with the same __host__ __device__ code: the kernels' per-warp
 * loops (gather_loop, pool_loop in loops.cuh) run for every warp of an emulated
 * grid (ibp_cuda_emulate_grid warps, one warp after the other: warps share
 * nothing but the output), so a warp walks several rows or bags, issuing each
 * next row's copy before decoding the current one, exactly as on the device.
 * Each row is "staged" into a 16-byte aligned buffer as the cp.async copy lays
 * it out (the buffer filled with junk first, as shared memory would be), the
 * 32 lanes of a warp are run one after the other for each step (lane_bits, the
 * scan, lane_word), and pooling goes through the same per-element functions
 * (fma included) in the same order. What this cannot check is what only
 * hardware does: the shuffles, cp.async, barriers, launch geometry and CUB.
 */
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "cuda/ibp_cuda_internal.cuh"
#include "cuda/loops.cuh"

namespace ibpcuda {
namespace {

/* A host table seen as a DevTable, with a 16-byte aligned payload (the device
 * tables guarantee that; a host buffer that is not aligned is copied). */
struct HostTable {
    DevTable t;
    Meta m;
    std::vector<uint8_t> vbits;
    std::vector<uint64_t> zeros; /* a raw table's codebook: one cluster of zero masks */
    uint8_t *aligned_copy = nullptr;
    ~HostTable() { free(aligned_copy); }
};

int host_table(const ibp_table *h, HostTable *ht)
{
    if (!h)
        return fail(IBP_CUDA_E_ARG, "emulate: null table");
    if (h->block_len)
        return fail(IBP_CUDA_E_ARG, "emulate: updatable (store-mode) tables are not supported");
    const ibp_codebook &cb = h->cb;
    const bool raw = cb.n_clusters == 0; /* rows at i * R: no index, no tail pad */
    if ((!raw && (!cb.masks || !cb.bitvals || !h->block_base || !h->rel)) || (h->payload_bytes && !h->payload))
        return fail(IBP_CUDA_E_ARG, "emulate: null table pointer");
    if (cb.word_bits != 16 && cb.word_bits != 32 && cb.word_bits != 64)
        return fail(IBP_CUDA_E_ARG, "emulate: word size %u", cb.word_bits);
    if (cb.n_clusters > 256 || (raw && h->payload_bytes != h->n_rows * cb.row_bytes))
        return fail(IBP_CUDA_E_ARG, "emulate: %u clusters, %llu payload bytes for %llu rows", cb.n_clusters,
                    (unsigned long long)h->payload_bytes, (unsigned long long)h->n_rows);
    const uint64_t km = (uint64_t)meta_clusters(cb.n_clusters) * cb.n_words;
    ht->vbits.resize(km);
    if (raw)
        ht->zeros.assign(km, 0);
    const uint64_t *masks = raw ? ht->zeros.data() : cb.masks;
    for (uint64_t i = 0; i < km; i++)
        ht->vbits[i] = (uint8_t)(cb.word_bits - ibp_popcount64(masks[i] & ibp_low_bits(cb.word_bits)));
    DevTable &t = ht->t;
    t.masks = masks;
    t.bitvals = raw ? ht->zeros.data() : cb.bitvals;
    t.vbits = ht->vbits.data();
    t.block_base = h->block_base;
    t.rel = h->rel;
    t.payload = h->payload;
    if ((uintptr_t)h->payload % kChunk || raw) { /* as the device sees it: aligned, padded */
        uint64_t span = h->payload_bytes + ibp_tail_pad_bytes(cb.row_bytes, cb.word_bits);
        uint64_t have = raw ? h->payload_bytes : span;
        ht->aligned_copy = (uint8_t *)aligned_alloc(kChunk, (span + kChunk - 1) / kChunk * kChunk);
        if (!ht->aligned_copy)
            return fail(IBP_CUDA_E_NOMEM, "emulate: no memory for an aligned payload copy");
        memset(ht->aligned_copy, 0, span);
        if (have)
            memcpy(ht->aligned_copy, h->payload, have);
        t.payload = ht->aligned_copy;
    }
    t.n_rows = h->n_rows;
    t.row_bytes = cb.row_bytes;
    t.word_bits = cb.word_bits;
    t.n_words = cb.n_words;
    t.n_clusters = cb.n_clusters;
    t.rel_bytes = h->rel_bytes;
    t.status = nullptr;
    ht->m = Meta{t.masks, t.bitvals, t.vbits};
    return IBP_CUDA_OK;
}

/* Warps of the emulated grid (ibp_cuda_emulate_grid). The default is small, so
 * that the tests' batches of a few hundred rows already give every warp several
 * rows and bags. */
constexpr uint32_t kDefaultGridWarps = 16;
std::atomic<uint32_t> g_grid_warps{kDefaultGridWarps};

/* A warp's decode of one row (warp_decode_row in warp_decode.cuh), lane by lane. */
template <uint32_t W, class Sink>
int emulate_decode(const DevTable &t, const Meta &m, const RowRef &r, const uint8_t *p, Sink &sink)
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
        for (uint32_t j = 0; j < M; j++)
            sink.put(j, 0);
        return status;
    }
    uint64_t base = 0;
    for (uint32_t j0 = 0; j0 < M; j0 += kWarp) {
        uint32_t n[kWarp], part[kWarp], incl[kWarp], sum = 0;
        for (uint32_t lane = 0; lane < kWarp; lane++) {
            n[lane] = lane_bits(c, j0 + lane, M, W, &part[lane]);
            incl[lane] = (sum += n[lane]);
        }
        for (uint32_t lane = 0; lane < kWarp; lane++) {
            uint32_t j = j0 + lane;
            if (j < M)
                sink.put(j, lane_word<W>(c, j, part[lane], base + (incl[lane] - n[lane]), n[lane]));
        }
        base += incl[kWarp - 1];
    }
    return row_consistent(c, base) ? 0 : kStatusCorrupt;
}

struct Aligned {
    uint8_t *p;
    explicit Aligned(size_t n) : p((uint8_t *)aligned_alloc(kChunk, (n + kChunk - 1) / kChunk * kChunk + kChunk)) {}
    ~Aligned() { free(p); }
};

/* The host's Warp (loops.cuh): one thread stands for the 32 lanes, copies are
 * immediate, barriers are no-ops. Stage buffers get junk, then the row's granules. */
struct HostWarp {
    uint8_t *stage0, *stage1;
    uint32_t stage_bytes;
    static constexpr uint32_t lane = 0, lanes = 1;
    void commit() {}
    void wait() {}
    void sync() {}
    RowRef stage_row(const RowRef &r, uint8_t *stage) const
    {
        memset(stage, 0xA5, stage_bytes);
        if (r.len)
            memcpy(stage, r.src - r.offset, (size_t)stage_chunks(r) * kChunk);
        return r;
    }
};

/* Rows of an IBP table, decoded lane by lane: into gather output rows ... */
template <uint32_t W>
struct HostGatherWarp : HostWarp {
    const DevTable &t;
    const Meta &m;
    const int64_t *idx;     /* rows to decode: int64 ids, or */
    const uint32_t *urows;  /* uint32 row ids (the dedup path) */
    uint8_t *out;
    bool aligned;

    RowRef issue(uint64_t row, uint8_t *stage) { return stage_row(locate_row(t, row), stage); }
    uint64_t row_id(uint64_t r) const { return idx ? (uint64_t)idx[r] : (uint64_t)urows[r]; }
    int decode_to(const RowRef &ref, const uint8_t *stage, uint64_t r)
    {
        RowStore<W> sink{out + r * t.row_bytes, t.row_bytes, aligned};
        return emulate_decode<W>(t, m, ref, stage + ref.offset, sink);
    }
};

/* ... or into the fused lookup's row buffer. */
template <uint32_t W>
struct HostFusedWarp : HostWarp {
    const DevTable &t;
    const Meta &m;
    uint8_t *row;
    float *acc;

    RowRef issue(uint64_t row_id, uint8_t *stage) { return stage_row(locate_row(t, row_id), stage); }
    const uint8_t *decode(const RowRef &ref, const uint8_t *stage, int &status)
    {
        RowStore<W> sink{row, t.row_bytes, true};
        status |= emulate_decode<W>(t, m, ref, stage + ref.offset, sink);
        return row;
    }
};

/* Raw rows (ibp_cuda_raw_lookup's kernel): staged granules, no decoding. */
struct HostRawWarp : HostWarp {
    const RawTable &t;
    float *acc;

    RowRef issue(uint64_t row, uint8_t *stage)
    {
        RowRef r = locate_raw_row(t, row);
        memset(stage, 0xA5, stage_bytes);
        for (uint32_t c = 0; r.len && c < stage_chunks(r); c++)
            memcpy(stage + c * kChunk, r.src - r.offset + c * kChunk, raw_granule_bytes(t, r, c));
        return r;
    }
    const uint8_t *decode(const RowRef &ref, const uint8_t *stage, int &status)
    {
        status |= ref.status;
        return ref.len ? stage + ref.offset : nullptr;
    }
};

/* The gather kernel over the emulated grid: rows idx[0..n) or urows[0..n) into out. */
template <uint32_t W>
int emulate_gather_grid(const HostTable &ht, const int64_t *idx, const uint32_t *urows, uint64_t n,
                        uint8_t *out)
{
    const DevTable &t = ht.t;
    const uint32_t sb = stage_bytes_for(t.n_words, W);
    Aligned s0(sb), s1(sb);
    if (!s0.p || !s1.p)
        return -1;
    HostGatherWarp<W> w{{s0.p, s1.p, sb}, t, ht.m, idx, urows, out,
                        (uintptr_t)out % (W / 8) == 0 && t.row_bytes % (W / 8) == 0};
    const uint64_t grid = g_grid_warps.load();
    int status = 0;
    for (uint64_t warp = 0; warp < grid; warp++)
        status |= gather_loop(w, warp, n, grid);
    return status;
}

int gather_grid(const HostTable &ht, const int64_t *idx, const uint32_t *urows, uint64_t n,
                uint8_t *out)
{
    switch (ht.t.word_bits) {
    case 16: return emulate_gather_grid<16>(ht, idx, urows, n, out);
    case 32: return emulate_gather_grid<32>(ht, idx, urows, n, out);
    default: return emulate_gather_grid<64>(ht, idx, urows, n, out);
    }
}

/* The fused lookup kernel over the emulated grid. */
template <uint32_t W>
int emulate_fused_grid(const HostTable &ht, const FusedArgs &a)
{
    const DevTable &t = ht.t;
    const uint32_t sb = stage_bytes_for(t.n_words, W);
    Aligned s0(sb), s1(sb), row(round_up(t.n_words * (W / 8), kChunk));
    std::vector<float> acc(a.dim);
    if (!s0.p || !s1.p || !row.p)
        return -1;
    HostFusedWarp<W> w{{s0.p, s1.p, sb}, t, ht.m, row.p, acc.data()};
    const uint64_t grid = g_grid_warps.load();
    int status = 0;
    for (uint64_t warp = 0; warp < grid; warp++)
        status |= pool_loop(w, a, warp, grid);
    return status;
}

int check_lookup_args(int dtype, uint32_t dim, uint32_t row_bytes, int mode, uint64_t n_indices,
                      const int64_t *indices, const int64_t *offsets, uint64_t n_bags,
                      const float *out, const char *what)
{
    if (dtype != IBP_DTYPE_F32 && dtype != IBP_DTYPE_F16 && dtype != IBP_DTYPE_BF16)
        return fail(IBP_CUDA_E_ARG, "%s: dtype %d", what, dtype);
    if ((uint64_t)dim * (dtype == IBP_DTYPE_F32 ? 4 : 2) != row_bytes)
        return fail(IBP_CUDA_E_ARG, "%s: dim %u does not match rows of %u bytes", what, dim, row_bytes);
    if (mode != IBP_POOL_SUM && mode != IBP_POOL_MEAN)
        return fail(IBP_CUDA_E_ARG, "%s: pooling mode %d", what, mode);
    if ((n_bags && (!offsets || !out)) || (n_indices && !indices))
        return fail(IBP_CUDA_E_ARG, "%s: null pointer", what);
    return IBP_CUDA_OK;
}

} /* namespace */
} /* namespace ibpcuda */

using namespace ibpcuda;

extern "C" uint32_t ibp_cuda_emulate_grid(uint32_t warps)
{
    return g_grid_warps.exchange(warps ? warps : kDefaultGridWarps);
}

extern "C" int ibp_cuda_emulate_gather(const ibp_table *table, const int64_t *indices, uint64_t n,
                                       uint8_t *out)
{
    HostTable ht;
    int rc = host_table(table, &ht);
    if (rc)
        return rc;
    if (n && (!indices || !out))
        return fail(IBP_CUDA_E_ARG, "emulate_gather: null indices or output");
    int status = gather_grid(ht, indices, nullptr, n, out);
    if (status < 0)
        return fail(IBP_CUDA_E_NOMEM, "emulate_gather: no memory");
    return status_error(status);
}

extern "C" int ibp_cuda_emulate_lookup(const ibp_table *table, int dtype, uint32_t dim,
                                       const int64_t *indices, uint64_t n_indices,
                                       const int64_t *offsets, uint64_t n_bags, const float *weights,
                                       int mode, float *out, int dedup)
{
    HostTable ht;
    int rc = host_table(table, &ht);
    if (rc)
        return rc;
    const DevTable &t = ht.t;
    rc = check_lookup_args(dtype, dim, t.row_bytes, mode, n_indices, indices, offsets, n_bags, out,
                           "emulate_lookup");
    if (rc)
        return rc;
    const uint32_t R = t.row_bytes;
    int status = 0;
    if (n_bags)
        memset(out, 0, (size_t)n_bags * dim * sizeof(float)); /* the launch's cudaMemsetAsync */
    if (dedup) {
        /* keys, a stable sort by row id (CUB's radix sort is stable), heads, numbers. */
        std::vector<uint32_t> keys(n_indices), pos(n_indices), inverse(n_indices), urows;
        for (uint64_t i = 0; i < n_indices; i++) {
            int64_t v = indices[i];
            bool ok = v >= 0 && (uint64_t)v < t.n_rows;
            keys[i] = ok ? (uint32_t)v : (uint32_t)t.n_rows;
            pos[i] = (uint32_t)i;
            status |= ok ? 0 : kStatusIndex;
        }
        std::stable_sort(pos.begin(), pos.end(), [&](uint32_t a, uint32_t b) { return keys[a] < keys[b]; });
        for (uint64_t i = 0; i < n_indices; i++) {
            if (i == 0 || keys[pos[i]] != keys[pos[i - 1]])
                urows.push_back(keys[pos[i]]);
            inverse[pos[i]] = (uint32_t)urows.size() - 1;
        }
        /* Distinct rows decoded once each by the gather kernel's loop (into a
         * 16-byte aligned buffer, as the workspace's 256-byte aligned rows). */
        Aligned rows((size_t)urows.size() * R + kChunk);
        if (!rows.p)
            return fail(IBP_CUDA_E_NOMEM, "emulate_lookup: no memory");
        int st = gather_grid(ht, nullptr, urows.data(), urows.size(), rows.p);
        if (st < 0)
            return fail(IBP_CUDA_E_NOMEM, "emulate_lookup: no memory");
        status |= st;
        for (uint64_t b = 0; b < n_bags; b++) {
            uint64_t lo, hi;
            status |= bag_range(offsets, b, n_bags, n_indices, &lo, &hi) ? 0 : kStatusOffsets;
            for (uint32_t d = 0; d < dim; d++)
                out[b * dim + d] = pool_bag_elem(rows.p, R, inverse.data(), weights, dtype, mode, lo, hi, d);
        }
    } else {
        FusedArgs a{indices, offsets, weights, out, n_indices, n_bags, dim, dtype, mode};
        int st;
        switch (t.word_bits) {
        case 16: st = emulate_fused_grid<16>(ht, a); break;
        case 32: st = emulate_fused_grid<32>(ht, a); break;
        default: st = emulate_fused_grid<64>(ht, a); break;
        }
        if (st < 0)
            return fail(IBP_CUDA_E_NOMEM, "emulate_lookup: no memory");
        status |= st;
    }
    return status_error(status);
}

extern "C" int ibp_cuda_emulate_raw_lookup(const void *rows, uint64_t n_rows, int dtype, uint32_t dim,
                                           const int64_t *indices, uint64_t n_indices,
                                           const int64_t *offsets, uint64_t n_bags,
                                           const float *weights, int mode, float *out)
{
    const uint32_t R = dim * (dtype == IBP_DTYPE_F32 ? 4u : 2u);
    int rc = check_lookup_args(dtype, dim, R, mode, n_indices, indices, offsets, n_bags, out,
                               "emulate_raw_lookup");
    if (rc)
        return rc;
    if (!dim || (n_rows && !rows) || (uintptr_t)rows % kChunk)
        return fail(IBP_CUDA_E_ARG, "emulate_raw_lookup: rows must be non-null and 16-byte aligned, "
                    "dim at least 1");
    if (n_bags)
        memset(out, 0, (size_t)n_bags * dim * sizeof(float));
    RawTable t{(const uint8_t *)rows, n_rows, R};
    const uint32_t sb = raw_stage_bytes(R);
    Aligned s0(sb), s1(sb);
    std::vector<float> acc(dim);
    if (!s0.p || !s1.p)
        return fail(IBP_CUDA_E_NOMEM, "emulate_raw_lookup: no memory");
    HostRawWarp w{{s0.p, s1.p, sb}, t, acc.data()};
    FusedArgs a{indices, offsets, weights, out, n_indices, n_bags, dim, dtype, mode};
    const uint64_t grid = g_grid_warps.load();
    int status = 0;
    for (uint64_t warp = 0; warp < grid; warp++)
        status |= pool_loop(w, a, warp, grid);
    return status_error(status);
}
