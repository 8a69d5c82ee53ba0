"""The methods of benchmarks/gpu_lookup.py: how each is timed and checked, zero-copy and cache sources, FBGEMM."""
from __future__ import annotations

import ctypes
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from benchmarks.gpu_data import Batch

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s] {msg}", flush=True)


# ---- a torch CUDA tensor over pinned host memory (zero-copy), through DLPack ----

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", _DELETER)]
_KEEP = []  # ctypes objects that must outlive the tensors made from them
_DTYPES = {torch.float32: (2, 32), torch.float16: (2, 16), torch.bfloat16: (4, 16),
           torch.uint8: (1, 8), torch.int64: (0, 64)}
KDL_CUDA = 2


def tensor_from_pointer(ptr: int, shape, dtype: torch.dtype, device_id: int, owner=None) -> torch.Tensor:
    """A CUDA tensor over memory at `ptr` (C-contiguous `shape` of `dtype`), no copy:
    with the device pointer of registered host memory, torch's kernels read it over PCIe."""
    shape_arr = (ctypes.c_int64 * len(shape))(*shape)
    mt = _DLManagedTensor()
    mt.dl_tensor.data = ptr
    mt.dl_tensor.device = _DLDevice(KDL_CUDA, device_id)
    mt.dl_tensor.ndim = len(shape)
    code, bits = _DTYPES[dtype]
    mt.dl_tensor.dtype = _DLDataType(code, bits, 1)
    mt.dl_tensor.shape = shape_arr
    mt.dl_tensor.strides = None
    mt.dl_tensor.byte_offset = 0
    mt.manager_ctx = None
    mt.deleter = _DELETER(lambda _p: None)
    _KEEP.append((mt, shape_arr, owner))
    capsule_new = ctypes.pythonapi.PyCapsule_New
    capsule_new.restype = ctypes.py_object
    capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return torch.utils.dlpack.from_dlpack(capsule_new(ctypes.addressof(mt), b"dltensor", None))


# ---- methods ----

@dataclass
class Method:
    name: str
    run: object                 # run(batch) -> [B, D] float32 on the device
    exact: bool                 # sums in libibp's order: must equal it bit for bit
    pcie: object = None         # pcie(batch) -> modeled bytes over PCIe, None: "-"
    ratio: float | None = None  # raw bytes / bytes read of the rows it reads
    dedup: bool = False
    cache: object = None        # a RowCache: warmed, timed once
    check_errors: object = None  # raise if the kernels flagged errors
    note: str = ""
    out_eps: float = 0.0        # relative rounding of the method's output dtype (torch on half tables)


@dataclass
class Result:
    workload: str
    method: str
    ms: float = float("nan")
    ms_min: float = float("nan")
    pcie_bytes: float | None = None
    ratio: float | None = None
    distinct: float | None = None
    dedup: bool = False
    hit_rate: float | None = None
    hbm_bytes: int | None = None
    eff_gbs: float = float("nan")
    check: str = "-"
    ok: bool = True
    note: str = ""
    extra: dict = field(default_factory=dict)


class Clock:
    """CUDA events on a GPU, wall time under --emulate."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, body) -> float:
        """Milliseconds of body()."""
        if self.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            body()
            e.record()
            e.synchronize()
            return s.elapsed_time(e)
        t0 = time.perf_counter()
        body()
        return (time.perf_counter() - t0) * 1e3


def check_result(got: torch.Tensor, b: Batch, exact: bool, out_eps: float = 0.0) -> tuple[bool, str, float]:
    """(ok, description, max error / tolerance) of a result against libibp's.

    Summed in another order, a result differs from libibp's by rounding errors
    that scale with the sum of |terms| (b.bound), not with the result: tolerance
    1e-5 of that, plus the output's own rounding (out_eps) for half outputs."""
    got = got.to(b.ref.device)
    if got.shape != b.ref.shape:
        return False, f"shape {tuple(got.shape)}", float("inf")
    if torch.equal(got, b.ref):
        return True, "exact", 0.0
    tol = 1e-5 * (b.ref.abs() + b.bound) + out_eps * b.ref.abs() + 1e-30
    worst = float(((got.double() - b.ref.double()).abs() / tol.double()).max())
    if exact:
        return False, f"NOT bit-exact (err/tol {worst:.2g})", worst
    return worst <= 1.0, (f"ok, err/tol {worst:.2g}" if worst <= 1.0 else f"FAIL err/tol {worst:.2g}"), worst


