"""Fixtures shared by test files: for the CUDA tests (tests/test_cuda_library.py,
test_cuda_emulation.py, test_cuda_gpu.py) one nvcc build of native/cuda and one loaded
libibp_cuda for the session, and `case`, the CASES tables of tests/cuda_cases.py
compressed once a module; for the .ibp file tests (test_io.py, test_io_corruption.py)
`one_thread` and `small`. Nothing here is autouse."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import ibp_embed
from cuda_cases import CASES, CUDA_DIR, ROOT
from io_cases import save_small, single_thread

DEFAULT_LIB = ROOT / "native" / "build" / "libibp_cuda.so"
NVCC = shutil.which("nvcc")


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
    from ibp_embed import cuda  # here, not on loading this file: it reads $IBP_CUDA_EMULATE

    return cuda.load_library(path)


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request):
    name, make, kw = request.param
    w = make()
    return name, w, ibp_embed.compress(w, **kw)


@pytest.fixture(scope="module")
def one_thread():
    """libibp and torch on one thread for a module (see io_cases.single_thread)."""
    with single_thread():
        yield


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small saved table with K > 1 and some raw rows: (path, table, data, file bytes)."""
    return save_small(tmp_path_factory)
