/* emulate.cu - the kernels' decoding and pooling code run on the host.
 *
 * ibp_cuda_emulate_gather / _lookup take a host ibp_table and do what the
 * kernels do, with the same __host__ __device__ functions (decode.cuh): each row
 * is "staged" into a 16-byte aligned buffer exactly as the cp.async copy lays
 * it out (the rest of the buffer filled with junk, as shared memory would be),
 * the 32 lanes of a warp are run one after the other for each step (lane_bits,
 * the scan, lane_word), and pooling goes through the same per-element functions
 * in the same order. What this cannot check is what only hardware does: the
 * shuffles, cp.async, barriers, launch geometry and CUB.
 */
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "cuda/ibp_cuda_internal.cuh"

namespace ibpcuda {
namespace {

/* A host table seen as a DevTable, with a 16-byte aligned payload (the device
 * tables guarantee that; a host buffer that is not aligned is copied). */
struct HostTable {
    DevTable t;
    Meta m;
    std::vector<uint8_t> vbits;
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
    if (!cb.masks || !cb.bitvals || !h->block_base || !h->rel || !h->payload)
        return fail(IBP_CUDA_E_ARG, "emulate: null table pointer");
    if (cb.word_bits != 16 && cb.word_bits != 32 && cb.word_bits != 64)
        return fail(IBP_CUDA_E_ARG, "emulate: word size %u", cb.word_bits);
    const uint64_t km = (uint64_t)cb.n_clusters * cb.n_words;
    ht->vbits.resize(km);
    for (uint64_t i = 0; i < km; i++)
        ht->vbits[i] = (uint8_t)(cb.word_bits - ibp_popcount64(cb.masks[i] & ibp_low_bits(cb.word_bits)));
    DevTable &t = ht->t;
    t.masks = cb.masks;
    t.bitvals = cb.bitvals;
    t.vbits = ht->vbits.data();
    t.block_base = h->block_base;
    t.rel = h->rel;
    t.payload = h->payload;
    if ((uintptr_t)h->payload % kChunk) {
        uint64_t span = h->payload_bytes + ibp_tail_pad_bytes(cb.row_bytes, cb.word_bits);
        ht->aligned_copy = (uint8_t *)aligned_alloc(kChunk, (span + kChunk - 1) / kChunk * kChunk);
        if (!ht->aligned_copy)
            return fail(IBP_CUDA_E_NOMEM, "emulate: no memory for an aligned payload copy");
        memcpy(ht->aligned_copy, h->payload, span);
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

/* A warp's decode of one row (warp_decode_row in warp_decode.cuh), lane by lane. */
template <uint32_t W>
int emulate_row(const DevTable &t, const Meta &m, uint64_t row, uint8_t *stage, uint8_t *out,
                bool aligned)
{
    const uint32_t M = t.n_words;
    RowRef r = locate_row(t, row);
    /* The cp.async staging: granules from the 16-byte boundary below the row. */
    memset(stage, 0xA5, stage_bytes_for(M, W));
    if (r.len)
        memcpy(stage, r.src - r.offset, (size_t)stage_chunks(r) * kChunk);
    int status = r.status;
    RowCode c;
    if (!status) {
        c = row_code(m, stage + r.offset, r.len, t.row_bytes, M, t.n_clusters);
        if (c.bad)
            status = kStatusCorrupt;
    }
    if (status) {
        for (uint32_t j = 0; j < M; j++)
            store_word<W>(out, j, 0, t.row_bytes, aligned);
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
                store_word<W>(out, j, lane_word<W>(c, j, part[lane], base + (incl[lane] - n[lane]), n[lane]),
                              t.row_bytes, aligned);
        }
        base += incl[kWarp - 1];
    }
    return row_consistent(c, base) ? 0 : kStatusCorrupt;
}

int emulate_row_any(const DevTable &t, const Meta &m, uint64_t row, uint8_t *stage, uint8_t *out,
                    bool aligned)
{
    switch (t.word_bits) {
    case 16: return emulate_row<16>(t, m, row, stage, out, aligned);
    case 32: return emulate_row<32>(t, m, row, stage, out, aligned);
    default: return emulate_row<64>(t, m, row, stage, out, aligned);
    }
}

struct Aligned {
    uint8_t *p;
    explicit Aligned(size_t n) : p((uint8_t *)aligned_alloc(kChunk, (n + kChunk - 1) / kChunk * kChunk + kChunk)) {}
    ~Aligned() { free(p); }
};

} /* namespace */
} /* namespace ibpcuda */

using namespace ibpcuda;

extern "C" int ibp_cuda_emulate_gather(const ibp_table *table, const int64_t *indices, uint64_t n,
                                       uint8_t *out)
{
    HostTable ht;
    int rc = host_table(table, &ht);
    if (rc)
        return rc;
    if (n && (!indices || !out))
        return fail(IBP_CUDA_E_ARG, "emulate_gather: null indices or output");
    const DevTable &t = ht.t;
    Aligned stage(stage_bytes_for(t.n_words, t.word_bits));
    if (!stage.p)
        return fail(IBP_CUDA_E_NOMEM, "emulate_gather: no memory");
    const uint32_t B = t.word_bits / 8;
    const bool aligned = (uintptr_t)out % B == 0 && t.row_bytes % B == 0;
    int status = 0;
    for (uint64_t r = 0; r < n; r++)
        status |= emulate_row_any(t, ht.m, (uint64_t)indices[r], stage.p, out + r * t.row_bytes, aligned);
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
    if (dtype != IBP_DTYPE_F32 && dtype != IBP_DTYPE_F16 && dtype != IBP_DTYPE_BF16)
        return fail(IBP_CUDA_E_ARG, "emulate_lookup: dtype %d", dtype);
    if ((uint64_t)dim * (dtype == IBP_DTYPE_F32 ? 4 : 2) != t.row_bytes)
        return fail(IBP_CUDA_E_ARG, "emulate_lookup: dim %u does not match rows of %u bytes", dim,
                    t.row_bytes);
    if ((n_bags && (!offsets || !out)) || (n_indices && !indices))
        return fail(IBP_CUDA_E_ARG, "emulate_lookup: null pointer");
    const uint32_t R = t.row_bytes, M = t.n_words, B = t.word_bits / 8;
    Aligned stage(stage_bytes_for(M, t.word_bits));
    Aligned row(round_up(M * B, kChunk));
    if (!stage.p || !row.p)
        return fail(IBP_CUDA_E_NOMEM, "emulate_lookup: no memory");
    int status = 0;
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
        std::vector<uint8_t> rows((size_t)urows.size() * R + kChunk);
        const bool aligned = R % B == 0; /* the workspace rows start 256-aligned */
        for (size_t u = 0; u < urows.size(); u++) {
            if (aligned) {
                status |= emulate_row_any(t, ht.m, urows[u], stage.p, row.p, true);
                memcpy(rows.data() + u * R, row.p, R);
            } else {
                status |= emulate_row_any(t, ht.m, urows[u], stage.p, rows.data() + u * R, false);
            }
        }
        for (uint64_t b = 0; b < n_bags; b++) {
            uint64_t lo, hi;
            status |= bag_range(offsets, b, n_bags, n_indices, &lo, &hi) ? 0 : kStatusOffsets;
            for (uint32_t d = 0; d < dim; d++)
                out[b * dim + d] = pool_bag_elem(rows.data(), R, inverse.data(), weights, dtype, mode, lo, hi, d);
        }
    } else {
        /* A warp per bag: decode each row into the shared row, add it into the sums. */
        std::vector<float> acc(dim);
        for (uint64_t b = 0; b < n_bags; b++) {
            uint64_t lo, hi;
            status |= bag_range(offsets, b, n_bags, n_indices, &lo, &hi) ? 0 : kStatusOffsets;
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (uint64_t p = lo; p < hi; p++) {
                status |= emulate_row_any(t, ht.m, (uint64_t)indices[p], stage.p, row.p, true);
                for (uint32_t d = 0; d < dim; d++)
                    acc[d] = pool_step(acc[d], row_elem(row.p, d, dtype), weights, p);
            }
            for (uint32_t d = 0; d < dim; d++)
                out[b * dim + d] = hi > lo ? pool_finish(acc[d], mode, lo, hi) : 0.0f;
        }
    }
    return status_error(status);
}
