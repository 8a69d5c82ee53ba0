"""cffi (ABI mode) binding of native/build/libibp.so.

The cdef is the block of native/ibp.h between CFFI_BEGIN and CFFI_END, so the C
header stays the single description of the interface. The library is located
through $IBP_LIBRARY or next to the package in a source checkout.
"""
from __future__ import annotations

import operator
import os
import re
from pathlib import Path

import cffi

from .errors import FormatError, NativeLibraryError

_ROOT = Path(__file__).resolve().parent.parent
_HEADER = _ROOT / "native" / "ibp.h"
_LIBRARY = _ROOT / "native" / "build" / "libibp.so"

ABI_VERSION = 10
FORMAT_VERSION = 2  # reads versions 1 and 2 (io.read_header)


def header_cdef(header: Path) -> str:
    """The CFFI_BEGIN .. CFFI_END block of a C header: its cffi cdef."""
    try:
        text = header.read_text()
    except OSError as e:
        raise NativeLibraryError(f"cannot read the C header {header}: {e}") from None
    m = re.search(r"/\* CFFI_BEGIN \*/(.*)/\* CFFI_END \*/", text, re.S)
    if not m:
        raise NativeLibraryError(f"{header} has no CFFI_BEGIN/CFFI_END block")
    return m.group(1)


ffi = cffi.FFI()
ffi.cdef(header_cdef(_HEADER))


#: the libibp this process loads: $IBP_LIBRARY, or the checkout's build
library_path = Path(os.environ.get("IBP_LIBRARY", _LIBRARY))


def _load(path: Path):
    if not path.exists():
        raise NativeLibraryError(
            f"the native library {path} is missing: run `make` in {_ROOT} to build it")
    # Where libibp brings an OpenMP runtime of its own (torch built with another one,
    # or not loaded yet), two runtimes whose idle workers spin slow each other down
    # badly on few cores: ours waits passively unless the user chose a policy (libgomp
    # reads it once, when it loads). Torch's wheels ship a libgomp of the same soname,
    # which libibp then shares (the package imports torch first): this comes too late.
    chosen = "OMP_WAIT_POLICY" in os.environ
    if not chosen:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        lib = ffi.dlopen(str(path))
    except OSError as e:
        raise NativeLibraryError(f"cannot load {path} ({e}): run `make` to rebuild it") from None
    finally:
        if not chosen:
            del os.environ["OMP_WAIT_POLICY"]
    if lib.ibp_abi_version() != ABI_VERSION or lib.ibp_format_version() != FORMAT_VERSION:
        raise NativeLibraryError(
            f"{path} implements ABI {lib.ibp_abi_version()} / format {lib.ibp_format_version()}, "
            f"this package needs ABI {ABI_VERSION} / format {FORMAT_VERSION}: run `make` to rebuild it")
    threads = os.environ.get("IBP_NUM_THREADS")
    if threads:
        if not threads.strip().isdecimal() or int(threads) < 1:
            raise ValueError(f"IBP_NUM_THREADS must be a positive integer, got {threads!r}")
        lib.ibp_set_num_threads(min(int(threads), lib.IBP_MAX_THREADS))
    else:
        import torch

        lib.ibp_set_num_threads(torch.get_num_threads())
    return lib


lib = _load(library_path)

#: libibp's row-kernel sets (IBP_ISA_* in native/ibp.h), by name; lib.ibp_isa() is the one in use.
KERNEL_SETS = {"generic": lib.IBP_ISA_GENERIC, "v3": lib.IBP_ISA_V3, "v3-no-pdep": lib.IBP_ISA_V3_NO_PDEP,
               "avx512": lib.IBP_ISA_AVX512}


def _kernels_from_env() -> None:
    """$IBP_ISA picks the row kernels by name (KERNEL_SETS), as FBGEMM_ENABLE_INSTRUCTIONS
    caps FBGEMM's: to time or check the kernels another CPU would run (x86-64-v3 on an
    AVX-512 CPU), or to step around one. Unset: the best this CPU runs."""
    name = os.environ.get("IBP_ISA")
    if not name:
        return
    if name not in KERNEL_SETS:
        raise NativeLibraryError(f"IBP_ISA={name!r} names no kernel set: one of {', '.join(KERNEL_SETS)}")
    if lib.ibp_set_isa(KERNEL_SETS[name]) != lib.IBP_OK:
        runs = ", ".join(runnable_kernel_sets())
        raise NativeLibraryError(f"IBP_ISA={name}: this CPU cannot run the {name} kernels (it runs {runs})")


def runnable_kernel_sets() -> dict:
    """{name: IBP_ISA_*} of the KERNEL_SETS this CPU runs (lib.ibp_set_isa takes them)."""
    before = lib.ibp_isa()
    try:
        return {name: isa for name, isa in KERNEL_SETS.items() if lib.ibp_set_isa(isa) == lib.IBP_OK}
    finally:
        lib.ibp_set_isa(before)


_kernels_from_env()


def check(rc: int, what: str) -> None:
    """Turn a libibp return code into the matching Python exception."""
    if rc == lib.IBP_OK:
        return
    msg = f"{what}: {ffi.string(lib.ibp_error_string(rc)).decode()}"
    if rc == lib.IBP_E_INDEX:
        raise IndexError(msg)
    if rc == lib.IBP_E_CORRUPT:
        raise FormatError(msg)
    if rc == lib.IBP_E_NOMEM:
        raise MemoryError(msg)
    raise ValueError(msg)


def ptr(array, ctype: str):
    """A C pointer to a contiguous NumPy array's data (the caller keeps the array alive)."""
    return ffi.cast(ctype, ffi.from_buffer(array, require_writable=False))


def set_num_threads(n: int) -> None:
    """libibp's threads: n >= 1 (more than IBP_MAX_THREADS, 1024, run as that many)."""
    if isinstance(n, bool) or not hasattr(n, "__index__") or operator.index(n) < 1:
        raise ValueError(f"threads must be a positive integer, got {n!r}")
    lib.ibp_set_num_threads(min(operator.index(n), lib.IBP_MAX_THREADS))
