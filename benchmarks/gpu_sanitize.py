#!/usr/bin/env python3
"""A small case for compute-sanitizer (memcheck, racecheck): benchmarks/gpu_check.sh runs
`compute-sanitizer --tool memcheck python3 benchmarks/gpu_sanitize.py`.

Every kernel of libibp_cuda runs once or more on tiny inputs: the row decode
(gathers, staged and direct), the dedup lookup (keys, CUB sort and scan, heads,
scatter, decode, pool) and the fused lookup, for every word size and element
type, payloads pinned in host memory and in device memory, tables whose rows
are stored raw and encoded, several clusters; the raw-row kernel over a table
whose end is not on a 16-byte boundary; and the kernels' error paths. Results
are checked against libibp. No torch CUDA: inputs and outputs live in pinned,
mapped host memory (ibp_cuda_host_register), so the sanitizers see the
library's kernels and CUB's only. Exits 0 when every result matched; prints
"no CUDA device" and exits 0 (--allow-no-device) or 2 without a GPU.
--emulate runs the same driver on the CPU, each library call replaced by its
host emulation (ibp_cuda_emulate_*): a check of the driver itself.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ibp_embed  # noqa: E402
from ibp_embed import cuda  # noqa: E402
from ibp_embed.dtypes import LOOKUP_DTYPES  # noqa: E402

ffi = cuda.ffi
_pinned = []


class _EmulatedLib:
    """libibp_cuda's calls used here, done by the host emulation (device pointers are
    host pointers; a table handle is its ibp_table)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):  # constants, ibp_cuda_last_error, ...
        return getattr(self._real, name)

    def ibp_cuda_device_count(self, n):
        n[0] = 1
        return 0

    def ibp_cuda_host_register(self, ptr, nbytes, dptr):
        dptr[0] = ptr
        return 0

    def ibp_cuda_host_unregister(self, ptr):
        return 0

    def ibp_cuda_table_create(self, c, device, placement, out):
        self._staged = os.environ.get("IBP_CUDA_STAGED", "1") != "0"
        out[0] = ffi.cast("ibp_cuda_table *", c)
        return 0

    def ibp_cuda_table_info(self, t, info):
        info.staged = int(self._staged)
        return 0

    def ibp_cuda_table_destroy(self, t):
        return 0

    def ibp_cuda_check(self, t, stream):
        return 0

    def ibp_cuda_gather(self, t, idx, n, out, stream, flags):
        return self._real.ibp_cuda_emulate_gather(ffi.cast("ibp_table *", t), idx, n,
                                                  ffi.cast("uint8_t *", out))

    def ibp_cuda_lookup(self, t, dtype, dim, idx, n, off, n_bags, w, mode, out, ws, ws_bytes, stream,
                        flags):
        return self._real.ibp_cuda_emulate_lookup(ffi.cast("ibp_table *", t), dtype, dim, idx, n, off,
                                                  n_bags, w, mode, out,
                                                  int(bool(flags & self._real.IBP_CUDA_DEDUP)))

    def ibp_cuda_raw_lookup(self, rows, n_rows, dtype, dim, idx, n, off, n_bags, w, mode, out, status,
                            stream, flags):
        return self._real.ibp_cuda_emulate_raw_lookup(rows, n_rows, dtype, dim, idx, n, off, n_bags, w,
                                                      mode, out)


lib = _EmulatedLib(cuda.load_library()) if "--emulate" in sys.argv else cuda.load_library()


PAGE = 4096


