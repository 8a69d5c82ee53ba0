/* placement.cu - putting a table's data where the kernels read it: the metadata
 * block (codebook, offsets index, status word) in device memory, and the payload
 * as a device copy, registered in place (host memory the device reads over the
 * bus), or a pinned, mapped copy; the registration table those placements share;
 * the device memory a placement takes (ibp_cuda_table_device_bytes) and the
 * public host-memory registration (ibp_cuda_host_register/unregister).
 * Table create/destroy, which call this, are in ibp_cuda_api.cu.
 */
#include <stdlib.h>
#include <string.h>

#include <map>
#include <mutex>

#include "cuda/ibp_cuda_internal.cuh"

namespace ibpcuda {

namespace {

/* Host ranges this library registered, shared by the tables placed from them. */
struct Registration {
    uint64_t span;
    int refs;
};
std::mutex g_reg_mu;
std::map<const void *, Registration> g_regs;

} /* namespace */

void release_registration(const void *p)
{
    std::lock_guard<std::mutex> lock(g_reg_mu);
    auto it = g_regs.find(p);
    if (it == g_regs.end())
        return;
    if (--it->second.refs == 0) {
        cudaHostUnregister(const_cast<void *>(p));
        cudaGetLastError();
        g_regs.erase(it);
    }
}

namespace {

/* Make the payload readable by the device in place; false: it must be copied. */
bool register_in_place(ibp_cuda_table *t, const uint8_t *p, uint64_t span)
{
    void *dp = nullptr;
    {
        std::lock_guard<std::mutex> lock(g_reg_mu);
        auto it = g_regs.find(p);
        if (it != g_regs.end()) {
            if (it->second.span < span)
                return false;
            it->second.refs++;
            t->registered = const_cast<uint8_t *>(p);
            t->payload_mode = IBP_CUDA_PAYLOAD_REGISTERED;
        } else {
            int ro = 0;
            cudaDeviceGetAttribute(&ro, cudaDevAttrHostRegisterReadOnlySupported, t->device);
            cudaGetLastError();
            unsigned flags = cudaHostRegisterPortable | cudaHostRegisterMapped;
            /* Read-only: also works for a read-only mmap of an .ibp file. */
            cudaError_t e = cudaHostRegister(const_cast<uint8_t *>(p), span,
                                             flags | (ro ? cudaHostRegisterReadOnly : 0u));
            if (e != cudaSuccess && ro && e != cudaErrorHostMemoryAlreadyRegistered) {
                cudaGetLastError();
                e = cudaHostRegister(const_cast<uint8_t *>(p), span, flags);
            }
            if (e == cudaSuccess) {
                g_regs[p] = Registration{span, 1};
                t->registered = const_cast<uint8_t *>(p);
                t->payload_mode = IBP_CUDA_PAYLOAD_REGISTERED;
                t->pinned_bytes = span;
            } else if (e == cudaErrorHostMemoryAlreadyRegistered) {
                cudaGetLastError();
                t->payload_mode = IBP_CUDA_PAYLOAD_SHARED; /* someone else pinned it */
            } else {
                cudaGetLastError();
                return false;
            }
        }
    }
    bool ok = cudaHostGetDevicePointer(&dp, const_cast<uint8_t *>(p), 0) == cudaSuccess;
    if (ok && t->payload_mode == IBP_CUDA_PAYLOAD_SHARED) {
        /* Registered by someone else: the whole span must be in that registration. */
        cudaPointerAttributes attr;
        ok = cudaPointerGetAttributes(&attr, p + span - 1) == cudaSuccess &&
             attr.type == cudaMemoryTypeHost &&
             (const uint8_t *)attr.devicePointer == (const uint8_t *)dp + span - 1;
    }
    if (!ok || (uintptr_t)dp % kChunk) {
        cudaGetLastError();
        if (t->registered)
            release_registration(t->registered);
        t->registered = nullptr;
        t->pinned_bytes = 0;
        t->payload_mode = 0;
        return false;
    }
    t->dev.payload = (const uint8_t *)dp;
    return true;
}

/* Where each part of the metadata block sits (256-byte aligned parts): masks,
 * bitvals, vbits, block_base, rel, the status word; total is the block's size. */
struct MetadataLayout {
    uint64_t km, n_base, n_rel;
    uint64_t o_masks, o_bitvals, o_vbits, o_base, o_rel, o_status, total;
};

MetadataLayout metadata_layout(const ibp_table *h)
{
    auto up = [](uint64_t x) { return (x + 255) / 256 * 256; };
    MetadataLayout l;
    const bool raw = h->cb.n_clusters == 0; /* no index; one cluster of zero masks */
    l.km = (uint64_t)meta_clusters(h->cb.n_clusters) * h->cb.n_words;
    l.n_base = raw ? 0 : (h->n_rows >> 6) + 1;
    l.n_rel = raw ? 0 : h->n_rows + 1;
    l.o_masks = 0;
    l.o_bitvals = up(l.km * 8);
    l.o_vbits = l.o_bitvals + up(l.km * 8);
    l.o_base = l.o_vbits + up(l.km);
    l.o_rel = l.o_base + up(l.n_base * 8);
    l.o_status = l.o_rel + up(l.n_rel * h->rel_bytes);
    l.total = l.o_status + 256;
    return l;
}

} /* namespace */

/* A raw table's payload has no tail pad in host memory, and the kernels over-read
 * rows (granules, words): it is always copied, with a zeroed tail pad. */
int place_payload(ibp_cuda_table *t, const uint8_t *p, int placement)
{
    const uint64_t span = t->payload_span;
    const uint64_t have = t->dev.n_clusters ? span : t->payload_bytes; /* bytes p holds */
    if (placement == IBP_CUDA_PLACE_DEVICE) {
        IBPC_TRY(cudaMalloc(&t->device_copy, span));
        t->device_bytes += span;
        IBPC_TRY(cudaMemset(t->device_copy, 0, span));
        if (have)
            IBPC_TRY(cudaMemcpy(t->device_copy, p, have, cudaMemcpyHostToDevice));
        t->dev.payload = (const uint8_t *)t->device_copy;
        t->payload_mode = IBP_CUDA_PAYLOAD_DEVICE_COPY;
        return IBP_CUDA_OK;
    }
    if (have == span && register_in_place(t, p, span))
        return IBP_CUDA_OK;
    /* Otherwise a pinned, mapped copy (costs host memory, reads the same way). */
    void *dp = nullptr;
    IBPC_TRY(cudaHostAlloc(&t->pinned_copy, span, cudaHostAllocPortable | cudaHostAllocMapped));
    t->pinned_bytes = span;
    memset(t->pinned_copy, 0, span);
    if (have)
        memcpy(t->pinned_copy, p, have);
    IBPC_TRY(cudaHostGetDevicePointer(&dp, t->pinned_copy, 0));
    if ((uintptr_t)dp % kChunk)
        return fail(IBP_CUDA_E_CUDA, "pinned payload copy is not 16-byte aligned");
    t->dev.payload = (const uint8_t *)dp;
    t->payload_mode = IBP_CUDA_PAYLOAD_PINNED_COPY;
    return IBP_CUDA_OK;
}

/* Copy the codebook and offsets index to one device block, vbits derived from the masks. */
int upload_metadata(ibp_cuda_table *t, const ibp_table *h)
{
    const ibp_codebook &cb = h->cb;
    const MetadataLayout l = metadata_layout(h);
    const uint64_t km = l.km, n_base = l.n_base, n_rel = l.n_rel;
    const uint64_t o_masks = l.o_masks, o_bitvals = l.o_bitvals, o_vbits = l.o_vbits;
    const uint64_t o_base = l.o_base, o_rel = l.o_rel, o_status = l.o_status, total = l.total;
    IBPC_TRY(cudaMalloc(&t->metadata, total));
    t->device_bytes += total;
    uint8_t *d = (uint8_t *)t->metadata;
    uint8_t *vbits = (uint8_t *)malloc(km ? km : 1);
    if (!vbits)
        return fail(IBP_CUDA_E_NOMEM, "no host memory for %llu vbits", (unsigned long long)km);
    const bool raw = cb.n_clusters == 0;
    for (uint64_t i = 0; i < km; i++)
        vbits[i] = raw ? (uint8_t)cb.word_bits
                       : (uint8_t)(cb.word_bits - ibp_popcount64(cb.masks[i] & ibp_low_bits(cb.word_bits)));
    cudaError_t e = cudaMemcpy(d + o_vbits, vbits, km, cudaMemcpyHostToDevice);
    free(vbits);
    IBPC_TRY(e);
    if (raw) { /* zero masks and bitvals; no index */
        IBPC_TRY(cudaMemset(d + o_masks, 0, km * 8));
        IBPC_TRY(cudaMemset(d + o_bitvals, 0, km * 8));
    } else {
        IBPC_TRY(cudaMemcpy(d + o_masks, cb.masks, km * 8, cudaMemcpyHostToDevice));
        IBPC_TRY(cudaMemcpy(d + o_bitvals, cb.bitvals, km * 8, cudaMemcpyHostToDevice));
        IBPC_TRY(cudaMemcpy(d + o_base, h->block_base, n_base * 8, cudaMemcpyHostToDevice));
        IBPC_TRY(cudaMemcpy(d + o_rel, h->rel, n_rel * h->rel_bytes, cudaMemcpyHostToDevice));
    }
    IBPC_TRY(cudaMemset(d + o_status, 0, sizeof(int)));
    t->dev.masks = (const uint64_t *)(void *)(d + o_masks);
    t->dev.bitvals = (const uint64_t *)(void *)(d + o_bitvals);
    t->dev.vbits = d + o_vbits;
    t->dev.block_base = (const uint64_t *)(void *)(d + o_base);
    t->dev.rel = d + o_rel;
    t->dev.status = (int *)(void *)(d + o_status);
    return IBP_CUDA_OK;
}

} /* namespace ibpcuda */

