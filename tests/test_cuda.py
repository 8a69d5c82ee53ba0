"""The CUDA path (native/cuda, ibp_embed.cuda).

Without a GPU: the CUDA sources compile warning-free with the Makefile's nvcc
flags, ptxas reports no local-memory spills in the kernels, the library loads
and reports "no CUDA device", and the kernels' code run on the host
(ibp_cuda_emulate_*: the kernels' own per-warp loops over an emulated grid, the
per-lane decoding lane by lane, the same pooling arithmetic) matches libibp bit
for bit, gathers and lookups (weighted ones too: both use fma), also with many
rows and bags per warp; the raw-row baseline kernel's emulation matches libibp
and torch; the GPU benchmark runs its reduced --emulate mode, the sanitizer
driver of benchmarks/gpu_check.sh runs through the emulation, the script parses,
and `make WERROR=` drops -Werror (for the GPU machine's compilers).
With a GPU (marked `gpu`): CudaTable against the CPU path, bit for bit for
gathers and within 1e-6 relative for pooling (bit for bit in the large test,
whose batches give every warp of every kernel several rows and bags), the raw
kernel, and the row cache on the device.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ibp_embed
from ibp_embed import cuda
from ibp_embed.errors import FormatError

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmarks.gpu_lookup: the raw kernel's Python wrappers
CUDA_DIR = ROOT / "native" / "cuda"
DEFAULT_LIB = ROOT / "native" / "build" / "libibp_cuda.so"
NVCC = shutil.which("nvcc")
# Kernels whose spill counts must be zero (all of ours; CUB's are not checked).
HOT_KERNELS = ("ibp_gather_rows_kernel", "ibp_lookup_fused_kernel", "ibp_pool_kernel",
               "ibp_dedup_keys_kernel", "ibp_dedup_heads_kernel", "ibp_dedup_scatter_kernel",
               "ibp_raw_lookup_kernel")
ARCHS = ("sm_80", "sm_90")


def _makefile_nvccflags() -> list[str]:
    """NVCCFLAGS as the Makefile sets them, so the test builds what `make cuda` builds."""
    text = (ROOT / "Makefile").read_text()
    m = re.search(r"^NVCCFLAGS\s*:=\s*((?:[^\n]*\\\n)*[^\n]*)", text, re.M)
    assert m, "the Makefile has no NVCCFLAGS"
    return m.group(1).replace("\\\n", " ").split()


@dataclass
class Build:
    returncode: int
    log: str
    path: Path
    seconds: float


@pytest.fixture(scope="session")
def cuda_build(tmp_path_factory) -> Build:
    """One nvcc build of all native/cuda/*.cu with -Xptxas -v, shared by the tests."""
    if not NVCC:
        pytest.skip("nvcc is not on PATH: the CUDA sources cannot be compiled here")
    sources = sorted(str(p) for p in CUDA_DIR.glob("*.cu"))
    assert sources, "no CUDA sources in native/cuda"
    out = tmp_path_factory.mktemp("cuda") / "libibp_cuda.so"
    cmd = [NVCC, *_makefile_nvccflags(), "-Xptxas", "-v", f"-I{ROOT / 'native'}", *sources,
           "-o", str(out)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    return Build(proc.returncode, proc.stdout + proc.stderr, out, time.time() - t0)


def _fresh(lib: Path) -> bool:
    if not lib.exists():
        return False
    newest = max(p.stat().st_mtime for p in [*CUDA_DIR.iterdir(), ROOT / "native" / "ibp_bits.h",
                                             ROOT / "native" / "ibp.h"])
    return lib.stat().st_mtime >= newest


@pytest.fixture(scope="session")
def cuda_lib(request):
    """libibp_cuda loaded: $IBP_CUDA_LIBRARY, an up-to-date `make cuda` build, or the test build."""
    if os.environ.get("IBP_CUDA_LIBRARY"):
        path = Path(os.environ["IBP_CUDA_LIBRARY"])
    elif _fresh(DEFAULT_LIB):
        path = DEFAULT_LIB
    else:
        build = request.getfixturevalue("cuda_build")
        if build.returncode:
            pytest.fail(f"the CUDA library does not build:\n{build.log[-3000:]}")
        path = build.path
    return cuda.load_library(path)


# ---- tables ----

def _mixed(n, dim, dtype, seed=0):
    """Two populations (so several clusters pay) and every 7th row incompressible (raw)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, dim, generator=g) * 0.01
    w[n // 2:] = torch.randn(n - n // 2, dim, generator=g) * 30
    k = len(range(0, n, 7))
    e = 4 if dtype == torch.float16 else 20  # finite in the dtype
    w[::7] = (torch.rand(k, dim, generator=g) - 0.5) * \
        10.0 ** torch.randint(-e, e, (k, dim), generator=g).float()
    w = w.to(dtype)
    assert torch.isfinite(w).all()
    return w


def _smooth(n, dim, dtype, seed=0):
    """Nearly constant rows in [1.5, 1.501): encoded even when a row is a few bytes."""
    g = torch.Generator().manual_seed(seed)
    return (1.5 + torch.rand(n, dim, generator=g) * 1e-3).to(dtype)


ENC = dict(allow_raw=False)  # encoded, though for some the masks outweigh the rows
CASES = [  # (name, weights, compress kwargs)
    ("f32-d128-w32-k4", lambda: _mixed(400, 128, torch.float32), dict(word_bits=32, clusters=4, **ENC)),
    ("f32-d128-w16", lambda: _mixed(300, 128, torch.float32), dict(word_bits=16, clusters=4, **ENC)),
    ("f32-d40-w64", lambda: _mixed(300, 40, torch.float32, 1), dict(word_bits=64, clusters=4, **ENC)),
    ("f16-d41-w64", lambda: _mixed(300, 41, torch.float16, 2), dict(word_bits=64, clusters=4, **ENC)),
    ("f16-d3-w32", lambda: _smooth(200, 3, torch.float16), dict(word_bits=32, **ENC)),
    ("bf16-d16-w16", lambda: _mixed(300, 16, torch.bfloat16, 3), dict(word_bits=16, clusters=2, **ENC)),
    ("bf16-d1-w64", lambda: _smooth(200, 1, torch.bfloat16), dict(word_bits=64, **ENC)),
    ("f32-d1-w32", lambda: _smooth(200, 1, torch.float32), dict(word_bits=32, **ENC)),
    ("i8-d7-w32", lambda: torch.randint(0, 4, (300, 7), dtype=torch.int8,
                                         generator=torch.Generator().manual_seed(4)), dict(word_bits=32, **ENC)),
    ("f64-d5-w64", lambda: _smooth(200, 5, torch.float64), dict(word_bits=64, **ENC)),
    # raw tables (format version 2): rows at i * R, no index and no tail pad in host memory
    ("raw-f32-d40", lambda: _mixed(30, 40, torch.float32, 5), dict(word_bits=64)),
    ("raw-f16-d3", lambda: _mixed(21, 3, torch.float16, 6), dict(word_bits=16)),
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request):
    name, make, kw = request.param
    w = make()
    return name, w, ibp_embed.compress(w, **kw)


def _batch(n_rows, n_idx, n_bags, seed):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_rows, n_idx)
    idx[: n_idx // 4] = idx[n_idx // 4: n_idx // 2]  # duplicates
    off = np.sort(rng.integers(0, n_idx + 1, n_bags + 1))
    off[0], off[-1] = 0, n_idx
    off[n_bags // 2] = off[n_bags // 2 + 1]  # an empty bag (unless it already is)
    w = rng.standard_normal(n_idx).astype(np.float32)
    return idx, off, w


def _raw(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def _assert_pooled_close(got, ref, w, idx, off, weights, mode):
    """got within 1e-6 relative of ref, relative to the pooled terms' magnitude.

    Sums in another order, or with fused multiply-adds, differ from libibp's by
    rounding errors that scale with sum |w x|, not with the (possibly cancelled)
    result, so the tolerance of element (b, d) is 1e-6 * (|ref| + sum_p |w_p x_pd|).
    """
    got = got.cpu()
    x = np.abs(w.double().numpy())[np.asarray(idx)]
    if weights is not None:
        x = x * np.abs(np.asarray(weights, np.float64))[:, None]
    off = np.asarray(off)
    bound = np.zeros((off.size - 1, w.shape[1]))
    full = off[1:] > off[:-1]
    if full.any():
        bound[full] = np.add.reduceat(x, off[:-1][full], axis=0)
    if mode == "mean":
        bound /= np.maximum(off[1:] - off[:-1], 1)[:, None]
    tol = 1e-6 * (ref.abs().double() + torch.from_numpy(bound)) + 1e-30
    err = (got.double() - ref.double()).abs()
    assert got.shape == ref.shape and bool((err <= tol).all()), \
        f"max error {float(err.max()):.3g}, max error / tolerance {float((err / tol).max()):.3g}"


# ---- (a), (b): the sources compile, without warnings or spills ----

def test_cuda_sources_compile_without_warnings(cuda_build):
    assert cuda_build.returncode == 0, f"nvcc failed:\n{cuda_build.log[-4000:]}"
    warnings = [line for line in cuda_build.log.splitlines() if re.search(r"warning", line, re.I)]
    assert not warnings, "nvcc/ptxas warnings:\n" + "\n".join(warnings[:20])
    assert cuda_build.path.stat().st_size > 0


def _ptxas_report(log: str) -> dict:
    """{(kernel, arch): (registers, stack bytes, spill stores, spill loads)} from `ptxas -v`."""
    out, cur, frame = {}, None, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+)'", line)
        if m:
            cur, frame = (m.group(1), m.group(2)), None
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur:
            frame = tuple(int(g) for g in m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and cur and frame is not None:
            out[cur] = (int(m.group(1)), *frame)
            cur = None
    return out


def test_ptxas_reports_no_spills_in_the_kernels(cuda_build):
    assert cuda_build.returncode == 0, "nvcc failed (see the compile test)"
    report = _ptxas_report(cuda_build.log)
    ours = {k: v for k, v in report.items() if any(h in k[0] for h in HOT_KERNELS)}
    for hot in HOT_KERNELS:
        for arch in ARCHS:
            assert any(hot in k and a == arch for k, a in ours), f"ptxas reported no {hot} for {arch}"
    spilling = {f"{k[0]} ({k[1]})": v for k, v in ours.items() if v[2] or v[3]}
    assert not spilling, f"kernels with local-memory spills (regs, stack, stores, loads): {spilling}"
    # The row kernels are bounded to 64 registers (4 blocks of 256 threads an SM).
    for (name, arch), (regs, *_rest) in ours.items():
        if "gather_rows" in name or "fused" in name or "raw_lookup" in name:
            assert regs <= 64, f"{name} ({arch}) uses {regs} registers"


# ---- (c): the library without a GPU ----

def test_cffi_block_parses():
    assert "ibp_cuda_lookup" in ibp_embed._native.header_cdef(cuda._HEADER)
    assert cuda.ffi.sizeof("ibp_cuda_info") > 0
    assert cuda.ffi.sizeof("ibp_table") == ibp_embed._native.ffi.sizeof("ibp_table")


def test_library_loads_and_reports(cuda_lib):
    assert cuda_lib.ibp_cuda_abi_version() == cuda.ABI_VERSION
    assert cuda_lib.ibp_cuda_format_version() == ibp_embed._native.FORMAT_VERSION
    msg = cuda.ffi.string(cuda_lib.ibp_cuda_error_string(cuda_lib.IBP_CUDA_E_NO_DEVICE)).decode()
    assert msg == "no CUDA device"
    assert cuda_lib.ibp_cuda_table_destroy(cuda.ffi.NULL) == 0
    assert cuda_lib.ibp_cuda_gather(cuda.ffi.NULL, cuda.ffi.NULL, 0, cuda.ffi.NULL, cuda.ffi.NULL, 0) \
        == cuda_lib.IBP_CUDA_E_ARG


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_no_device_is_reported_by_the_library(cuda_lib):
    n = cuda.ffi.new("int *")
    rc = cuda_lib.ibp_cuda_device_count(n)
    if rc == 0:
        pytest.skip("the CUDA runtime sees a device that torch cannot use")
    assert rc == cuda_lib.IBP_CUDA_E_NO_DEVICE and n[0] == 0
    assert cuda._message(cuda_lib).startswith("no CUDA device: ")
    assert cuda.device_count() == 0
    t = ibp_embed.compress(_mixed(100, 16, torch.float32))
    out = cuda.ffi.new("ibp_cuda_table **")
    assert cuda_lib.ibp_cuda_table_create(t._c, 0, 0, out) == cuda_lib.IBP_CUDA_E_NO_DEVICE
    assert out[0] == cuda.ffi.NULL
    buf = np.zeros(4096, np.uint8)
    dp = cuda.ffi.new("void **")
    assert cuda_lib.ibp_cuda_host_register(cuda.ffi.cast("void *", buf.ctypes.data), buf.nbytes, dp) \
        == cuda_lib.IBP_CUDA_E_NO_DEVICE


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_placing_a_table_without_a_device_raises_no_cuda_device(cuda_lib):
    t = ibp_embed.compress(_mixed(100, 16, torch.float32))
    with pytest.raises(cuda.NoCudaDeviceError, match=r"^no CUDA device"):
        cuda.CudaTable(t, "cuda")
    with pytest.raises(cuda.NoCudaDeviceError, match=r"^no CUDA device"):
        cuda.CudaTable(t, "cuda:0", placement="device")
    with pytest.raises(ValueError, match="CUDA device"):
        cuda.CudaTable(t, "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_no_device_error_without_the_library(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda, "_lib", None)
    monkeypatch.setenv("IBP_CUDA_LIBRARY", str(tmp_path / "missing.so"))
    t = ibp_embed.compress(_mixed(100, 16, torch.float32))
    with pytest.raises(cuda.NoCudaDeviceError, match=r"^no CUDA device: .*missing\.so"):
        cuda.CudaTable(t)


# ---- the kernels' code, run lane by lane on the host ----

def test_emulated_gather_is_bit_exact(cuda_lib, case):
    name, w, t = case
    rng = np.random.default_rng(0)
    idx = np.concatenate([rng.integers(0, t.shape[0], 500), [0, t.shape[0] - 1, 5, 5]])
    assert torch.equal(_raw(cuda.emulate_gather(t, idx)), _raw(t.gather(idx)))
    assert torch.equal(_raw(cuda.emulate_gather(t, np.arange(t.shape[0]))), _raw(w))


def test_case_tables_cover_the_format(case):
    """The cases hold raw and encoded rows, several clusters and all word sizes."""
    name, w, t = case
    lengths = t.row_lengths()
    row_bytes = w.shape[1] * w.dtype.itemsize
    assert t.is_raw == name.startswith("raw"), name
    if t.is_raw:
        assert t.nbytes == w.numel() * w.element_size(), name
    elif name.startswith(("f32-d128", "f32-d40", "f16-d41", "bf16-d16")):
        assert (lengths == row_bytes).any() and (lengths < row_bytes).any(), name
        assert t.clusters > 1, name
    elif name != "f64-d5-w64":
        assert (lengths < row_bytes).mean() > 0.9, name


def test_case_word_sizes():
    assert {kw["word_bits"] for _, _, kw in CASES} == {16, 32, 64}


@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "fused"])
def test_emulated_lookup_matches_libibp(cuda_lib, case, dedup):
    name, w, t = case
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        pytest.skip("pooled lookups are for float tables")
    idx, off, weights = _batch(t.shape[0], 700, 64, 1)
    for mode in ("sum", "mean"):
        for wts in (None, weights):
            # Same order, same arithmetic (weighted: fmaf(w, x, acc) in both): the same bits.
            ref = t.lookup(idx, off, wts, mode)
            got = cuda.emulate_lookup(t, idx, off, wts, mode, dedup)
            assert torch.equal(got, ref), (mode, wts is not None, float((got - ref).abs().max()))


def test_emulated_weighted_pooling_uses_fma(cuda_lib):
    """The kernels pool weighted rows with one rounding, fma(w, x, acc), as libibp's
    fmaf does. Here acc = -(1 + 2^-11) after the first row, and the second adds
    (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24: one rounding keeps 2^-24, two (the product
    rounds to 1 + 2^-11 first) give 0."""
    x = torch.tensor([[1.0 + 2.0 ** -11], [1.0 + 2.0 ** -12]], dtype=torch.float32)
    t = ibp_embed.compress(x, word_bits=32)
    idx, off = np.array([0, 1]), np.array([0, 2])
    wts = np.array([-1.0, 1.0 + 2.0 ** -12], np.float32)
    twice = np.float32(np.float32(wts[1] * np.float32(x[1, 0].item())) - np.float32(x[0, 0].item()))
    assert twice == 0.0
    assert t.lookup(idx, off, wts)[0, 0].item() == 2.0 ** -24
    for dedup in (True, False):
        assert cuda.emulate_lookup(t, idx, off, wts, dedup=dedup)[0, 0].item() == 2.0 ** -24


def test_emulated_lookup_edge_cases(cuda_lib):
    t = ibp_embed.compress(_mixed(50, 8, torch.float32))
    for dedup in (True, False):
        out = cuda.emulate_lookup(t, np.zeros(0, np.int64), np.zeros(4, np.int64), dedup=dedup)
        assert out.shape == (3, 8) and not out.any()
        with pytest.raises(IndexError):
            cuda.emulate_lookup(t, [1, 50], [0, 2], dedup=dedup)
        with pytest.raises(IndexError):
            cuda.emulate_lookup(t, [-1], [0, 1], dedup=dedup)
        with pytest.raises(ValueError, match="offsets"):
            cuda.emulate_lookup(t, [1, 2, 3], [0, 2, 1, 3], dedup=dedup)
        with pytest.raises(ValueError, match="offsets"):
            cuda.emulate_lookup(t, [1, 2, 3], [0, 2], dedup=dedup)
    with pytest.raises(IndexError):
        cuda.emulate_gather(t, [0, 50])


def test_emulated_decode_detects_corrupt_rows(cuda_lib):
    w = _smooth(64, 32, torch.float32)
    t = ibp_embed.compress(w, word_bits=32, clusters=1)
    assert (t.row_lengths() < 128).all()
    # Flip word j's participation bit in row 5, j a word with >= 8 invariant bits:
    # the bitstream then needs at least a byte more or less than the row holds.
    j = int(np.argmax(np.bitwise_count(t._masks[0])))
    assert np.bitwise_count(t._masks[0][j]) >= 8
    row = 5
    start = int(t._row_starts()[row])
    payload = t._payload.copy()
    payload[start + j // 8] ^= np.uint8(1 << (j % 8))
    bad = ibp_embed.CompressedTable(shape=t.shape, dtype=t.dtype, word_bits=t.word_bits,
                                    masks=t._masks, bitvals=t._bitvals, block_base=t._block_base,
                                    rel=t._rel, payload=payload, payload_bytes=t._payload_bytes,
                                    validate=False)
    with pytest.raises(FormatError):
        bad.gather([row])
    with pytest.raises(FormatError):
        cuda.emulate_gather(bad, [row])
    ok = [i for i in range(64) if i != row]
    assert torch.equal(cuda.emulate_gather(bad, ok), w[ok])


def test_emulation_handles_an_unaligned_payload(cuda_lib):
    w = _mixed(100, 24, torch.float32)
    t = ibp_embed.compress(w, word_bits=32)
    buf = np.zeros(t._payload.size + 1, np.uint8)
    payload = buf[1:]
    payload[:] = t._payload
    assert payload.ctypes.data % 16
    t2 = ibp_embed.CompressedTable(shape=t.shape, dtype=t.dtype, word_bits=t.word_bits,
                                   masks=t._masks, bitvals=t._bitvals, block_base=t._block_base,
                                   rel=t._rel, payload=payload, payload_bytes=t._payload_bytes)
    assert torch.equal(cuda.emulate_gather(t2, np.arange(100)), w)


# ---- the format's tail pad: one definition ----

def test_tail_pad_is_the_formats_one_and_the_cuda_code_shares_it():
    """ibp_tail_pad (libibp) is docs/format.md's formula, and the CUDA code computes
    the span it registers or copies from the same inline function (ibp_bits.h)."""
    lib = ibp_embed._native.lib
    for row_bytes in (1, 2, 3, 7, 8, 40, 82, 512, 4096, 120000):
        for w in (16, 32, 64):
            b = w // 8
            assert lib.ibp_tail_pad(row_bytes, w) == -(-row_bytes // b) * b + -(-row_bytes // 8) + 136
    bits = (ROOT / "native" / "ibp_bits.h").read_text()
    assert "IBP_HD uint64_t ibp_tail_pad_bytes(" in bits
    assert "return ibp_tail_pad_bytes(" in (ROOT / "native" / "ibp.c").read_text()
    for src in sorted(CUDA_DIR.glob("*.cu*")):
        text = src.read_text()
        assert "+ 17" not in text and not re.search(r"\btail_pad\s*\(", text), src.name
    uses = [p.name for p in CUDA_DIR.glob("*.cu") if "ibp_tail_pad_bytes(" in p.read_text()]
    assert sorted(uses) == ["emulate.cu", "ibp_cuda_api.cu"]


# ---- many rows and bags per warp: the kernels' loops ----

# The row kernels' grid on an H100/H200 (132 SMs, 4 blocks of 8 warps an SM).
H100_GRID_WARPS = 132 * 32
LOOP_CASES = [  # (dtype, dim, word_bits): every word size, every element type
    (torch.float32, 64, 32), (torch.float16, 72, 64), (torch.bfloat16, 40, 16)]
LOOP_IDS = ["f32-d64-w32", "f16-d72-w64", "bf16-d40-w16"]


@pytest.fixture
def emulated_grid(cuda_lib):
    """Set the emulated grid's warps for a test; the default again after it."""
    yield lambda warps: cuda_lib.ibp_cuda_emulate_grid(warps)
    cuda_lib.ibp_cuda_emulate_grid(0)


def _loop_table(dtype, dim, word_bits, n_rows, seed=0):
    w = _mixed(n_rows, dim, dtype, seed)
    t = ibp_embed.compress(w, word_bits=word_bits, clusters=4, progress=False)
    lengths = t.row_lengths()
    assert (lengths == dim * w.dtype.itemsize).any() and (lengths < dim * w.dtype.itemsize).any()
    return w, t


def _loop_batch(n_rows, n_bags, grid, seed, pooling=10):
    """Bags of 1 to 2 x pooling ids, every 97th bag empty, 50 single-id bags, a
    3 x pooling last bag and a run of 2 x grid + 1 empty bags (every warp's seek
    passes over two of them): (ids with duplicates, offsets, weights). The caller
    makes the other bags outnumber the grid's warps several times."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 2 * pooling + 1, n_bags)
    sizes[::97] = 0
    lo, run = n_bags // 3, 2 * grid + 1
    sizes[lo:lo + run] = 0
    sizes[2 * n_bags // 3:2 * n_bags // 3 + 50] = 1
    sizes[-1] = 3 * pooling
    off = np.zeros(n_bags + 1, np.int64)
    np.cumsum(sizes, out=off[1:])
    n_ids = int(off[-1])
    idx = rng.integers(0, n_rows, n_ids)
    k = n_ids // 4
    idx[:k] = idx[k:2 * k]  # duplicates
    return idx, off, rng.standard_normal(n_ids).astype(np.float32)


def _check_loops(t, gather, lookup, idx, off, wts, raw_lookup=None):
    """gather and every lookup variant (and the raw kernel's) against libibp, bit for bit."""
    assert torch.equal(_raw(gather(idx)), _raw(t.gather(idx)))
    for mode in ("sum", "mean"):
        for weights in (None, wts):
            ref = t.lookup(idx, off, weights, mode)
            for dedup in (True, False):
                got = lookup(idx, off, weights, mode, dedup)
                assert torch.equal(got, ref), (mode, weights is not None, dedup,
                                               float((got - ref).abs().max()))
            if raw_lookup is not None:
                got = raw_lookup(idx, off, weights, mode)
                assert torch.equal(got, ref), ("raw", mode, weights is not None,
                                               float((got - ref).abs().max()))


@pytest.mark.parametrize("dtype,dim,word_bits", LOOP_CASES, ids=LOOP_IDS)
def test_emulated_kernels_walk_many_rows_and_bags_per_warp(cuda_lib, emulated_grid, dtype, dim,
                                                           word_bits):
    """About 200,000 ids in 20,000 bags (and a run of 8,449 empty ones) on an
    H100-sized grid (4,224 warps): each warp decodes ~47 rows of the gather and
    ~7 of the dedup's distinct rows, and pools ~5 bags, so the next-row prefetch,
    the buffer swap and the move to the next bag run many times, in the kernels'
    own loop code (loops.cuh)."""
    from benchmarks.raw_baseline import emulate_raw_lookup

    emulated_grid(H100_GRID_WARPS)
    n_bags, n_rows = 20_000 + 2 * H100_GRID_WARPS + 1, 30_000
    w, t = _loop_table(dtype, dim, word_bits, n_rows)
    idx, off, wts = _loop_batch(n_rows, n_bags, H100_GRID_WARPS, 7)
    full = int((np.diff(off) > 0).sum())
    assert idx.size > 190_000 and full > 4 * H100_GRID_WARPS
    assert np.unique(idx).size > 4 * H100_GRID_WARPS
    _check_loops(t, lambda i: cuda.emulate_gather(t, i),
                 lambda i, o, wt, m, d: cuda.emulate_lookup(t, i, o, wt, m, d), idx, off, wts,
                 lambda i, o, wt, m: emulate_raw_lookup(w, i, o, wt, m))


@pytest.mark.parametrize("warps", [1, 3, 16, 257, 100_000])
def test_emulated_results_do_not_depend_on_the_grid(cuda_lib, emulated_grid, warps):
    """One warp doing everything, odd grids, and more warps than items: the same bits."""
    from benchmarks.raw_baseline import emulate_raw_lookup

    emulated_grid(warps)
    w, t = _loop_table(torch.float32, 24, 64, 500, seed=3)
    idx, off, wts = _loop_batch(500, 400, 20, 9)
    _check_loops(t, lambda i: cuda.emulate_gather(t, i),
                 lambda i, o, wt, m, d: cuda.emulate_lookup(t, i, o, wt, m, d), idx, off, wts,
                 lambda i, o, wt, m: emulate_raw_lookup(w, i, o, wt, m))


def test_emulated_grid_setting(cuda_lib, emulated_grid):
    assert emulated_grid(7) == 16  # the default
    assert emulated_grid(0) == 7
    assert cuda_lib.ibp_cuda_emulate_grid(0) == 16


# ---- the raw-row baseline kernel (ibp_cuda_raw_lookup), emulated ----

@pytest.mark.parametrize("dtype,dim", [(torch.float32, 16), (torch.float16, 3), (torch.bfloat16, 5),
                                       (torch.float16, 64)])
def test_emulated_raw_lookup_matches_torch_embedding_bag(cuda_lib, dtype, dim):
    """Rows of 6 or 10 bytes start anywhere in a 16-byte granule, and the table's
    end is not on a granule boundary (the last granule is copied partly)."""
    from benchmarks.raw_baseline import emulate_raw_lookup

    n = 1001
    w = _mixed(n, dim, dtype, 5)
    assert (n * dim * w.dtype.itemsize) % 16 or dim in (16, 64)
    idx, off, wts = _batch(n, 4000, 300, 11)
    idx[:10] = n - 1  # the last row
    ii, oo = torch.from_numpy(idx), torch.from_numpy(off)
    for mode in ("sum", "mean"):
        ref = F.embedding_bag(ii, w.float(), oo, mode=mode, include_last_offset=True)
        got = emulate_raw_lookup(w, idx, off, None, mode)
        _assert_pooled_close(got, ref, w, idx, off, None, mode)
    ref = F.embedding_bag(ii, w.float(), oo, mode="sum", per_sample_weights=torch.from_numpy(wts),
                          include_last_offset=True)
    _assert_pooled_close(emulate_raw_lookup(w, idx, off, wts), ref, w, idx, off, wts, "sum")
    # libibp's order and arithmetic: the same bits
    t = ibp_embed.compress(w, progress=False)
    for mode in ("sum", "mean"):
        assert torch.equal(emulate_raw_lookup(w, idx, off, wts, mode), t.lookup(idx, off, wts, mode))


def test_emulated_raw_lookup_errors(cuda_lib):
    from benchmarks.raw_baseline import emulate_raw_lookup

    w = _mixed(50, 8, torch.float32)
    out = emulate_raw_lookup(w, np.zeros(0, np.int64), np.zeros(4, np.int64))
    assert out.shape == (3, 8) and not out.any()
    with pytest.raises(IndexError):
        emulate_raw_lookup(w, [1, 50], [0, 2])
    with pytest.raises(IndexError):
        emulate_raw_lookup(w, [-1], [0, 1])
    with pytest.raises(ValueError, match="offsets"):
        emulate_raw_lookup(w, [1, 2, 3], [0, 2, 1, 3])
    buf = torch.zeros(50 * 8 + 1)
    with pytest.raises(ValueError, match="16-byte aligned"):
        emulate_raw_lookup(buf[1:].view(50, 8), [1], [0, 1])


# ---- the build on other machines, and the GPU check script ----

def test_makefile_werror_can_be_dropped():
    """CI builds with -Werror; `make WERROR=` (gpu_check.sh on the GPU machine) without."""
    def commands(*extra):
        proc = subprocess.run(["make", "-n", "-B", "lib", *extra], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return [line for line in proc.stdout.splitlines() if " -c native/" in line]
    default, relaxed = commands(), commands("WERROR=")
    assert default and all("-Werror" in c for c in default)
    assert len(relaxed) == len(default) and not any("-Werror" in c for c in relaxed)
    assert "make lib cuda WERROR=" in (ROOT / "benchmarks" / "gpu_check.sh").read_text()


def test_gpu_check_script_parses_and_has_help():
    script = ROOT / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    proc = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "--dry-run" in proc.stdout and "--download-wheels" in proc.stdout


def test_sanitizer_driver_runs_through_the_emulation(cuda_lib):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_sanitize.py"), "--emulate"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "every result matched libibp" in proc.stdout


# ---- the GPU benchmark's CPU self-check ----

def test_gpu_benchmark_help_and_dry_run():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for args in (["--help"], ["--dry-run"]):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_lookup", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CUDA device:" in proc.stdout


def test_gpu_benchmark_emulate_mode_checks_every_result(cuda_lib, tmp_path, capsys):
    """The benchmark's whole flow on the CPU: every method's results checked against
    libibp, the byte model, the cache warmed on other batches than it is timed on."""
    import json

    from benchmarks import gpu_lookup

    rc = gpu_lookup.main(["--emulate", "--rows", "4000", "--dim", "24", "--dtype", "bfloat16",
                          "--bags", "64", "--timed-batches", "2", "--warm-batches", "2",
                          "--results-dir", str(tmp_path), "--table-out", str(tmp_path / "t.md")])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    table = (tmp_path / "t.md").read_text()
    assert out.rstrip().endswith(table.rstrip())  # the table is printed last
    assert "EMULATION" in table and "PCIe MB/batch" in table and "hit rate" in table
    (path,) = tmp_path.glob("gpu_lookup_emulate-*.json")
    res = json.loads(path.read_text())
    assert not res["failed"]
    by = {(r["workload"], r["method"]): r for r in res["results"]}
    for wl in ("uniform", "zipf"):
        assert by[(wl, "ibp host dedup (emulated)")]["check"] == "exact"
        assert by[(wl, "raw zero-copy kernel (emulated)")]["check"] == "exact"
        dedup, fused = by[(wl, "ibp host dedup (emulated)")], by[(wl, "ibp host fused (emulated)")]
        # (rows of 48 bytes: the 16-byte granules can cost more than compression saves)
        assert dedup["pcie_bytes"] < fused["pcie_bytes"] and 0.5 < dedup["ratio"] < 2.0
        cache = by[(wl, "cache 0.2 over ibp host")]
        assert 0.0 < cache["hit_rate"] < 1.0 and cache["extra"]["cache"]["lookups"] == 2
        assert cache["pcie_bytes"] < fused["pcie_bytes"]


# ---- (d): on a GPU ----

def _has_gpu() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return cuda.device_count() > 0
    except Exception:
        return False


gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA device: torch.cuda.is_available() is False")


@pytest.fixture(scope="module")
def gpu_ready(cuda_lib):
    if not _has_gpu():
        pytest.skip("no CUDA device visible to libibp_cuda")
    return torch.device("cuda", torch.cuda.current_device())


@gpu
@needs_gpu
@pytest.mark.parametrize("placement", ["host", "device"])
def test_gpu_gather_is_bit_exact(gpu_ready, case, placement):
    name, w, t = case
    ct = cuda.CudaTable(t, gpu_ready, placement=placement)
    info = ct.info()
    assert info["payload_mode"] in (("registered", "shared", "pinned_copy") if placement == "host"
                                    else ("device_copy",))
    rng = np.random.default_rng(0)
    idx = torch.from_numpy(rng.integers(0, t.shape[0], 3000)).to(gpu_ready)
    got = ct.gather(idx)
    assert got.device == gpu_ready and got.dtype == t.dtype
    assert torch.equal(_raw(got.cpu()), _raw(t.gather(idx.cpu())))
    assert torch.equal(_raw(ct.gather(torch.arange(t.shape[0])).cpu()), _raw(w))
    two_d = idx[:60].reshape(6, 10)
    assert ct.gather(two_d).shape == (6, 10, w.shape[1])
    assert ct.gather(torch.zeros(0, dtype=torch.int64)).shape == (0, w.shape[1])
    ct.close()


@gpu
@needs_gpu
@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "fused"])
@pytest.mark.parametrize("placement", ["host", "device"])
def test_gpu_lookup_matches_cpu(gpu_ready, case, dedup, placement):
    name, w, t = case
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        pytest.skip("pooled lookups are for float tables")
    ct = cuda.CudaTable(t, gpu_ready, placement=placement)
    idx, off, weights = _batch(t.shape[0], 5000, 300, 2)
    for mode in ("sum", "mean"):
        for wts in (None, weights):
            ref = t.lookup(idx, off, wts, mode)
            got = ct.lookup(torch.from_numpy(idx).to(gpu_ready), torch.from_numpy(off).to(gpu_ready),
                            None if wts is None else torch.from_numpy(wts).to(gpu_ready), mode,
                            dedup=dedup)
            assert got.device == gpu_ready and got.shape == ref.shape
            _assert_pooled_close(got, ref, w, idx, off, wts, mode)
    ct.close()


def _loop_sizes(props) -> tuple[int, int, int]:
    """(bags, table rows, grid warps) such that every warp of every kernel's grid
    gets several items on this device: the row kernels' grids hold at most the
    SMs' resident warps (64 an SM on sm_80/sm_90), the dedup pooling kernel's at
    most 16 blocks of 8 warps an SM; _loop_batch puts ~10 ids in a bag."""
    sms = props.multi_processor_count
    grid = sms * getattr(props, "max_threads_per_multi_processor", 2048) // 32
    pool_grid = sms * 16 * 8
    n_bags = max(20_000, 3 * max(grid, pool_grid)) + 2 * grid + 1  # + _loop_batch's empty run
    n_rows = max(30_000, 4 * grid)  # the dedup path's distinct rows outnumber the grid too
    return n_bags, n_rows, grid


def _register(t: torch.Tensor) -> int:
    """Pin a CPU tensor in place; the device pointer the kernels read it through."""
    lib = cuda.load_library()
    dptr = cuda.ffi.new("void **")
    cuda.check(lib.ibp_cuda_host_register(cuda.ffi.cast("void *", t.data_ptr()),
                                          t.numel() * t.element_size(), dptr), "host_register", lib)
    return int(cuda.ffi.cast("uintptr_t", dptr[0]))


def _unregister(t: torch.Tensor) -> None:
    lib = cuda.load_library()
    cuda.check(lib.ibp_cuda_host_unregister(cuda.ffi.cast("void *", t.data_ptr())), "unregister", lib)


@gpu
@needs_gpu
@pytest.mark.parametrize("placement", ["host", "device"])
@pytest.mark.parametrize("dtype,dim,word_bits", LOOP_CASES, ids=LOOP_IDS)
def test_gpu_kernels_walk_many_rows_and_bags_per_warp(gpu_ready, placement, dtype, dim, word_bits):
    """More rows (gather, and the dedup's distinct rows) and more bags (fused,
    dedup pooling, raw kernel) than the grids hold warps, so every warp runs the
    next-row prefetch, the buffer swap and the move to its next bag several
    times; checked bit for bit against libibp (the kernels pool in libibp's
    order with fma, as the emulation, whose same sizes pass without a GPU)."""
    from benchmarks.raw_baseline import raw_lookup

    props = torch.cuda.get_device_properties(gpu_ready)
    n_bags, n_rows, grid = _loop_sizes(props)
    w, t = _loop_table(dtype, dim, word_bits, n_rows)
    idx, off, wts = _loop_batch(n_rows, n_bags, grid, 7)
    assert np.unique(idx).size > 2 * grid and idx.size > 20 * grid
    assert int((np.diff(off) > 0).sum()) > 2 * max(grid, props.multi_processor_count * 128)
    ct = cuda.CudaTable(t, gpu_ready, placement=placement)
    info = ct.info()
    assert info["staged"] and info["warps_per_block"] * 32 <= 1024
    dev = gpu_ready
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    if placement == "host":  # the raw kernel over pinned host rows (zero-copy), else over HBM rows
        w_host = w.contiguous().clone()
        rows_ptr, keep = _register(w_host), w_host
    else:
        keep = w.to(dev)
        rows_ptr = keep.data_ptr()

    def to_dev(x):
        return None if x is None else torch.from_numpy(np.asarray(x)).to(dev)

    def lookup(i, o, wt, mode, dedup):
        return ct.lookup(to_dev(i), to_dev(o), to_dev(wt), mode, dedup=dedup).cpu()

    def raw(i, o, wt, mode):
        return raw_lookup(rows_ptr, n_rows, dtype, dim, to_dev(i), to_dev(o), to_dev(wt), mode,
                          status=status).cpu()
    try:
        _check_loops(t, lambda i: ct.gather(to_dev(i)).cpu(), lookup, idx, off, wts, raw)
        with pytest.raises(IndexError):  # and the raw kernel's error flags
            raw(np.array([0, n_rows]), np.array([0, 2]), None, "sum")
        assert int(status.item()) == 0  # reported and cleared
    finally:
        ct.close()
        if placement == "host":
            _unregister(keep)


@gpu
@needs_gpu
def test_gpu_lookup_edge_cases(gpu_ready):
    w = _mixed(200, 64, torch.float32)
    t = ibp_embed.compress(w)
    ct = cuda.CudaTable(t, gpu_ready)
    dev = gpu_ready
    for dedup in (True, False):
        # all bags empty, no indices
        out = ct.lookup(torch.zeros(0, dtype=torch.int64, device=dev),
                        torch.zeros(5, dtype=torch.int64, device=dev), dedup=dedup)
        assert out.shape == (4, 64) and not out.any()
        # one row named many times, empty bags around it
        idx = torch.full((1000,), 7, dtype=torch.int64, device=dev)
        off = torch.tensor([0, 0, 1000, 1000], device=dev)
        _assert_pooled_close(ct.lookup(idx, off, dedup=dedup), t.lookup(idx.cpu(), off.cpu()),
                             w, idx.cpu().numpy(), off.cpu().numpy(), None, "sum")
        with pytest.raises(IndexError):
            ct.lookup(torch.tensor([1, 200], device=dev), torch.tensor([0, 2], device=dev), dedup=dedup)
        with pytest.raises(IndexError):
            ct.lookup(torch.tensor([-1], device=dev), torch.tensor([0, 1], device=dev), dedup=dedup)
        with pytest.raises(ValueError):
            ct.lookup(torch.tensor([1, 2, 3], device=dev), torch.tensor([0, 2, 1, 3], device=dev),
                      dedup=dedup)
        # the errors were reported and cleared: the next call is fine
        ok = ct.lookup(torch.tensor([1, 2], device=dev), torch.tensor([0, 2], device=dev), dedup=dedup)
        assert torch.equal(ok.cpu(), t.lookup([1, 2], [0, 2]))
    with pytest.raises(IndexError):
        ct.gather(torch.tensor([0, 200], device=dev))
    # asynchronous calls, errors found by check()
    ct.gather(torch.tensor([0, 999], device=dev), check=False)
    with pytest.raises(IndexError):
        ct.check()
    ct.check()
    ct.close()


@gpu
@needs_gpu
def test_gpu_large_rows_and_direct_reads(gpu_ready, monkeypatch):
    # Rows of 120 KB: too large to stage twice per warp in shared memory: direct reads.
    w = _mixed(24, 30000, torch.float32)
    t = ibp_embed.compress(w, word_bits=32)
    ct = cuda.CudaTable(t, gpu_ready)
    assert not ct.info()["staged"]
    assert torch.equal(ct.gather(torch.arange(24)).cpu(), w)
    _assert_pooled_close(ct.lookup(torch.arange(24), torch.tensor([0, 10, 24])),
                         t.lookup(np.arange(24), [0, 10, 24]), w, np.arange(24), [0, 10, 24],
                         None, "sum")
    ct.close()
    # Forced direct reads on a small table (IBP_CUDA_STAGED=0 at placement).
    w = _mixed(500, 128, torch.float32)
    t = ibp_embed.compress(w, clusters=4)
    monkeypatch.setenv("IBP_CUDA_STAGED", "0")
    ct = cuda.CudaTable(t, gpu_ready)
    monkeypatch.delenv("IBP_CUDA_STAGED")
    assert not ct.info()["staged"]
    assert torch.equal(ct.gather(torch.arange(500)).cpu(), w)
    idx, off, weights = _batch(500, 3000, 100, 5)
    _assert_pooled_close(ct.lookup(idx, off, weights, dedup=False), t.lookup(idx, off, weights),
                         w, idx, off, weights, "sum")
    ct.close()


@gpu
@needs_gpu
def test_gpu_shared_registration_and_mmap(gpu_ready, tmp_path):
    w = _mixed(1000, 32, torch.bfloat16)
    t = ibp_embed.compress(w)
    a, b = cuda.CudaTable(t, gpu_ready), cuda.CudaTable(t, gpu_ready)
    a.close()  # b still reads the payload pinned for both
    assert torch.equal(b.gather(torch.arange(1000)).cpu(), w)
    b.close()
    path = tmp_path / "t.ibp"
    t.save(path)
    loaded = ibp_embed.load(path)
    c = cuda.CudaTable(loaded, gpu_ready)
    assert torch.equal(c.gather(torch.arange(1000)).cpu(), w)
    c.close()


@gpu
@needs_gpu
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_gpu_row_cache(gpu_ready, policy):
    from ibp_embed.cache import RowCache

    w = _mixed(2000, 64, torch.float16)
    t = ibp_embed.compress(w)
    assert t.clusters > 1
    ct = cuda.CudaTable(t, gpu_ready)
    cache = RowCache(ct, load_factor=0.2, policy=policy)
    assert cache.device == gpu_ready and cache.rows.device == gpu_ready
    rng = np.random.default_rng(3)
    batches = [_batch(2000, 2000, 100, s) for s in range(6)]
    for i, (idx, off, wts) in enumerate(batches):
        if i + 1 < len(batches):
            cache.prefetch(torch.from_numpy(batches[i + 1][0]).to(gpu_ready))
        got = cache.lookup(torch.from_numpy(idx).to(gpu_ready), torch.from_numpy(off).to(gpu_ready),
                           torch.from_numpy(wts).to(gpu_ready), "mean")
        _assert_pooled_close(got, t.lookup(idx, off, wts, "mean"), w, idx, off, wts, "mean")
    assert cache.prefetched > 0 and cache.hits > 0
    # a host-decoding source for a device cache
    cache2 = RowCache(t, load_factor=0.5, policy=policy, device=gpu_ready)
    idx = rng.integers(0, 2000, 500)
    assert torch.equal(cache2.gather(torch.from_numpy(idx)).cpu(), w[idx])
    ct.close()