def mapped(a: np.ndarray):
    """A copy of numpy array a in pages of its own (registrations must not share a
    page), pinned and mapped, exactly a.nbytes registered; (host view, device pointer)."""
    a = np.ascontiguousarray(a)
    if a.nbytes == 0:
        return a, ffi.NULL
    buf = np.zeros(-(-a.nbytes // PAGE) * PAGE + PAGE, np.uint8)
    start = -buf.ctypes.data % PAGE
    h = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    h[...] = a
    dptr = ffi.new("void **")
    cuda.check(lib.ibp_cuda_host_register(ffi.cast("void *", h.ctypes.data), a.nbytes, dptr),
               "host_register", lib)
    _pinned.append(h)
    return h, dptr[0]


def release() -> None:
    while _pinned:
        a = _pinned.pop()
        lib.ibp_cuda_host_unregister(ffi.cast("void *", a.ctypes.data))


def table(dtype, n, dim, word_bits, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, dim, generator=g) * 0.01
    w[n // 2:] *= 3000  # a second population: several clusters
    w[::7] = (torch.rand(len(range(0, n, 7)), dim, generator=g) - 0.5) * 1e3  # raw rows
    w = w.to(dtype)
    return w, ibp_embed.compress(w, word_bits=word_bits, clusters=4, progress=False)


def batch(n_rows, n_ids, n_bags, seed):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_rows, n_ids).astype(np.int64)
    idx[: n_ids // 4] = idx[n_ids // 4: n_ids // 2]
    idx[-1] = n_rows - 1
    off = np.sort(rng.integers(0, n_ids + 1, n_bags + 1)).astype(np.int64)
    off[0], off[-1] = 0, n_ids
    off[n_bags // 2: n_bags // 2 + 3] = off[n_bags // 2]  # empty bags
    return idx, off, rng.standard_normal(n_ids).astype(np.float32)


def expect(rc, what, code=0):
    if rc != code:
        raise SystemExit(f"FAILED: {what}: rc {rc} ({ffi.string(lib.ibp_cuda_last_error()).decode()})")


def run_case(dtype, dim, word_bits, placement, seed, staged=True):
    n = 130
    w, t = table(dtype, n, dim, word_bits, seed)
    R = dim * w.element_size()
    out_t = ffi.new("ibp_cuda_table **")
    if not staged:  # lanes read the payload directly (the geometry is chosen at placement)
        os.environ["IBP_CUDA_STAGED"] = "0"
    try:
        expect(lib.ibp_cuda_table_create(t._c, 0, cuda.PLACEMENTS[placement], out_t), "table_create")
    finally:
        os.environ.pop("IBP_CUDA_STAGED", None)
    ct = out_t[0]
    info = ffi.new("ibp_cuda_info *")
    expect(lib.ibp_cuda_table_info(ct, info), "table_info")
    assert bool(info.staged) == staged, (info.staged, staged)
    try:
        idx, off, wts = batch(n, 300, 40, seed)
        idx_h, idx_d = mapped(idx)
        off_h, off_d = mapped(off)
        wts_h, wts_d = mapped(wts)
        rows_h, rows_d = mapped(np.zeros((idx.size, R), np.uint8))
        expect(lib.ibp_cuda_gather(ct, ffi.cast("const int64_t *", idx_d), idx.size,
                                   ffi.cast("void *", rows_d), ffi.NULL, lib.IBP_CUDA_CHECK), "gather")
        if not np.array_equal(rows_h, t.gather(idx).contiguous().view(torch.uint8).numpy()):
            raise SystemExit(f"FAILED: gather {dtype} {placement} differs from libibp")
        for dedup in (True, False):
            for weights in (None, wts_d):
                out_h, out_d = mapped(np.zeros((off.size - 1, dim), np.float32))
                flags = lib.IBP_CUDA_CHECK | (lib.IBP_CUDA_DEDUP if dedup else 0)
                expect(lib.ibp_cuda_lookup(ct, LOOKUP_DTYPES[dtype], dim,
                                           ffi.cast("const int64_t *", idx_d), idx.size,
                                           ffi.cast("const int64_t *", off_d), off.size - 1,
                                           ffi.cast("const float *", weights) if weights else ffi.NULL,
                                           0, ffi.cast("float *", out_d), ffi.NULL, 0, ffi.NULL, flags),
                       f"lookup dedup={dedup}")
                ref = t.lookup(idx, off, None if weights is None else wts).numpy()
                if not np.array_equal(out_h, ref):
                    raise SystemExit(f"FAILED: lookup {dtype} {placement} dedup={dedup} "
                                     f"weighted={weights is not None}: max error {np.abs(out_h - ref).max()}")
        # the kernels' error path: an id out of range, reported and cleared
        bad_h, bad_d = mapped(np.array([0, n], np.int64))
        two_h, two_d = mapped(np.array([0, 2], np.int64))
        o_h, o_d = mapped(np.zeros((1, dim), np.float32))
        for dedup in (True, False):
            rc = lib.ibp_cuda_lookup(ct, LOOKUP_DTYPES[dtype], dim, ffi.cast("const int64_t *", bad_d), 2,
                                     ffi.cast("const int64_t *", two_d), 1, ffi.NULL, 0,
                                     ffi.cast("float *", o_d), ffi.NULL, 0, ffi.NULL,
                                     lib.IBP_CUDA_CHECK | (lib.IBP_CUDA_DEDUP if dedup else 0))
            expect(rc, "out-of-range id", lib.IBP_CUDA_E_INDEX)
        expect(lib.ibp_cuda_check(ct, ffi.NULL), "check after an error")
    finally:
        expect(lib.ibp_cuda_table_destroy(ct), "table_destroy")
        release()


def run_raw(dtype, dim, seed):
    n = 101  # fp16 x 41: 8282 bytes, the last granule partly past the table
    w, t = table(dtype, n, dim, 64, seed)
    rows = w.contiguous().view(torch.uint8).numpy().reshape(n, -1)
    # exactly the raw rows registered: a read past their end is outside the mapping
    rows_h, rows_d = mapped(rows)
    idx, off, wts = batch(n, 300, 40, seed)
    idx_h, idx_d = mapped(idx)
    off_h, off_d = mapped(off)
    wts_h, wts_d = mapped(wts)
    try:
        for weights in (None, wts_d):
            out_h, out_d = mapped(np.zeros((off.size - 1, dim), np.float32))
            expect(lib.ibp_cuda_raw_lookup(rows_d, n, LOOKUP_DTYPES[dtype], dim,
                                           ffi.cast("const int64_t *", idx_d), idx.size,
                                           ffi.cast("const int64_t *", off_d), off.size - 1,
                                           ffi.cast("const float *", weights) if weights else ffi.NULL,
                                           0, ffi.cast("float *", out_d), ffi.NULL, ffi.NULL,
                                           lib.IBP_CUDA_CHECK), "raw_lookup")
            ref = t.lookup(idx, off, None if weights is None else wts).numpy()
            if not np.array_equal(out_h, ref):
                raise SystemExit(f"FAILED: raw lookup {dtype}: max error {np.abs(out_h - ref).max()}")
    finally:
        release()


def main(argv) -> int:
    n = ffi.new("int *")
    if lib.ibp_cuda_device_count(n) != 0:
        print(f"no CUDA device ({ffi.string(lib.ibp_cuda_last_error()).decode()}): nothing to sanitize")
        return 0 if "--allow-no-device" in argv else 2
    cases = [(torch.float32, 40, 32), (torch.float16, 41, 64), (torch.bfloat16, 16, 16)]
    for i, (dtype, dim, wb) in enumerate(cases):
        for placement in ("host", "device"):
            run_case(dtype, dim, wb, placement, i)
        if i == 0:
            run_case(dtype, dim, wb, "host", i, staged=False)
        run_raw(dtype, dim, i)
        print(f"sanitizer driver: {dtype} dim {dim} W={wb} ok", flush=True)
    print("sanitizer driver: every result matched libibp")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
