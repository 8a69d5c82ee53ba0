"""IBPEmbeddingBag: one compressed table of IBPEmbeddingBagCollection (nn.EmbeddingBag's role).

The packed table is held as buffers that ``torch.ops.ibp.pooled_lookup`` takes, so the
lookup traces, compiles, exports and scripts; a trainable table is an UpdatableTable
(libibp's store) looked up eagerly by the collection. On a CUDA device the buffers stay
in host memory and the table is also placed on the device (a DeviceTable: decoded by
the GPU, optionally behind an HBM cache), looked up eagerly.
"""
# No `from __future__ import annotations`: TorchScript reads the annotations as objects.
from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn

from .. import cuda
from ..dtypes import LOOKUP_DTYPES
from ..ops import table_from_tensors, table_tensors
from ..optim import SparseOptimizer, state_nbytes
from ..store import UpdatableTable
from ..table import _MODES as POOL_MODES, CompressedTable
from .device import DeviceTable
from .lookup import compress_weight
from .write_back import WriteBackTensor

# Trainable tables rebuild their masks once the stored rows grew this much (UpdatableTable).
DEFAULT_REPACK_DRIFT = 0.05
_BUFFER_DTYPES = {"masks": torch.int64, "bitvals": torch.int64, "block_base": torch.int64,
                  "rel": torch.int16, "payload": torch.uint8}


