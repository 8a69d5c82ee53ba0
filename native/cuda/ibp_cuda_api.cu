/* ibp_cuda_api.cu - the C API of libibp_cuda: errors, devices, table create and
 * destroy, launch geometry, gathers and lookups. Placing a table's metadata and
 * payload (and host-memory registration) is in placement.cu; the kernels are in
 * decode.cu and lookup.cu.
 *
 * Every CUDA runtime call is checked; a failure becomes an IBP_CUDA_E_* code and
 * a message naming the call (ibp_cuda_last_error, per thread).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/ibp_cuda_internal.cuh"

namespace ibpcuda {

namespace {

thread_local char g_message[1024];

/* Shared memory the row kernels aim to stay under (so several blocks fit an SM);
 * larger rows get fewer warps per block, then all the device allows. */
constexpr uint64_t kSmemTarget = 64 * 1024;
/* The codebook is staged in shared memory only when it is this small. */
constexpr uint64_t kMetaSmemMax = 32 * 1024;

bool is_no_device(cudaError_t e)
{
    return e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
           e == cudaErrorStubLibrary || e == cudaErrorDevicesUnavailable ||
           e == cudaErrorSystemDriverMismatch || e == cudaErrorCompatNotSupportedOnDevice ||
           e == cudaErrorSystemNotReady || e == cudaErrorInvalidDevice;
}

/* Makes a device current for a scope and restores the caller's afterwards. */
struct DeviceGuard {
    int prev = -1, dev, rc = IBP_CUDA_OK;
    explicit DeviceGuard(int d) : dev(d)
    {
        cudaError_t e = cudaGetDevice(&prev);
        if (e != cudaSuccess) {
            prev = -1;
            rc = cuda_fail(e, "cudaGetDevice", __FILE__, __LINE__);
            return;
        }
        if (prev != dev) {
            e = cudaSetDevice(dev);
            if (e != cudaSuccess)
                rc = cuda_fail(e, "cudaSetDevice", __FILE__, __LINE__);
        }
    }
    ~DeviceGuard()
    {
        if (prev >= 0 && prev != dev)
            cudaSetDevice(prev);
    }
};

bool env_flag_off(const char *name)
{
    const char *v = getenv(name);
    return v && (!strcmp(v, "0") || !strcmp(v, "off") || !strcmp(v, "no"));
}

/* Geometry of a row kernel whose warps each need two stage buffers and `extra`
 * shared bytes. warps == 0 when staging does not fit and direct reads are not allowed. */
Geometry pick_geometry(const ibp_cuda_table *t, uint64_t extra, bool allow_direct)
{
    const DevTable &d = t->dev;
    Geometry g = {};
    const uint64_t stage = stage_bytes_for(d.n_words, d.word_bits);
    const uint32_t k = meta_clusters(d.n_clusters);
    uint64_t meta = (uint64_t)k * d.n_words <= kMetaSmemMax ? meta_bytes_for(k, d.n_words) : kMetaSmemMax + 1;
    if (meta > kMetaSmemMax)
        meta = 0;
    const uint64_t per_warp = 2 * stage + extra, optin = (uint64_t)t->smem_optin;
    const bool staging = !env_flag_off("IBP_CUDA_STAGED");
    g.stage_bytes = (uint32_t)stage;
    if (staging) {
        for (uint32_t w = 8; w >= 1; w /= 2) {
            if (meta + w * per_warp <= kSmemTarget) {
                g.warps = w;
                break;
            }
        }
        if (!g.warps && meta + per_warp <= optin)
            g.warps = 1;
        if (!g.warps && per_warp <= optin) {
            meta = 0;
            g.warps = 1;
        }
        if (g.warps) {
            g.staged = 1;
            g.meta_bytes = (uint32_t)meta;
            g.warp_bytes = (uint32_t)per_warp;
            g.smem_bytes = (uint32_t)(meta + g.warps * per_warp);
            return g;
        }
    }
    if (!allow_direct)
        return g;
    /* Rows too large to stage: lanes read their fields straight from the payload. */
    g.warps = 8;
    g.staged = 0;
    g.meta_bytes = (uint32_t)meta;
    g.warp_bytes = 0;
    g.smem_bytes = (uint32_t)meta;
    return g;
}

