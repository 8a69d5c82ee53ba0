"""IBP tables on a CUDA device: the GPU path of the TorchRec module and the DMP kernel.

Inference: the compressed rows stay in host memory. :class:`DeviceTable` places a
table with :func:`ibp_embed.cuda.place` (codebook and offsets index in HBM, payload
pinned in place and read zero-copy over PCIe); the CUDA library deduplicates a batch's
ids, decodes each distinct row once with warp-parallel bit operations and pools on the
device. An optional :class:`~ibp_embed.cache.RowCache` of hot decoded rows sits in HBM
in front of it, sized as a fraction of the table's rows (TorchRec's
``cache_load_factor``, as for ``fused_uvm_caching``).

Training: the rows live in libibp's store on the host (an UpdatableTable), which the
optimizer rewrites, so the device cannot read them zero-copy; forward pools there and
moves the output to the device. Backward reduces the pooled gradients to one gradient
per distinct row on the device (:func:`reduce_row_gradients`) and copies only those
[distinct rows, dim] to the host, where the store applies the optimizer step: the same
code as on the CPU.

While :mod:`ibp_embed.cuda` emulates (``IBP_CUDA_EMULATE=1``), all of this runs on the
host, CPU tensors standing for device ones, so it is tested without a GPU.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from .. import cuda
from ..cache import POLICIES, RowCache
from ..table import CompressedTable, check_real_weights

__all__ = ["DeviceTable", "check_device", "device_pooled_lookup", "reduce_row_gradients"]


def check_device(device) -> torch.device:
    """`device` (a CUDA device) with its index; raises ibp_embed.cuda.NoCudaDeviceError
    ("no CUDA device: ...") where none is usable, unless ibp_embed.cuda emulates."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"expected a CUDA device, not {dev}")
    if not cuda.emulating():
        cuda.require_device()
    if dev.index is None:
        dev = torch.device("cuda", 0 if cuda.emulating() else torch.cuda.current_device())
    return dev


_CACHE_POLICIES = {"LRU": "lru", "LFU": "lfu"}


def cache_options(cache_load_factor: Optional[float], cache_algorithm=None) -> dict:
    """TorchRec's cache settings (cache_load_factor, FBGEMM's CacheAlgorithm LRU / LFU or
    its name; None: LRU) as DeviceTable's keyword arguments, checked."""
    name = getattr(cache_algorithm, "name", cache_algorithm)
    policy = "lru" if name is None else _CACHE_POLICIES.get(str(name).upper())
    if policy is None:
        raise ValueError(f"cache_algorithm {cache_algorithm!r} is not supported (LRU or LFU)")
    check_cache_options(cache_load_factor, policy)
    return {"cache_load_factor": cache_load_factor, "cache_policy": policy}


def check_cache_options(cache_load_factor: Optional[float], cache_policy: str) -> None:
    if cache_load_factor is not None and not 0.0 <= float(cache_load_factor) <= 1.0:
        raise ValueError(f"cache_load_factor must be in [0, 1] (a fraction of each table's rows), "
                         f"not {cache_load_factor!r}")
    if cache_policy not in POLICIES:
        raise ValueError(f"cache_policy must be one of {POLICIES}, not {cache_policy!r}")


class DeviceTable:
    """A CompressedTable placed on CUDA device `device`, behind an optional HBM RowCache
    holding ``cache_load_factor`` x its rows (none when None or 0)."""

    def __init__(self, table: CompressedTable, device, cache_load_factor: Optional[float] = None,
                 cache_policy: str = "lru"):
        check_cache_options(cache_load_factor, cache_policy)
        self.device = check_device(device)
        self.storage = cuda.storage_device(self.device)  # where its tensors live
        self.placed = cuda.place(table, self.device)
        self.cache = None
        if cache_load_factor and int(cache_load_factor * table.shape[0]) > 0:
            self.cache = RowCache(self.placed, load_factor=cache_load_factor, policy=cache_policy,
                                  device=self.storage)

    @property
    def table(self) -> CompressedTable:
        return self.placed.table

    @property
    def shape(self):
        return self.placed.shape

    def lookup(self, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor],
               mode: str) -> torch.Tensor:
        """[B, dim] float32 on the device: through the cache when there is one, else
        decoded by the CUDA library (each distinct id of the batch once)."""
        if self.cache is not None:
            return self.cache.lookup(indices, offsets, weights, mode)
        return self.placed.lookup(indices, offsets, weights, mode, dedup=True)

    def cache_stats(self) -> Optional[dict]:
        return None if self.cache is None else self.cache.stats()

    @property
    def cache_nbytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes

    @property
    def device_nbytes(self) -> int:
        """Device memory it holds: the placed table's (codebook, offsets index) and the cache's."""
        return int(self.placed.info()["device_bytes"]) + self.cache_nbytes

    def close(self) -> None:
        self.cache = None
        self.placed.close()

    def __repr__(self) -> str:
        cache = "" if self.cache is None else f", cache={self.cache!r}"
        return f"DeviceTable({self.placed!r}{cache})"