class IBPEmbeddingBag(nn.Module):
    """One compressed table, looked up by ``torch.ops.ibp.pooled_lookup``.

    The packed table is held as non-persistent buffers (``masks``, ``bitvals``,
    ``block_base``, ``rel``, ``payload``: see ibp_embed.ops) plus ``meta``, so fx,
    torch.compile and torch.export see the lookup as one operator over tensors, and
    ``.to("meta")`` / ``to_empty`` / deepcopy / pickling move or copy compressed bytes.
    The state_dict entry is TorchRec's ``weight``: the table decompressed, as is the
    ``weight`` attribute (a new tensor on every access, not a parameter).

    Trainable (after ``make_trainable``): the table is an :class:`UpdatableTable`
    (libibp's store; the buffers are then empty) and the optimizer's state (e.g.
    ``momentum1``) sits, uncompressed, in ``optimizer_state`` and in the state_dict.
    """

    # Python-side properties TorchScript must not compile (forward is scriptable).
    __jit_unused_properties__ = ["table", "trainable", "weight", "optimizer_state_nbytes", "device_table"]

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, mode: str,
                 table: Optional[CompressedTable], codec_options: Dict[str, Any], name: str = "",
                 device: Optional[torch.device] = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.dtype, self.mode, self.name = dtype, mode, name
        self.mode_code = POOL_MODES[mode]
        self.dtype_code = LOOKUP_DTYPES.get(dtype, -1)  # torch.ops.ibp.pooled_lookup_many's
        self._what = f"table {name!r}"
        self._codec_options = codec_options
        for k, dt in _BUFFER_DTYPES.items():
            self.register_buffer(k, torch.empty(0, dtype=dt, device=device), persistent=False)
        self.meta: List[int] = [self.num_embeddings, self.embedding_dim, 64, 0]
        self._table: Optional[Union[CompressedTable, UpdatableTable]] = None
        self.optimizer: Optional[SparseOptimizer] = None
        self.optimizer_state: Dict[str, torch.Tensor] = {}
        self._repack_drift: Optional[float] = None
        self.on_cuda = False  # placed on a CUDA device (see place)
        self._target: Optional[torch.device] = None
        self._cache_options: Dict[str, Any] = {}
        self._device_table: Optional[DeviceTable] = None
        if table is not None:
            self.set_table(table)

    @property
    def table(self) -> Optional[Union[CompressedTable, UpdatableTable]]:
        """The CompressedTable (over the buffers), an UpdatableTable when trainable, or
        None while the module holds no weights (meta device, or materialised empty)."""
        return self._table

    @property
    def trainable(self) -> bool:
        return self.optimizer is not None

    def make_trainable(self, optimizer: SparseOptimizer, repack_drift: Optional[float] = DEFAULT_REPACK_DRIFT
                       ) -> None:
        """Hold the table as an UpdatableTable and give it fresh optimizer state."""
        if not isinstance(optimizer, SparseOptimizer):
            raise TypeError(f"optimizer must be an ibp_embed.optim.SparseOptimizer (SGD, Adagrad, "
                            f"RowWiseAdagrad), got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self._repack_drift = repack_drift
        self.reset_state()
        if self._table is not None:
            self.set_table(self._table)

    def place(self, device: Optional[torch.device], cache_load_factor: Optional[float] = None,
              cache_policy: str = "lru") -> None:
        """Look the table up on CUDA device `device` (None: on the host again). The packed
        rows stay in host memory; an immutable table is placed on the device (a
        DeviceTable, behind an HBM RowCache of cache_load_factor x its rows when given),
        a trainable one is read by the host and its outputs moved to the device."""
        self.on_cuda = device is not None
        self._target = None if device is None else torch.device(device)
        if device is not None:  # kept while on the host, for the next move to a GPU
            self._cache_options = {"cache_load_factor": cache_load_factor, "cache_policy": cache_policy}
        self._place_table()

    def _place_table(self) -> None:
        old, self._device_table = self._device_table, None
        if old is not None:
            old.close()
        if self.on_cuda and isinstance(self._table, CompressedTable):
            self._device_table = DeviceTable(self._table, self._target, **self._cache_options)

    @property
    def device_table(self) -> Optional[DeviceTable]:
        """The table's placement on its CUDA device (None on the host, or when trainable)."""
        return self._device_table

    def reset_state(self) -> None:
        self.optimizer_state = {} if self.optimizer is None else \
            self.optimizer.init_state(self.num_embeddings, self.embedding_dim)

    def set_table(self, table: Union[CompressedTable, UpdatableTable]) -> None:
        if tuple(table.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"table {self.name!r}: compressed table has shape {tuple(table.shape)}, "
                             f"the config says ({self.num_embeddings}, {self.embedding_dim})")
        if table.dtype != self.dtype:
            raise ValueError(f"table {self.name!r}: compressed table holds {table.dtype}, "
                             f"the config says {self.dtype}")
        if self.trainable and not isinstance(table, UpdatableTable):
            table = UpdatableTable(table, repack_drift=self._repack_drift, codec_options=self._codec_options)
        self._table = table
        if isinstance(table, CompressedTable):
            tensors = table_tensors(table)
            self.meta = tensors.pop("meta")
        else:  # the store holds the rows
            tensors = {k: torch.empty(0, dtype=dt) for k, dt in _BUFFER_DTYPES.items()}
        for k, v in tensors.items():
            setattr(self, k, v)
        self._place_table()

    def load_weight(self, weight: torch.Tensor) -> None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"table {self.name!r}: weight must be a tensor, got {type(weight).__name__}")
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"table {self.name!r}: weight has shape {tuple(weight.shape)}, expected "
                             f"({self.num_embeddings}, {self.embedding_dim})")
        self.set_table(compress_weight(weight, self.dtype, self._codec_options))

    @property
    def weight(self) -> torch.Tensor:
        """The whole table decompressed: a new tensor on every access (for checkpoints and
        inspection; lookups never decompress the table). On the meta device, a meta tensor."""
        if self._table is None:
            return torch.empty((self.num_embeddings, self.embedding_dim), dtype=self.dtype, device="meta")
        return self._table.decompress()

    def forward(self, input: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor] = None, feature: str = "") -> torch.Tensor:
        """Pooled lookup as nn.EmbeddingBag's (offsets with B + 1 entries): [B, dim] float32."""
        what = self._what if feature == "" else "feature '" + feature + "' of " + self._what
        if self.on_cuda and not torch.jit.is_scripting():
            return self._device_lookup(input, offsets, per_sample_weights, what)
        self.require_host_table(what, input)
        return torch.ops.ibp.pooled_lookup(self.masks, self.bitvals, self.block_base, self.rel, self.payload,
                                           self.meta, self.dtype, input, offsets, per_sample_weights,
                                           self.mode_code, what)

    def require_host_table(self, what: str, input: torch.Tensor) -> None:
        """Raise unless the operators can read the table: packed in the buffers (or the
        input on meta), not placed on a GPU (whose lookups run eagerly)."""
        if self.on_cuda:
            raise RuntimeError(what + " is on cuda: its lookups run eagerly (script the module on the CPU)")
        if self.masks.dim() != 2 and input.device.type != "meta":  # (a raw table may have no bytes)
            if not torch.jit.is_scripting():
                raise RuntimeError(what + self._no_table_reason())
            raise RuntimeError(what + " holds no packed table")

    @torch.jit.unused
    def _device_lookup(self, input: torch.Tensor, offsets: torch.Tensor,
                       per_sample_weights: Optional[torch.Tensor], what: str) -> torch.Tensor:
        if self._device_table is None:
            raise RuntimeError(what + (" holds no weights" if self._table is None else
                                       " is trainable: look it up through the collection"))
        try:
            return self._device_table.lookup(input, offsets, per_sample_weights, self.mode)
        except (IndexError, ValueError, TypeError) as e:
            raise type(e)(f"{what}: {e}") from None

    @torch.jit.unused
    def _no_table_reason(self) -> str:
        if isinstance(self._table, UpdatableTable):
            return " is trainable: its rows are in an UpdatableTable (look it up through the collection)"
        return (" is on the meta device or was materialised empty: load weights (load_state_dict or "
                "load_compressed) before running it on real inputs")

    def _apply(self, fn, recurse=True):
        # Onto a GPU (.to("cuda"), .cuda()): the buffers stay in host memory and the table
        # is placed there. Otherwise buffers move as any module's; the table view follows.
        here = self.payload.device if not self.on_cuda else cuda.storage_device(self._target)
        there = fn(torch.empty(0, device=here)).device
        if there.type == "cuda":  # the buffers never go to the GPU
            if not self.on_cuda or there != self._target:
                self.place(there, **self._cache_options)
            return self
        if there != here and self.on_cuda:
            self.place(None)
        super()._apply(fn, recurse)
        dev = self.payload.device
        if isinstance(self._table, UpdatableTable) and dev.type == "cpu":
            return self
        if dev.type == "meta" or self.masks.dim() != 2:
            self._table = None  # moved to meta, or materialised empty (to_empty): load weights next
        elif self._table is None or self._table._payload.ctypes.data != self.payload.data_ptr():
            self._table = table_from_tensors(self._buffers, self.meta, self.dtype)
        return self

    # deepcopy and pickling copy the compressed bytes, never native handles
    def __getstate__(self):
        state = self.__dict__.copy()
        state["_device_table"] = None  # native handles: placed again on load
        table = state.pop("_table")
        if isinstance(table, UpdatableTable):
            state["_packed"] = table_tensors(table.to_table())
        return state

    def __setstate__(self, state):
        packed = state.pop("_packed", None)
        self.__dict__.update(state)
        self.__dict__.setdefault("dtype_code", LOOKUP_DTYPES.get(self.dtype, -1))  # pickled by an earlier version
        self._table = None
        if packed is not None:
            self._table = UpdatableTable(table_from_tensors(packed, packed["meta"], self.dtype),
                                         repack_drift=self._repack_drift, codec_options=self._codec_options)
        elif self.payload.device.type == "cpu" and self.masks.dim() == 2:
            self._table = table_from_tensors(self._buffers, self.meta, self.dtype)
        self._place_table()

    @property
    def optimizer_state_nbytes(self) -> int:
        return state_nbytes(self.optimizer_state)

    def extra_repr(self) -> str:
        opt = f", optimizer={self.optimizer!r}" if self.trainable else ""
        return (f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}, mode={self.mode!r}, "
                f"table={self.table!r}{opt}")

    # state_dict integration: a virtual "weight" entry (+ the optimizer state, when trainable).
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        weight = self.weight
        if weight.device.type != "meta":  # in-place changes of it re-compress the table
            weight = WriteBackTensor(weight, self, "load_weight")
        destination[prefix + "weight"] = weight
        for k, v in self.optimizer_state.items():
            destination[prefix + k] = v.detach()  # the live state, as torch's state_dicts

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight"
        state_keys = {prefix + k for k in self.optimizer_state}
        for k in state_dict:
            if k.startswith(prefix) and k != key and k not in state_keys and strict:
                unexpected_keys.append(k)
        for k in self.optimizer_state:  # optional: a plain TorchRec checkpoint has none
            if prefix + k in state_dict:
                self.load_state_tensor(k, state_dict[prefix + k])
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value = state_dict[key]
        self.check_weight(key, value)
        self.set_table(compress_weight(value, self.dtype, self._codec_options))

    def check_state_tensor(self, name: str, value) -> None:
        cur = self.optimizer_state.get(name)
        if cur is None:
            raise RuntimeError(f"table {self.name!r}: unexpected optimizer state {name!r} "
                               f"(the optimizer keeps {sorted(self.optimizer_state)})")
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(cur.shape):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise RuntimeError(f"table {self.name!r}: optimizer state {name!r} has shape {shape}, "
                               f"expected {tuple(cur.shape)}")

    def load_state_tensor(self, name: str, value) -> None:
        self.check_state_tensor(name, value)
        self.optimizer_state[name].copy_(torch.as_tensor(value).to("cpu", torch.float32))

    def check_weight(self, key: str, value) -> None:
        # Errors raise at once rather than going to error_msgs: DistributedModelParallel's
        # load_state_dict drops error_msgs, and a bad table must not load silently.
        if not isinstance(value, torch.Tensor) or type(value).__name__ in ("ShardedTensor", "DTensor"):
            raise RuntimeError(f"{key}: expected a plain tensor, got {type(value).__name__}")
        if tuple(value.shape) != (self.num_embeddings, self.embedding_dim):
            raise RuntimeError(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} "
                               f"from checkpoint, the shape in current model is "
                               f"{(self.num_embeddings, self.embedding_dim)}.")
        if value.device.type == "meta":
            raise RuntimeError(f"{key}: the checkpoint holds a meta tensor (no values)")