using namespace ibpcuda;

extern "C" int ibp_cuda_table_device_bytes(const ibp_table *table, int placement, uint64_t *bytes)
{
    if (!table || !bytes || (placement != IBP_CUDA_PLACE_HOST && placement != IBP_CUDA_PLACE_DEVICE))
        return fail(IBP_CUDA_E_ARG, "ibp_cuda_table_device_bytes: bad arguments");
    *bytes = metadata_layout(table).total;
    if (placement == IBP_CUDA_PLACE_DEVICE)
        *bytes += table->payload_bytes + ibp_tail_pad_bytes(table->cb.row_bytes, table->cb.word_bits);
    return IBP_CUDA_OK;
}

extern "C" int ibp_cuda_host_register(void *ptr, uint64_t bytes, void **device_ptr)
{
    if (!ptr || !bytes || !device_ptr)
        return fail(IBP_CUDA_E_ARG, "host_register: null pointer or empty range");
    int n, rc = ibp_cuda_device_count(&n);
    if (rc)
        return rc;
    IBPC_TRY(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
    cudaError_t e = cudaHostGetDevicePointer(device_ptr, ptr, 0);
    if (e != cudaSuccess) {
        cudaHostUnregister(ptr);
        return cuda_fail(e, "cudaHostGetDevicePointer", __FILE__, __LINE__);
    }
    return IBP_CUDA_OK;
}

extern "C" int ibp_cuda_host_unregister(void *ptr)
{
    if (!ptr)
        return fail(IBP_CUDA_E_ARG, "host_unregister: null pointer");
    IBPC_TRY(cudaHostUnregister(ptr));
    return IBP_CUDA_OK;
}
