"""The CUDA path: CompressedTables decoded on a GPU (native/cuda, libibp_cuda.so).

cffi ABI binding of native/build/libibp_cuda.so (or $IBP_CUDA_LIBRARY); the cdef
is the CFFI block of native/cuda/ibp_cuda.h on top of native/ibp.h's, so a
CompressedTable's C struct is passed as is. The library links cudart
statically and loads on machines without a GPU; placing a table on a CUDA
device there raises :class:`NoCudaDeviceError` ("no CUDA device: ...").

:class:`CudaTable` is a CompressedTable placed on a device: the small metadata
(codebook and offsets index) is copied to device memory; the payload is pinned
in place (cudaHostRegister) and read by the kernels zero-copy over PCIe
(``placement="host"``, the default), or copied to device memory
(``placement="device"``). ``gather`` and ``lookup`` take and return CUDA tensors
and run on the current torch stream.

Host emulation, selected explicitly (``IBP_CUDA_EMULATE=1`` in the environment, or
``with ibp_embed.cuda.emulation():``): :func:`place` then returns an
:class:`EmulatedCudaTable`, which has CudaTable's interface but computes every result
with the kernels' per-lane code on the host (native/cuda/emulate.cu), CPU tensors
standing for device ones (:func:`storage_device`). Everything above the device
(TorchRec modules and kernels on "cuda", caches, KeyedTensor layout) then runs and is
tested on machines without a GPU; only the kernels' scheduling differs.
"""
from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import cffi
import numpy as np
import torch

from . import _native
from .dtypes import LOOKUP_DTYPES
from .errors import FormatError, NativeLibraryError
from .table import CompressedTable, _as_float_array, check_real_weights

_ROOT = Path(__file__).resolve().parent.parent
_HEADER = _ROOT / "native" / "cuda" / "ibp_cuda.h"
_LIBRARY = _ROOT / "native" / "build" / "libibp_cuda.so"

ABI_VERSION = 2

PLACEMENTS = {"host": 0, "device": 1}
_PAYLOAD_MODES = {1: "registered", 2: "shared", 3: "pinned_copy", 4: "device_copy"}
_MODES = {"sum": 0, "mean": 1}


class NoCudaDeviceError(RuntimeError):
    """No CUDA device (or no usable driver): the CUDA path cannot run here."""


class CudaError(RuntimeError):
    """A CUDA runtime error reported by libibp_cuda."""


ffi = cffi.FFI()
ffi.include(_native.ffi)  # ibp_table and friends, shared with the CPU binding
ffi.cdef(_native.header_cdef(_HEADER))

_lock = threading.Lock()
_lib = None
_lib_path: Path | None = None
_emulate = os.environ.get("IBP_CUDA_EMULATE", "") == "1"


def emulating() -> bool:
    """Whether CUDA tables are emulated on the host (see the module docstring)."""
    return _emulate


@contextlib.contextmanager
def emulation(enabled: bool = True):
    """Emulate CUDA tables on the host (or not) inside the block."""
    global _emulate
    old, _emulate = _emulate, bool(enabled)
    try:
        yield
    finally:
        _emulate = old


def storage_device(device) -> torch.device:
    """Where the tensors of CUDA device `device` live: the device itself, or the CPU while
    emulating."""
    dev = torch.device(device)
    return torch.device("cpu") if dev.type == "cuda" and _emulate else dev


def place(table, device="cuda", placement: str = "host"):
    """`table` placed on CUDA device `device`: a CudaTable, or an EmulatedCudaTable while
    emulating. Raises NoCudaDeviceError ("no CUDA device: ...") where there is none."""
    cls = EmulatedCudaTable if _emulate else CudaTable
    return cls(table, device, placement)


def library_path() -> Path:
    return Path(os.environ.get("IBP_CUDA_LIBRARY", _LIBRARY))