int check_table(const ibp_cuda_table *t)
{
    return t ? IBP_CUDA_OK : fail(IBP_CUDA_E_ARG, "null CUDA table");
}

} /* namespace */

int fail(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_message, sizeof g_message, fmt, ap);
    va_end(ap);
    return code;
}

int cuda_fail(cudaError_t e, const char *what, const char *file, int line)
{
    cudaGetLastError(); /* clear it, unless it is sticky */
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    if (e == cudaErrorMemoryAllocation)
        return fail(IBP_CUDA_E_NOMEM, "out of memory: %s (%s:%d): %s", what, base, line,
                    cudaGetErrorString(e));
    if (is_no_device(e))
        return fail(IBP_CUDA_E_NO_DEVICE, "no CUDA device: %s (%s:%d) failed with %s: %s", what,
                    base, line, cudaGetErrorName(e), cudaGetErrorString(e));
    return fail(IBP_CUDA_E_CUDA, "CUDA error in %s (%s:%d): %s: %s", what, base, line,
                cudaGetErrorName(e), cudaGetErrorString(e));
}

int status_error(int status)
{
    if (status & kStatusOffsets)
        return fail(IBP_CUDA_E_OFFSETS, "lookup offsets are out of order or out of range "
                    "(they must rise from 0 to the number of indices)");
    if (status & kStatusIndex)
        return fail(IBP_CUDA_E_INDEX, "row index out of range");
    if (status & kStatusCorrupt)
        return fail(IBP_CUDA_E_CORRUPT, "compressed data is inconsistent");
    return IBP_CUDA_OK;
}

Geometry fused_geometry(const ibp_cuda_table *t, uint32_t dim)
{
    const uint64_t row = round_up(t->dev.n_words * (t->dev.word_bits / 8), kChunk);
    return pick_geometry(t, row + round_up(4 * dim, kChunk), false);
}

int grid_blocks(const ibp_cuda_table *t, const void *kernel, uint32_t threads, uint32_t smem,
                uint64_t n_items, uint32_t items_per_block, int *blocks)
{
    int per_sm = 0;
    IBPC_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, (int)threads, smem));
    if (per_sm < 1)
        return fail(IBP_CUDA_E_CUDA, "a block of %u threads with %u bytes of shared memory does "
                    "not fit on device %d", threads, smem, t->device);
    uint64_t want = (n_items + items_per_block - 1) / items_per_block;
    uint64_t cap = (uint64_t)per_sm * (uint64_t)t->sm_count;
    *blocks = (int)(want < 1 ? 1 : want < cap ? want : cap);
    return IBP_CUDA_OK;
}

} /* namespace ibpcuda */

using namespace ibpcuda;

extern "C" {

int ibp_cuda_abi_version(void) { return IBP_CUDA_ABI_VERSION; }
int ibp_cuda_format_version(void) { return IBP_FORMAT_VERSION; }
const char *ibp_cuda_last_error(void) { return g_message; }

const char *ibp_cuda_error_string(int code)
{
    switch (code) {
    case IBP_CUDA_OK: return "ok";
    case IBP_CUDA_E_ARG: return "invalid argument";
    case IBP_CUDA_E_INDEX: return "row index out of range";
    case IBP_CUDA_E_CORRUPT: return "compressed data is inconsistent";
    case IBP_CUDA_E_NOMEM: return "out of memory";
    case IBP_CUDA_E_NO_DEVICE: return "no CUDA device";
    case IBP_CUDA_E_CUDA: return "CUDA error";
    case IBP_CUDA_E_UNSUPPORTED: return "device not supported (needs compute capability 8.0+)";
    case IBP_CUDA_E_OFFSETS: return "lookup offsets out of order or out of range";
    default: return "unknown error";
    }
}

int ibp_cuda_device_count(int *count)
{
    if (count)
        *count = 0;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return fail(IBP_CUDA_E_NO_DEVICE, "no CUDA device: cudaGetDeviceCount failed with %s: %s",
                    cudaGetErrorName(e), cudaGetErrorString(e));
    }
    if (n < 1)
        return fail(IBP_CUDA_E_NO_DEVICE, "no CUDA device: the CUDA runtime found none");
    if (count)
        *count = n;
    return IBP_CUDA_OK;
}