def run_method(m: Method, timed: list[Batch], warm: list[Batch], clock: Clock, repeats: int,
               workload: str, row_bytes: int, distinct: float) -> Result:
    r = Result(workload, m.name, dedup=m.dedup, distinct=distinct, ratio=m.ratio, note=m.note)
    n_ids = statistics.mean(b.idx.size for b in timed)
    try:
        outs = []
        if m.cache is not None:
            for b in warm:  # warm on other batches of the same distribution
                m.run(b)
            clock.sync()
            m.cache.reset_stats()
            fetched0 = m.cache.table.fetched_bytes()
            r.ms = r.ms_min = clock.time(lambda: outs.extend(m.run(b) for b in timed)) / len(timed)
            r.hit_rate = m.cache.hit_rate
            r.pcie_bytes = (m.cache.table.fetched_bytes() - fetched0) / len(timed)
            r.hbm_bytes = m.cache.nbytes + m.cache.table.hbm_bytes
            r.note = ", ".join(x for x in (r.note, f"{r.hbm_bytes / 2**20:.1f} MiB HBM") if x)
            r.extra["cache"] = m.cache.stats()
        else:
            for b in timed:  # first calls: allocations, lazy module loading
                m.run(b)
            clock.sync()
            times = [clock.time(lambda: [m.run(b) for b in timed]) / len(timed) for _ in range(repeats)]
            r.ms, r.ms_min = statistics.median(times), min(times)
            r.extra["times_ms"] = times
            if m.pcie is not None:
                r.pcie_bytes = statistics.mean(m.pcie(b) for b in timed)
            outs = [m.run(b) for b in timed]  # the results checked (stateless: the same as timed)
        if m.check_errors is not None:
            m.check_errors()
        worst, descs, ok = 0.0, set(), True
        for b, out in zip(timed, outs):
            good, desc, err = check_result(out, b, m.exact, m.out_eps)
            ok &= good
            worst = max(worst, err)
            descs.add(desc.split(" (")[0].split(",")[0])
        r.ok = ok
        r.check = "exact" if descs == {"exact"} else \
            (f"ok, err/tol {worst:.2g}" if ok else f"FAIL ({', '.join(sorted(descs))}; err/tol {worst:.2g})")
    except Exception as e:  # noqa: BLE001 - one method's failure must not stop the others
        r.ok = False
        r.check = f"FAIL: {type(e).__name__}: {str(e)[:160]}"
        log(f"{m.name} failed: {type(e).__name__}: {e}")
    r.eff_gbs = n_ids * row_bytes / (r.ms / 1e3) / 1e9 if r.ms == r.ms else float("nan")
    return r


class CountingSource:
    """A RowCache source that counts the bytes its fetches move (the modeled PCIe bytes)."""

    def __init__(self, inner, bytes_per_row: np.ndarray, device: torch.device, hbm_bytes: int = 0):
        self.inner = inner
        self.shape, self.dtype = tuple(inner.shape), inner.dtype
        self.device = device
        self._bytes = torch.as_tensor(bytes_per_row, dtype=torch.int64, device=device)
        self._count = torch.zeros((), dtype=torch.int64, device=device)
        self.hbm_bytes = hbm_bytes

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.device)
        self._count += self._bytes[ids].sum()
        if hasattr(self.inner, "check"):  # a CudaTable: stay asynchronous, errors are read after
            return self.inner.gather(ids, check=False)
        return self.inner.gather(ids)

    def fetched_bytes(self) -> int:
        return int(self._count)


class RawSource:
    """Raw rows as a RowCache source: gather = index_select (over PCIe for zero-copy rows)."""

    def __init__(self, w: torch.Tensor):
        self.w, self.shape, self.dtype, self.device = w, tuple(w.shape), w.dtype, w.device

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w.index_select(0, ids.to(self.w.device))


def fbgemm_methods(args, w, dev, n, dim, dtype, raw_read) -> list[Method]:
    """FBGEMM TBE placements, where fbgemm_gpu's CUDA build imports (not on the lent GPU machine)."""
    try:
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (CacheAlgorithm,
                                                                          EmbeddingLocation)
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)
    except Exception as e:  # noqa: BLE001
        log(f"fbgemm_gpu unavailable ({type(e).__name__}: {e}): FBGEMM methods skipped")
        return []
    out = []
    for loc in ("DEVICE", "MANAGED", "MANAGED_CACHING"):
        try:
            kw = dict(embedding_specs=[(n, dim, getattr(EmbeddingLocation, loc), ComputeDevice.CUDA)],
                      weights_precision=SparseType.FP32 if dtype == torch.float32 else SparseType.FP16,
                      output_dtype=SparseType.FP32, device=dev)
            if loc == "MANAGED_CACHING":
                kw.update(cache_load_factor=args.cache_load_factor, cache_algorithm=CacheAlgorithm.LRU)
            tbe = SplitTableBatchedEmbeddingBagsCodegen(**kw)
            with torch.no_grad():
                tbe.split_embedding_weights()[0].copy_(w.to(tbe.split_embedding_weights()[0].dtype))

            def run(b, tbe=tbe):
                with torch.no_grad():
                    return tbe(b.idx_t, b.off_t).float()
            out.append(Method(f"FBGEMM {loc}", run, False, raw_read if loc == "MANAGED" else None))
        except Exception as e:  # noqa: BLE001
            log(f"FBGEMM {loc} unavailable: {type(e).__name__}: {e}")
    return out
