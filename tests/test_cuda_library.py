"""The CUDA library without a GPU (native/cuda, ibp_embed.cuda): its build, loading and tools.

The CUDA sources compile warning-free with the Makefile's nvcc flags, ptxas reports
no local-memory spills in the kernels, the library loads and reports "no CUDA
device" (placing a table then raises NoCudaDeviceError), the format's tail pad has
one definition shared by libibp and the CUDA code, `make WERROR=` drops -Werror (for
the GPU machine's compilers), benchmarks/gpu_check.sh parses, its sanitizer driver
runs through the host emulation, and the GPU benchmark runs its reduced --emulate
mode. The kernels' code run on the host: tests/test_cuda_emulation.py; on a GPU:
tests/test_cuda_gpu.py. Shared tables: tests/cuda_cases.py; fixtures: tests/conftest.py.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import ibp_embed
from cuda_cases import CUDA_DIR, ROOT, _mixed
from ibp_embed import cuda

# Kernels whose spill counts must be zero (all of ours; CUB's are not checked).
HOT_KERNELS = ("ibp_gather_rows_kernel", "ibp_lookup_fused_kernel", "ibp_pool_kernel",
               "ibp_dedup_keys_kernel", "ibp_dedup_heads_kernel", "ibp_dedup_scatter_kernel",
               "ibp_raw_lookup_kernel")
ARCHS = ("sm_80", "sm_90")


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
    assert sorted(uses) == ["emulate.cu", "ibp_cuda_api.cu", "placement.cu"]


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