def device_pooled_lookup(kjt: KeyedJaggedTensor, slots: Sequence, weighted: bool, who: str,
                         key_index: Optional[Sequence[int]] = None) -> torch.Tensor:
    """[B, sum(slot dims)] float32 on the slots' device: slot i pools key key_index[i]
    (default: key i) of `kjt` in its DeviceTable (slot.table). The ids stay on the device;
    index and offset errors are raised by the lookups, naming the feature."""
    from .lookup import check_kjt

    check_kjt(kjt, weighted, who)
    if key_index is None:
        key_index = range(len(slots))
    storage = slots[0].table.storage if slots else torch.device("cpu")
    b = kjt.stride()
    values = kjt.values().to(storage, torch.int64)
    offsets = kjt.offsets().to(storage, torch.int64)
    n_keys = len(kjt.keys())
    if offsets.numel() != n_keys * b + 1:
        raise ValueError(f"{who}: offsets have {offsets.numel()} entries, expected "
                         f"{n_keys} keys x batch {b} + 1 = {n_keys * b + 1}")
    weights = kjt.weights_or_none()
    if weights is not None:
        check_real_weights(weights, who)
        weights = weights.to(storage, torch.float32)
        if weights.numel() != values.numel():
            raise ValueError(f"{who}: {weights.numel()} weights for {values.numel()} ids")
    if b == 0:
        return torch.empty((0, sum(s.dim for s in slots)), dtype=torch.float32, device=storage)
    bounds = offsets[::b].tolist()  # where each key's values start (one small copy)
    outs = []
    for s, k in zip(slots, key_index):
        lo, hi = bounds[k], bounds[k + 1]
        if not 0 <= lo <= hi <= values.numel():
            raise ValueError(f"{who}: offsets of feature {s.feature!r} run from {lo} to {hi}, outside "
                             f"0 .. len(values) = {values.numel()}")
        try:
            outs.append(s.table.lookup(values[lo:hi], offsets[k * b:(k + 1) * b + 1] - lo,
                                       None if weights is None else weights[lo:hi], s.mode))
        except (IndexError, ValueError, TypeError) as e:
            raise type(e)(f"{who}: feature {s.feature!r} of table {s.table_name!r}: {e}") from None
    if not outs:
        return torch.empty((b, 0), dtype=torch.float32, device=storage)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def reduce_row_gradients(items, b: int, grad_out: torch.Tensor, mode: str, dim: int):
    """One table's row gradients, reduced where grad_out lives (the device).

    items: [(ids, bag offsets [B+1] from 0, weights or None, output column)], one per
    feature that read the table (numpy, as the host forward saw them). Each occurrence
    contributes its bag's output gradient times its scale (weight, and 1/L for MEAN: in
    double, rounded once, as libibp and FBGEMM compute it). Returns (distinct ids,
    ascending, int64 numpy; their summed gradients [U, dim] float32 on the host).
    """
    dev = grad_out.device
    ids_parts, grad_parts = [], []
    for ids, off, ws, col in items:
        if not ids.size:
            continue
        lengths = np.diff(off)
        bag = torch.from_numpy(np.repeat(np.arange(b, dtype=np.int64), lengths)).to(dev)
        g = grad_out[bag, col:col + dim]
        if ws is not None or mode == "mean":
            scale = np.ones(ids.size) if ws is None else ws.astype(np.float64)
            if mode == "mean":
                scale = scale * (1.0 / np.repeat(np.maximum(lengths, 1), lengths))
            g = g * torch.from_numpy(scale.astype(np.float32)).to(dev)[:, None]
        ids_parts.append(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(dev))
        grad_parts.append(g)
    if not ids_parts:
        return np.empty(0, dtype=np.int64), torch.empty((0, dim), dtype=torch.float32)
    uniq, inv = torch.unique(torch.cat(ids_parts), sorted=True, return_inverse=True)
    rows = torch.zeros((uniq.numel(), dim), dtype=torch.float32, device=dev)
    rows.index_add_(0, inv, torch.cat(grad_parts).to(torch.float32))
    return uniq.cpu().numpy(), rows.cpu()
