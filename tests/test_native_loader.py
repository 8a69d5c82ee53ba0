"""The native library's loader: $IBP_ISA picks the row kernels, or says why it cannot."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ibp_embed import _native

ROOT = Path(__file__).resolve().parent.parent
PICKED = ("from ibp_embed import _native; "
          "print({v: k for k, v in _native.KERNEL_SETS.items()}[_native.lib.ibp_isa()])")


def load_with(isa: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PICKED], env={**os.environ, "IBP_ISA": isa, "PYTHONPATH": str(ROOT)},
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ibp_isa_picks_the_kernels():
    r = load_with("generic")  # every CPU runs the portable kernels
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["generic"]


def test_ibp_isa_names_a_kernel_set():
    r = load_with("avx2")
    assert r.returncode != 0
    assert "IBP_ISA='avx2' names no kernel set: one of generic, v3, v3-no-pdep, avx512" in r.stderr


def test_ibp_isa_this_cpu_cannot_run(monkeypatch):
    """A set the CPU lacks (here: the library refusing avx512, as it does on such a CPU)."""
    real = _native.lib

    class WithoutAvx512:
        def __getattr__(self, name):
            return getattr(real, name)

        def ibp_set_isa(self, isa):
            return real.IBP_E_ARG if isa == real.IBP_ISA_AVX512 else real.ibp_set_isa(isa)

    before = real.ibp_isa()
    monkeypatch.setattr(_native, "lib", WithoutAvx512())
    monkeypatch.setenv("IBP_ISA", "avx512")
    try:
        with pytest.raises(_native.NativeLibraryError,
                           match=r"IBP_ISA=avx512: this CPU cannot run the avx512 kernels \(it runs generic"):
            _native._kernels_from_env()
    finally:
        real.ibp_set_isa(before)


def test_thread_counts_are_positive_and_capped():
    """IBP_NUM_THREADS=100000 crashed the first parallel loop (compress's word costs):
    libibp runs at most IBP_MAX_THREADS (IBP_NUM_THREADS, set_num_threads; OpenMP's own
    count as well); a count that is not a positive integer is an error, from the
    environment and from set_num_threads. (The counts are read, not run: a CI box may
    not start 1,024 threads.)"""
    code = "from ibp_embed import _native; print(_native.lib.ibp_get_num_threads())"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("IBP_NUM_THREADS", None)
    for value in ("100000", "5000000000"):
        r = subprocess.run([sys.executable, "-c", code], env={**env, "IBP_NUM_THREADS": value}, cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.split() == [str(_native.lib.IBP_MAX_THREADS)], (value, r.stderr)
    code = "from ibp_embed import _native"
    for bad in ("0", "-2", "two", "1.5", "\u00b2"):
        r = subprocess.run([sys.executable, "-c", code], env={**env, "IBP_NUM_THREADS": bad}, cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and f"IBP_NUM_THREADS must be a positive integer, got {bad!r}" in r.stderr
    before = _native.lib.ibp_get_num_threads()
    try:
        for bad in (0, -1, 2.5, True, "3"):
            with pytest.raises(ValueError, match="threads must be a positive integer"):
                _native.set_num_threads(bad)
        _native.set_num_threads(10**6)
        assert _native.lib.ibp_get_num_threads() == _native.lib.IBP_MAX_THREADS
    finally:
        _native.set_num_threads(before)