int ibp_cuda_device_info(int device, char *name_buf, size_t name_len, int *major, int *minor)
{
    int n, rc = ibp_cuda_device_count(&n);
    if (rc)
        return rc;
    if (device < 0 || device >= n)
        return fail(IBP_CUDA_E_ARG, "device %d out of range (%d devices)", device, n);
    cudaDeviceProp prop;
    IBPC_TRY(cudaGetDeviceProperties(&prop, device));
    if (name_buf && name_len) {
        strncpy(name_buf, prop.name, name_len - 1);
        name_buf[name_len - 1] = 0;
    }
    if (major)
        *major = prop.major;
    if (minor)
        *minor = prop.minor;
    return IBP_CUDA_OK;
}

int ibp_cuda_table_create(const ibp_table *h, int device, int placement, ibp_cuda_table **out)
{
    if (!out)
        return fail(IBP_CUDA_E_ARG, "table_create: null output");
    *out = nullptr;
    if (!h || (h->cb.n_clusters && (!h->cb.masks || !h->cb.bitvals || !h->block_base || !h->rel)) ||
        (h->payload_bytes && !h->payload))
        return fail(IBP_CUDA_E_ARG, "table_create: null table pointer");
    if (h->block_len)
        return fail(IBP_CUDA_E_ARG, "table_create: an updatable (store-mode) table cannot be "
                    "placed on a device; place a packed, immutable table");
    const ibp_codebook &cb = h->cb;
    if (cb.word_bits != 16 && cb.word_bits != 32 && cb.word_bits != 64)
        return fail(IBP_CUDA_E_ARG, "table_create: word size %u (16, 32 or 64)", cb.word_bits);
    if (!cb.row_bytes || cb.n_words != (cb.row_bytes + cb.word_bits / 8 - 1) / (cb.word_bits / 8))
        return fail(IBP_CUDA_E_ARG, "table_create: %u words do not fit rows of %u bytes",
                    cb.n_words, cb.row_bytes);
    if (cb.n_clusters > 256)
        return fail(IBP_CUDA_E_ARG, "table_create: %u clusters (1 to 256, or 0: raw)", cb.n_clusters);
    if (cb.n_clusters == 0 && h->payload_bytes != h->n_rows * cb.row_bytes)
        return fail(IBP_CUDA_E_ARG, "table_create: a raw table of %llu rows with %llu payload bytes",
                    (unsigned long long)h->n_rows, (unsigned long long)h->payload_bytes);
    if (cb.n_clusters && h->rel_bytes != 2 && h->rel_bytes != 4)
        return fail(IBP_CUDA_E_ARG, "table_create: rel entries of %u bytes", h->rel_bytes);
    if (h->n_rows > 0xfffffffeull)
        return fail(IBP_CUDA_E_ARG, "table_create: %llu rows; the CUDA path takes at most 2^32 - 2",
                    (unsigned long long)h->n_rows);
    if (placement != IBP_CUDA_PLACE_HOST && placement != IBP_CUDA_PLACE_DEVICE)
        return fail(IBP_CUDA_E_ARG, "table_create: placement %d", placement);
    int n_dev, rc = ibp_cuda_device_count(&n_dev);
    if (rc)
        return rc;
    if (device < 0 || device >= n_dev)
        return fail(IBP_CUDA_E_ARG, "table_create: device %d out of range (%d devices)", device, n_dev);
    int major = 0;
    IBPC_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    if (major < 8) {
        int minor = 0;
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
        cudaGetLastError();
        return fail(IBP_CUDA_E_UNSUPPORTED, "device %d has compute capability %d.%d; the IBP "
                    "kernels need 8.0 or newer (cp.async)", device, major, minor);
    }
    DeviceGuard guard(device);
    if (guard.rc)
        return guard.rc;

    ibp_cuda_table *t = (ibp_cuda_table *)calloc(1, sizeof *t);
    if (!t)
        return fail(IBP_CUDA_E_NOMEM, "table_create: no host memory");
    t->device = device;
    t->placement = placement;
    t->dev.n_rows = h->n_rows;
    t->dev.row_bytes = cb.row_bytes;
    t->dev.word_bits = cb.word_bits;
    t->dev.n_words = cb.n_words;
    t->dev.n_clusters = cb.n_clusters;
    t->dev.rel_bytes = h->rel_bytes;
    t->payload_bytes = h->payload_bytes;
    t->payload_span = h->payload_bytes + ibp_tail_pad_bytes(cb.row_bytes, cb.word_bits);
    rc = IBP_CUDA_OK;
    cudaError_t e = cudaDeviceGetAttribute(&t->sm_count, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&t->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (e != cudaSuccess)
        rc = cuda_fail(e, "cudaDeviceGetAttribute", __FILE__, __LINE__);
    if (!rc) {
        e = cudaHostAlloc((void **)&t->host_status, sizeof(int), cudaHostAllocPortable);
        if (e != cudaSuccess)
            rc = cuda_fail(e, "cudaHostAlloc(status)", __FILE__, __LINE__);
    }
    if (!rc)
        rc = upload_metadata(t, h);
    if (!rc)
        rc = place_payload(t, h->payload, placement);
    if (!rc) {
        t->gather = pick_geometry(t, 0, true);
        *out = t;
        return IBP_CUDA_OK;
    }
    char saved[sizeof g_message];
    memcpy(saved, g_message, sizeof saved);
    ibp_cuda_table_destroy(t);
    memcpy(g_message, saved, sizeof saved);
    return rc;
}

int ibp_cuda_table_destroy(ibp_cuda_table *t)
{
    if (!t)
        return IBP_CUDA_OK;
    DeviceGuard guard(t->device);
    /* Kernels reading the payload may still be queued: let the device finish. */
    cudaError_t first = cudaDeviceSynchronize();
    if (t->registered)
        release_registration(t->registered);
    cudaError_t e;
    if (t->pinned_copy && (e = cudaFreeHost(t->pinned_copy)) != cudaSuccess && first == cudaSuccess)
        first = e;
    if (t->device_copy && (e = cudaFree(t->device_copy)) != cudaSuccess && first == cudaSuccess)
        first = e;
    if (t->metadata && (e = cudaFree(t->metadata)) != cudaSuccess && first == cudaSuccess)
        first = e;
    if (t->host_status && (e = cudaFreeHost(t->host_status)) != cudaSuccess && first == cudaSuccess)
        first = e;
    free(t);
    return first == cudaSuccess ? IBP_CUDA_OK
                                : cuda_fail(first, "releasing a CUDA table", __FILE__, __LINE__);
}

int ibp_cuda_table_info(const ibp_cuda_table *t, ibp_cuda_info *info)
{
    int rc = check_table(t);
    if (rc)
        return rc;
    if (!info)
        return fail(IBP_CUDA_E_ARG, "table_info: null output");
    memset(info, 0, sizeof *info);
    info->device = t->device;
    info->placement = t->placement;
    info->payload_mode = t->payload_mode;
    info->metadata_in_shared = t->gather.meta_bytes != 0;
    info->staged = (int)t->gather.staged;
    info->warps_per_block = t->gather.warps;
    info->shared_bytes = t->gather.smem_bytes;
    info->stage_bytes = t->gather.stage_bytes;
    info->device_bytes = t->device_bytes;
    info->pinned_bytes = t->pinned_bytes;
    info->payload_device_ptr = t->dev.payload;
    return IBP_CUDA_OK;
}

int ibp_cuda_check(ibp_cuda_table *t, void *stream)
{
    int rc = check_table(t);
    if (rc)
        return rc;
    DeviceGuard guard(t->device);
    if (guard.rc)
        return guard.rc;
    cudaStream_t s = (cudaStream_t)stream;
    IBPC_TRY(cudaMemcpyAsync(t->host_status, t->dev.status, sizeof(int), cudaMemcpyDeviceToHost, s));
    IBPC_TRY(cudaStreamSynchronize(s));
    const int status = *t->host_status;
    if (status)
        IBPC_TRY(cudaMemsetAsync(t->dev.status, 0, sizeof(int), s));
    return status_error(status);
}

int ibp_cuda_gather(ibp_cuda_table *t, const int64_t *indices, uint64_t n, void *out, void *stream,
                    int flags)
{
    int rc = check_table(t);
    if (rc)
        return rc;
    if (n && (!indices || !out))
        return fail(IBP_CUDA_E_ARG, "gather: null indices or output");
    DeviceGuard guard(t->device);
    if (guard.rc)
        return guard.rc;
    rc = launch_gather(t, indices, nullptr, nullptr, n, (uint8_t *)out, (cudaStream_t)stream);
    if (!rc && (flags & IBP_CUDA_CHECK))
        rc = ibp_cuda_check(t, stream);
    return rc;
}

int ibp_cuda_lookup_workspace(const ibp_cuda_table *t, uint64_t n_indices, int flags, uint64_t *bytes)
{
    int rc = check_table(t);
    if (rc)
        return rc;
    if (!bytes)
        return fail(IBP_CUDA_E_ARG, "lookup_workspace: null output");
    *bytes = 0;
    if (n_indices >= (1ull << 31))
        return fail(IBP_CUDA_E_ARG, "lookup: %llu indices; at most 2^31 - 1 per call",
                    (unsigned long long)n_indices);
    /* Without dedup the fused kernel needs none, if it fits for the widest rows (2-byte elements). */
    if (!(flags & IBP_CUDA_DEDUP) && fused_geometry(t, t->dev.row_bytes / 2).warps)
        return IBP_CUDA_OK;
    DeviceGuard guard(t->device);
    if (guard.rc)
        return guard.rc;
    return dedup_workspace_bytes(t, n_indices, bytes);
}

int ibp_cuda_lookup(ibp_cuda_table *t, int dtype, uint32_t dim, const int64_t *indices,
                    uint64_t n_indices, const int64_t *offsets, uint64_t n_bags,
                    const float *weights, int mode, float *out, void *workspace,
                    uint64_t workspace_bytes, void *stream, int flags)
{
    int rc = check_table(t);
    if (rc)
        return rc;
    if (dtype != IBP_DTYPE_F32 && dtype != IBP_DTYPE_F16 && dtype != IBP_DTYPE_BF16)
        return fail(IBP_CUDA_E_ARG, "lookup: element type %d (F32, F16 or BF16)", dtype);
    if ((uint64_t)dim * (dtype == IBP_DTYPE_F32 ? 4 : 2) != t->dev.row_bytes)
        return fail(IBP_CUDA_E_ARG, "lookup: %u elements of that type are not rows of %u bytes",
                    dim, t->dev.row_bytes);
    if (mode != IBP_POOL_SUM && mode != IBP_POOL_MEAN)
        return fail(IBP_CUDA_E_ARG, "lookup: pooling mode %d", mode);
    if (n_indices >= (1ull << 31))
        return fail(IBP_CUDA_E_ARG, "lookup: %llu indices; at most 2^31 - 1 per call",
                    (unsigned long long)n_indices);
    if ((n_bags && (!offsets || !out)) || (n_indices && !indices))
        return fail(IBP_CUDA_E_ARG, "lookup: null pointer");
    if (!n_bags)
        return IBP_CUDA_OK;
    DeviceGuard guard(t->device);
    if (guard.rc)
        return guard.rc;
    cudaStream_t s = (cudaStream_t)stream;
    Geometry g = {};
    if (!(flags & IBP_CUDA_DEDUP))
        g = fused_geometry(t, dim);
    if (g.warps)
        rc = launch_lookup_fused(t, g, dtype, dim, indices, n_indices, offsets, n_bags, weights,
                                 mode, out, s);
    else
        rc = launch_lookup_dedup(t, dtype, dim, indices, n_indices, offsets, n_bags, weights, mode,
                                 out, workspace, workspace_bytes, s);
    if (!rc && (flags & IBP_CUDA_CHECK))
        rc = ibp_cuda_check(t, stream);
    return rc;
}

} /* extern "C" */