def load_library(path=None):
    """Load (once) and return libibp_cuda.

    `path` overrides $IBP_CUDA_LIBRARY and the default, and becomes the library
    later calls without a path return.
    """
    global _lib, _lib_path
    with _lock:
        if path is None and _lib is not None:
            return _lib
        want = Path(path) if path is not None else library_path()
        if _lib is not None and _lib_path == want:
            return _lib
        if not want.exists():
            raise NativeLibraryError(
                f"the CUDA library {want} is missing: run `make cuda` in {_ROOT} (needs nvcc)")
        try:
            lib = ffi.dlopen(str(want))
        except OSError as e:
            raise NativeLibraryError(f"cannot load {want} ({e}): run `make cuda` to rebuild it") from None
        if lib.ibp_cuda_abi_version() != ABI_VERSION or \
                lib.ibp_cuda_format_version() != _native.FORMAT_VERSION:
            raise NativeLibraryError(
                f"{want} implements ABI {lib.ibp_cuda_abi_version()} / format "
                f"{lib.ibp_cuda_format_version()}, this package needs ABI {ABI_VERSION} / format "
                f"{_native.FORMAT_VERSION}: run `make cuda` to rebuild it")
        _lib, _lib_path = lib, want
        return lib


def _message(lib) -> str:
    return ffi.string(lib.ibp_cuda_last_error()).decode(errors="replace")


def check(rc: int, what: str, lib=None) -> None:
    """Turn a libibp_cuda return code into the matching Python exception."""
    if rc == 0:
        return
    lib = lib or load_library()
    detail = _message(lib) or ffi.string(lib.ibp_cuda_error_string(rc)).decode()
    msg = f"{what}: {detail}"
    if rc == lib.IBP_CUDA_E_NO_DEVICE:
        raise NoCudaDeviceError(detail if detail.startswith("no CUDA device") else
                                f"no CUDA device: {msg}")
    if rc == lib.IBP_CUDA_E_INDEX:
        raise IndexError(msg)
    if rc == lib.IBP_CUDA_E_CORRUPT:
        raise FormatError(msg)
    if rc == lib.IBP_CUDA_E_NOMEM:
        raise MemoryError(msg)
    if rc in (lib.IBP_CUDA_E_ARG, lib.IBP_CUDA_E_OFFSETS):
        raise ValueError(msg)
    raise CudaError(msg)


def device_count() -> int:
    """CUDA devices libibp_cuda sees (0 when there is none or no driver)."""
    lib = load_library()
    n = ffi.new("int *")
    return int(n[0]) if lib.ibp_cuda_device_count(n) == 0 else 0


def require_device() -> None:
    """Raise NoCudaDeviceError, naming the reason, unless a CUDA device is usable here."""
    try:
        lib = load_library()
    except NativeLibraryError as e:
        if not torch.cuda.is_available():
            raise NoCudaDeviceError(
                f"no CUDA device: torch.cuda.is_available() is False, and {e}") from None
        raise
    n = ffi.new("int *")
    check(lib.ibp_cuda_device_count(n), "CUDA device query", lib)
    if not torch.cuda.is_available():
        raise NoCudaDeviceError(
            f"no CUDA device usable by torch {torch.__version__} (torch.cuda.is_available() is "
            f"False) although the CUDA runtime sees {n[0]}")


def _stream(device: torch.device):
    return ffi.cast("void *", torch.cuda.current_stream(device).cuda_stream)


class _Placed:
    """What CudaTable and EmulatedCudaTable share: the host table they were placed from."""

    def __init__(self, table, device, placement: str) -> None:
        if not isinstance(table, CompressedTable):
            raise TypeError(f"expected a CompressedTable, not {type(table).__name__}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {sorted(PLACEMENTS)}, not {placement!r}")
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"a CUDA table needs a CUDA device, not {dev}")
        self._table, self._placement = table, placement

    @property
    def shape(self) -> tuple[int, int]:
        return self._table.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._table.dtype

    @property
    def table(self):
        """The host CompressedTable this was placed from."""
        return self._table

    def __len__(self) -> int:
        return self._table.shape[0]

    def _check_lookup(self, mode: str) -> None:
        if self.dtype not in LOOKUP_DTYPES:
            raise TypeError(f"pooled lookup needs a float32, float16 or bfloat16 table, not {self.dtype}")
        if mode not in _MODES:
            raise ValueError(f"mode must be 'sum' or 'mean', not {mode!r}")


class CudaTable(_Placed):
    """A CompressedTable placed on a CUDA device (see the module docstring).

    The CompressedTable must stay unchanged while this exists (it is kept
    referenced; with placement "host" the kernels read its payload in place).
    Index and data errors found on the device are raised after a stream
    synchronization when ``check=True`` (the default); with ``check=False``
    calls stay asynchronous and :meth:`check` reports them later.
    """

    def __init__(self, table, device="cuda", placement: str = "host"):
        super().__init__(table, device, placement)
        require_device()
        dev = torch.device(device)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self._lib = load_library()
        self._device = dev
        out = ffi.new("ibp_cuda_table **")
        check(self._lib.ibp_cuda_table_create(table._c, dev.index, PLACEMENTS[placement], out),
              f"placing the table on {dev}", self._lib)
        self._t = out[0]

    # ---- description ----
    @property
    def device(self) -> torch.device:
        return self._device

    def info(self) -> dict:
        """Placement and kernel geometry: payload mode, device/pinned bytes, staging."""
        info = ffi.new("ibp_cuda_info *")
        check(self._lib.ibp_cuda_table_info(self._handle(), info), "table info", self._lib)
        return {
            "device": int(info.device),
            "placement": self._placement,
            "payload_mode": _PAYLOAD_MODES.get(int(info.payload_mode), "unknown"),
            "metadata_in_shared": bool(info.metadata_in_shared),
            "staged": bool(info.staged),
            "warps_per_block": int(info.warps_per_block),
            "shared_bytes": int(info.shared_bytes),
            "stage_bytes": int(info.stage_bytes),
            "device_bytes": int(info.device_bytes),
            "pinned_bytes": int(info.pinned_bytes),
        }

    def __repr__(self) -> str:
        return f"CudaTable({self._table!r}, device={self._device}, placement={self._placement!r})"

    def to(self, device, placement: str | None = None):
        """The host table for "cpu", this table for its own device, else a new placement."""
        dev = torch.device(device)
        if dev.type == "cpu":
            return self._table
        if dev.type == "cuda" and (dev.index is None or dev == self._device) and \
                placement in (None, self._placement):
            return self
        return CudaTable(self._table, dev, placement or self._placement)

    # ---- lifetime ----
    def close(self) -> None:
        """Release device memory and unpin the payload (waits for the device)."""
        t, self._t = getattr(self, "_t", None), None
        if t is not None and t != ffi.NULL:
            check(self._lib.ibp_cuda_table_destroy(t), "releasing the CUDA table", self._lib)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _handle(self):
        if self._t is None:
            raise ValueError("the CUDA table is closed")
        return self._t

    def check(self) -> None:
        """Synchronize the current stream and raise the errors the kernels recorded."""
        with torch.cuda.device(self._device):
            check(self._lib.ibp_cuda_check(self._handle(), _stream(self._device)), "check",
                  self._lib)

    # ---- reads ----
    def _index_tensor(self, x, name: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(np.asarray(x))
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must be integers, got {x.dtype}")
        return x.to(self._device, torch.int64).contiguous()

    def gather(self, indices, check: bool = True) -> torch.Tensor:
        """Rows at `indices` (any shape of integers), bit-exact, as a tensor on the device."""
        idx = self._index_tensor(indices, "indices")
        n_rows, dim = self.shape
        row_bytes = dim * self.dtype.itemsize
        flat = idx.reshape(-1)
        out = torch.empty((flat.numel(), row_bytes), dtype=torch.uint8, device=self._device)
        if flat.numel():
            flags = self._lib.IBP_CUDA_CHECK if check else 0
            with torch.cuda.device(self._device):
                rc = self._lib.ibp_cuda_gather(
                    self._handle(), ffi.cast("const int64_t *", flat.data_ptr()), flat.numel(),
                    ffi.cast("void *", out.data_ptr()), _stream(self._device), flags)
            if rc == self._lib.IBP_CUDA_E_INDEX:
                _raise_range(flat, n_rows)
            check(rc, "gather", self._lib)
        return out.view(self.dtype).reshape(*idx.shape, dim)

    def lookup(self, indices, offsets, per_sample_weights=None, mode: str = "sum", *,
               dedup: bool = True, check: bool = True) -> torch.Tensor:
        """Pooled lookup on the device, as CompressedTable.lookup: a [B, D] float32 tensor.

        dedup: sort and deduplicate the batch's ids on the device and decode each
        distinct row once (else each bag's rows are decoded as they come).
        """
        self._check_lookup(mode)
        idx = self._index_tensor(indices, "indices")
        if idx.dim() != 1:
            raise ValueError("indices must be 1-D")
        off = self._index_tensor(offsets, "offsets")
        if off.dim() != 1 or off.numel() < 1:
            raise ValueError("offsets must be 1-D with B + 1 entries")
        w = None
        if per_sample_weights is not None:
            w = per_sample_weights
            if isinstance(w, torch.Tensor):
                check_real_weights(w)
            else:
                w = torch.from_numpy(_as_float_array(w))
            w = w.to(self._device, torch.float32).contiguous().reshape(-1)
            if w.numel() != idx.numel():
                raise ValueError(f"per_sample_weights has {w.numel()} entries, indices {idx.numel()}")
        n_bags = off.numel() - 1
        dim = self.shape[1]
        out = torch.empty((n_bags, dim), dtype=torch.float32, device=self._device)
        if not n_bags:
            return out
        lib = self._lib
        flags = (lib.IBP_CUDA_DEDUP if dedup else 0) | (lib.IBP_CUDA_CHECK if check else 0)
        with torch.cuda.device(self._device):
            need = ffi.new("uint64_t *")
            check(lib.ibp_cuda_lookup_workspace(self._handle(), idx.numel(), flags, need),
                     "lookup workspace", lib)
            ws = torch.empty(int(need[0]), dtype=torch.uint8, device=self._device) if need[0] else None
            rc = lib.ibp_cuda_lookup(
                self._handle(), LOOKUP_DTYPES[self.dtype], dim,
                ffi.cast("const int64_t *", idx.data_ptr()) if idx.numel() else ffi.NULL,
                idx.numel(), ffi.cast("const int64_t *", off.data_ptr()), n_bags,
                ffi.cast("const float *", w.data_ptr()) if w is not None and w.numel() else ffi.NULL,
                _MODES[mode], ffi.cast("float *", out.data_ptr()),
                ffi.cast("void *", ws.data_ptr()) if ws is not None else ffi.NULL,
                int(need[0]), _stream(self._device), flags)
        if rc == lib.IBP_CUDA_E_INDEX:
            _raise_range(idx, self.shape[0])
        check(rc, "lookup", lib)
        return out


class EmulatedCudaTable(_Placed):
    """CudaTable's interface on the host: results come from the kernels' per-lane code
    (emulate_gather / emulate_lookup), as CPU tensors standing for device ones."""

    def __init__(self, table, device="cuda", placement: str = "host"):
        super().__init__(table, device, placement)
        load_library()  # the emulation lives in libibp_cuda
        self.target = torch.device("cuda", torch.device(device).index or 0)

    @property
    def device(self) -> torch.device:
        """Where its results live: the CPU (standing for self.target)."""
        return torch.device("cpu")

    def info(self) -> dict:
        """The device bytes libibp_cuda would allocate for this placement (the metadata
        block, and the payload too with placement "device"); pinned bytes are 0 (the
        payload would be registered in place)."""
        lib = load_library()
        out = ffi.new("uint64_t *")
        check(lib.ibp_cuda_table_device_bytes(self._table._c, PLACEMENTS[self._placement], out),
              "device bytes", lib)
        return {"device": self.target.index, "placement": self._placement, "emulated": True,
                "device_bytes": int(out[0]), "pinned_bytes": 0}

    def __repr__(self) -> str:
        return f"EmulatedCudaTable({self._table!r}, device={self.target}, placement={self._placement!r})"

    def close(self) -> None:
        pass

    def check(self) -> None:
        pass  # errors are raised by every call

    @staticmethod
    def _index_tensor(x, name: str) -> torch.Tensor:
        x = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must be integers, got {x.dtype}")
        return x.to("cpu", torch.int64)

    def gather(self, indices, check: bool = True) -> torch.Tensor:
        idx = self._index_tensor(indices, "indices")
        flat = idx.reshape(-1)
        _raise_range(flat, self.shape[0])
        return emulate_gather(self._table, flat.numpy()).reshape(*idx.shape, self.shape[1])

    def lookup(self, indices, offsets, per_sample_weights=None, mode: str = "sum", *,
               dedup: bool = True, check: bool = True) -> torch.Tensor:
        self._check_lookup(mode)
        idx, off = self._index_tensor(indices, "indices"), self._index_tensor(offsets, "offsets")
        if idx.dim() != 1 or off.dim() != 1 or off.numel() < 1:
            raise ValueError("indices must be 1-D and offsets 1-D with B + 1 entries")
        _raise_range(idx, self.shape[0])
        w = None if per_sample_weights is None else torch.from_numpy(_as_float_array(per_sample_weights))
        if w is not None and w.numel() != idx.numel():
            raise ValueError(f"per_sample_weights has {w.numel()} entries, indices {idx.numel()}")
        return emulate_lookup(self._table, idx.numpy(), off.numpy(), None if w is None else w.numpy(), mode, dedup)


def _raise_range(idx: torch.Tensor, n_rows: int) -> None:
    bad = idx[(idx < 0) | (idx >= n_rows)]
    if bad.numel():
        raise IndexError(f"row index {int(bad[0])} out of range for a table of {n_rows} rows")


# ---- the kernels' code run on the host (tests without a GPU) ----

def emulate_gather(table, indices) -> torch.Tensor:
    """What CudaTable.gather computes, by the kernels' per-lane code run on the host."""
    from .dtypes import rows_to_tensor

    lib = load_library()
    idx = np.ascontiguousarray(np.asarray(indices, dtype=np.int64)).reshape(-1)
    row_bytes = table.shape[1] * table.dtype.itemsize
    out = np.zeros((idx.size, row_bytes), dtype=np.uint8)
    if idx.size:
        check(lib.ibp_cuda_emulate_gather(table._c, ffi.cast("const int64_t *", idx.ctypes.data),
                                          idx.size, ffi.cast("uint8_t *", out.ctypes.data)),
              "emulate_gather", lib)
    return rows_to_tensor(out, table.dtype, table.shape[1])


def emulate_lookup(table, indices, offsets, per_sample_weights=None, mode: str = "sum",
                   dedup: bool = True) -> torch.Tensor:
    """What CudaTable.lookup computes, by the kernels' per-lane code run on the host."""
    lib = load_library()
    idx = np.ascontiguousarray(np.asarray(indices, dtype=np.int64)).reshape(-1)
    off = np.ascontiguousarray(np.asarray(offsets, dtype=np.int64)).reshape(-1)
    w = None if per_sample_weights is None else \
        np.ascontiguousarray(np.asarray(per_sample_weights, dtype=np.float32)).reshape(-1)
    n_bags = off.size - 1
    out = torch.zeros((n_bags, table.shape[1]), dtype=torch.float32)
    check(lib.ibp_cuda_emulate_lookup(
        table._c, LOOKUP_DTYPES[table.dtype], table.shape[1],
        ffi.cast("const int64_t *", idx.ctypes.data) if idx.size else ffi.NULL, idx.size,
        ffi.cast("const int64_t *", off.ctypes.data), n_bags,
        ffi.cast("const float *", w.ctypes.data) if w is not None and w.size else ffi.NULL,
        _MODES[mode], ffi.cast("float *", out.data_ptr()), int(dedup)), "emulate_lookup", lib)
    return out
