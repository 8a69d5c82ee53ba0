"""Pooled lookups over a KeyedJaggedTensor, shared by IBPEmbeddingBagCollection and the
DMP kernel: KJT validation, per-feature jobs, the native lookup, and the autograd
function that applies the sparse optimizer in backward.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Dict, Optional, Sequence

import numpy as np
import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..codec import compress
from ..packed_jobs import PackedJobs
from ..batched import _lookup_many_checked, keyed_layout
from ..table import CompressedTable, _id_out_of_range

# Codec options accepted by the modules and passed to ibp_embed.compress.
CODEC_OPTIONS = ("word_bits", "clusters", "threshold", "sample_rows", "seed", "progress", "allow_raw")

_DATA_TYPES = {
    DataType.FP32.value: torch.float32,
    DataType.FP16.value: torch.float16,
    DataType.BF16.value: torch.bfloat16,
}
_POOLING_MODES = {PoolingType.SUM.value: "sum", PoolingType.MEAN.value: "mean"}

class FeatureKeyError(KeyError):
    """A KeyedJaggedTensor lacks a feature the module needs, or carries one it does not know."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


def check_codec_options(options: Dict[str, Any]) -> Dict[str, Any]:
    unknown = sorted(set(options) - set(CODEC_OPTIONS))
    if unknown:
        raise TypeError(f"unknown codec option(s) {unknown}; expected some of {list(CODEC_OPTIONS)}")
    return dict(options)


def table_dtype(config: EmbeddingBagConfig) -> torch.dtype:
    dtype = _DATA_TYPES.get(config.data_type.value)
    if dtype is None:
        raise ValueError(f"table {config.name!r}: data_type {config.data_type.value} is not supported "
                         f"(use FP32, FP16 or BF16)")
    return dtype


def pooling_mode(config_or_pooling) -> str:
    pooling = getattr(config_or_pooling, "pooling", config_or_pooling)
    mode = _POOLING_MODES.get(pooling.value)
    if mode is None:
        raise ValueError(f"pooling {pooling.value} is not supported (use SUM or MEAN)")
    return mode


def resolve_device(device) -> torch.device:
    """cpu, meta or cuda (default: torch's default device, so ``with torch.device("meta")``
    builds meta modules). A CUDA device must be usable (ibp_embed.cuda.NoCudaDeviceError
    otherwise) unless ibp_embed.cuda emulates it."""
    device = torch.empty(0).device if device is None else torch.device(device)
    if device.type == "cuda":
        from .device import check_device

        return check_device(device)
    if device.type not in ("cpu", "meta"):
        raise ValueError(f"device {device} is not supported (use 'cpu', 'cuda' or 'meta')")
    return device


# ---------------------------------------------------------------------------
# Pooled lookups over a KeyedJaggedTensor
# ---------------------------------------------------------------------------

class Slot:
    """What the key at one position of an input KJT is looked up in."""

    __slots__ = ("table", "mode", "dim", "n_rows", "feature", "table_name")

    def __init__(self, table: Optional[CompressedTable], mode: str, dim: int, n_rows: int,
                 feature: str, table_name: str):
        self.table, self.mode, self.dim, self.n_rows = table, mode, dim, n_rows
        self.feature, self.table_name = feature, table_name


def check_kjt(kjt: KeyedJaggedTensor, weighted: bool, who: str) -> None:
    """What every lookup needs of an input KJT: fixed batch size, integer ids, weights iff
    the module is weighted."""
    if kjt.variable_stride_per_key():
        raise NotImplementedError(f"{who}: variable batch size per feature (VBE) is not supported")
    inv = kjt.inverse_indices_or_none()
    if inv is not None:
        raise NotImplementedError(f"{who}: KeyedJaggedTensor inverse indices (VBE) are not supported")
    values = kjt.values()
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise TypeError(f"{who}: ids must be integers, got {values.dtype}")
    weights = kjt.weights_or_none()
    if weighted and weights is None:
        raise ValueError(f"{who} is weighted (is_weighted=True) but the KeyedJaggedTensor has no weights")
    if not weighted and weights is not None:
        raise ValueError(f"{who} is unweighted (is_weighted=False) but the KeyedJaggedTensor carries "
                         f"weights; build the module with is_weighted=True or drop the weights")
    warn_if_weights_need_grad(weights, who)


def warn_if_weights_need_grad(weights: Optional[torch.Tensor], who: str) -> None:
    """Per-sample weights that require grad get none from the lookups that detach them
    (trainable tables, the sharded kernel, tables on cuda): say so rather than drop it
    silently. (An IBPEmbeddingBagCollection for inference on the CPU sends such weights
    to its operator, which gives them their gradient.)"""
    if weights is not None and weights.requires_grad and torch.is_grad_enabled():
        warnings.warn(f"{who}: the KeyedJaggedTensor's weights require grad, but this lookup (trainable tables, "
                      f"a sharded kernel or tables on cuda) gives them no gradient", stacklevel=4)


def _kjt_parts(kjt: KeyedJaggedTensor, n_keys: int, weighted: bool, who: str):
    """(values int64 np, offsets np [F*B+1], weights float32 np or None, B) on the host, validated."""
    check_kjt(kjt, weighted, who)
    b = kjt.stride()
    off = kjt.offsets()
    if off.numel() != n_keys * b + 1:
        raise ValueError(f"{who}: offsets have {off.numel()} entries, expected "
                         f"{n_keys} keys x batch {b} + 1 = {n_keys * b + 1}")
    return (*keyed_layout(kjt.values(), off, kjt.weights_or_none(), who), b)


def warn_if_dedup(dedup: Optional[str]) -> None:
    """The `dedup` argument of earlier versions: libibp's lookup now deduplicates a
    batch's ids by itself, choosing how from the batch."""
    if dedup is not None:
        warnings.warn("dedup is deprecated and has no effect: the native lookup deduplicates a batch's ids "
                      "by itself", FutureWarning, stacklevel=3)


def pooled_lookup(kjt: KeyedJaggedTensor, slots: Sequence[Slot], weighted: bool, who: str,
                  key_index: Optional[Sequence[int]] = None) -> torch.Tensor:
    """[B, sum(slot dims)] float32: slot i pools key key_index[i] of kjt (default: key i).

    Keys, offsets and weights are checked before any native call; libibp refuses an
    out-of-range id (without reading it) and the error names the feature and the id.
    """
    jobs, b = lookup_jobs(kjt, slots, weighted, who, key_index)
    if jobs is None:
        return torch.empty((kjt.stride(), sum(s.dim for s in slots)), dtype=torch.float32, device="meta")
    return run_lookup_jobs(jobs, b, who)


class JobCache:
    """An inference module's lookup jobs (PackedJobs), built on its first call and
    again whenever its tables or the input's keys change (identity of each table,
    the keys' order), so that a call neither builds slots nor fills jobs. It holds
    the tables by weak reference only: the jobs (which hold none) run only while each
    of the module's tables is alive and the one they were built for, and a table the
    module drops takes the jobs with it when it is freed. The small tables' decoded
    copies are the tables' own (CompressedTable._lookup_copy). Copies and pickles of
    the module start empty (the jobs hold the tables' native handles)."""

    def __init__(self):
        # (weak refs to the tables, keys, per job its table's position in them, what(job), PackedJobs),
        # replaced whole: calls may race
        self._entry = None

    def __deepcopy__(self, memo):
        return JobCache()

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()

    def _forget(self) -> None:  # a table died: its jobs go too
        self._entry = None

    def lookup(self, kjt: KeyedJaggedTensor, tables: tuple, slots_for, weighted: bool, who: str) -> torch.Tensor:
        """pooled_lookup(kjt, slots, weighted, who, key_index) for the (slots, key_index)
        that slots_for(keys) returns, asked again only when the keys or `tables` (the
        module's tables, whose slots' tables are among them) change; pooled_lookup itself
        where the tables are not all CompressedTables or the input is on meta."""
        keys = tuple(kjt.keys())
        entry = self._entry
        if kjt.values().device.type == "meta" or entry is None or entry[1] != keys or \
                len(entry[0]) != len(tables) or any(t is None or r() is not t for r, t in zip(entry[0], tables)):
            slots, key_index = slots_for(keys)
            position = {id(t): i for i, t in enumerate(tables) if isinstance(t, CompressedTable)}
            if kjt.values().device.type == "meta" or len(position) != len(tables) or \
                    any(id(s.table) not in position for s in slots):  # (tables replaced meanwhile: uncached)
                return pooled_lookup(kjt, slots, weighted, who, key_index)
            names = [f"{who}: feature {s.feature!r} of table {s.table_name!r}" for s in slots]
            packed = PackedJobs([s.table for s in slots], [s.mode for s in slots], key_index)
            me = weakref.ref(self)
            refs = tuple(weakref.ref(t, lambda _, me=me: me() is not None and me()._forget()) for t in tables)
            entry = self._entry = (refs, keys, [position[id(s.table)] for s in slots], names.__getitem__, packed)
        _, _, table_pos, what, packed = entry
        vals, off, w, b = _kjt_parts(kjt, len(keys), weighted, who)
        return packed(vals, off, w, b, what, lambda k: tables[table_pos[k]])


def lookup_jobs(kjt: KeyedJaggedTensor, slots: Sequence[Slot], weighted: bool, who: str,
                key_index: Optional[Sequence[int]] = None):
    """Validated per-slot work: ([(slot, ids, bag offsets [B+1], weights or None)], B);
    (None, B) for meta inputs. Ids are not range-checked here: every native lookup
    checks each id it reads (a min/max pass in Python took 0.9 ms of a 20 ms batch of
    2.1M ids), and run_lookup_jobs names the bad one."""
    n_keys = len(kjt.keys())
    if key_index is None:
        key_index = range(len(slots))
    values = kjt.values()
    if values.device.type == "meta" or any(s.table is None for s in slots):
        if values.device.type != "meta":
            raise RuntimeError(f"{who} is on the meta device: load weights (load_state_dict or "
                               f"load_compressed) before running it on real inputs")
        return None, kjt.stride()
    vals, off, w, b = _kjt_parts(kjt, n_keys, weighted, who)
    jobs = []
    for s, k in zip(slots, key_index):
        lo, hi = int(off[k * b]), int(off[(k + 1) * b])
        jobs.append((s, vals[lo:hi], off[k * b:(k + 1) * b + 1] - lo, None if w is None else w[lo:hi]))
    return jobs, b


def run_lookup_jobs(jobs, b: int, who: str) -> torch.Tensor:
    """[B, sum of dims] of validated jobs (lookup_jobs): packed tables in one native
    call (libibp spreads all their bags over its threads); updatable ones (training)
    table by table, each under its store's lock. Lookups only read, so a refused id
    leaves nothing changed; the IndexError names it."""
    try:
        if all(isinstance(s.table, CompressedTable) for s, *_ in jobs):
            return _lookup_many_checked([(s.table, ids, bag_off, ws, s.mode) for s, ids, bag_off, ws in jobs], b,
                               lambda k: f"{who}: feature {jobs[k][0].feature!r} of table {jobs[k][0].table_name!r}")
        outs = [s.table._lookup_checked(ids, bag_off, ws, s.mode) for s, ids, bag_off, ws in jobs]
        return torch.cat(outs, dim=1) if outs else torch.empty((b, 0), dtype=torch.float32)
    except IndexError:
        for s, ids, *_ in jobs:
            error = _id_out_of_range(ids, s.n_rows, f"{who}: feature {s.feature!r} of table {s.table_name!r}")
            if error is not None:
                raise error from None
        raise


def concat_features(items):
    """One table's features [(ids, bag offsets [B+1] from 0, weights or None, output column)]
    as (indices, offsets [F*B+1], weights or None, columns), feature after feature: the
    layout FBGEMM's TBE takes for a table read by several features."""
    if len(items) == 1:
        ids, off, ws, col = items[0]
        return ids, off, ws, [col]
    indices = np.concatenate([it[0] for it in items])
    starts = np.cumsum([0] + [int(it[1][-1]) for it in items[:-1]])
    offsets = np.concatenate([items[0][1][:1]] + [it[1][1:] + st for it, st in zip(items, starts)])
    weights = None if items[0][2] is None else np.concatenate([it[2] for it in items])
    return indices, offsets, weights, [it[3] for it in items]


def compress_weight(weight: torch.Tensor, dtype: torch.dtype, codec_options: Dict[str, Any]) -> CompressedTable:
    w = weight.detach()
    if w.device.type == "meta":
        raise ValueError("cannot compress a meta tensor: it holds no values")
    w = w.to("cpu", dtype).contiguous()
    return compress(w, **codec_options)


class SparseUpdateLookup(torch.autograd.Function):
    """Pooled lookups whose backward applies the sparse optimizer to the touched rows.

    forward(anchor, owner, jobs, B, who, device) -> [B, sum of dims] on `device` (the
    lookups run on the host); `anchor` is an empty leaf that requires grad (it only makes
    autograd call backward). backward hands the output gradient (on `device`) to
    owner.apply_sparse_update(jobs, B, grad), which updates the tables in place, as
    FBGEMM's fused TBE does: no dense table gradient ever exists.
    """

    @staticmethod
    def forward(ctx, anchor, owner, jobs, b, who, device):
        ctx.owner, ctx.jobs, ctx.b = owner, jobs, b
        return run_lookup_jobs(jobs, b, who).to(device)

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.jobs is None:
            raise RuntimeError(f"{type(ctx.owner).__name__}: backward ran twice through the same forward; the "
                               "sparse update was already applied (retain_graph is not supported)")
        ctx.owner.apply_sparse_update(ctx.jobs, ctx.b, grad_out)
        ctx.jobs = None
        return None, None, None, None, None, None


def training_lookup(owner, jobs, b: int, who: str, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """run_lookup_jobs whose result, moved to `device`, takes part in autograd (see
    SparseUpdateLookup)."""
    anchor = torch.empty(0, requires_grad=True)
    return SparseUpdateLookup.apply(anchor, owner, jobs, b, who, device)


def apply_updates(jobs, b: int, grad_out: torch.Tensor, optimizer, table_key, target,
                  on_device: bool = False) -> None:
    """Backward of training lookups: per table, its features' rows get their summed
    gradients and one optimizer step. table_key(slot) names a slot's table;
    target(key) -> (UpdatableTable, optimizer state, pooling mode). On the CPU libibp
    reduces the gradients itself (fused with the step, FBGEMM's arithmetic); for tables
    on a CUDA device (on_device) they are reduced where grad_out lives and only the
    distinct rows' gradients travel to the host."""
    by_table: Dict[Any, list] = {}
    col = 0
    for s, ids, bag_off, ws in jobs:
        by_table.setdefault(table_key(s), []).append((ids, bag_off, ws, col))
        col += s.dim
    for key, items in by_table.items():
        table, state, mode = target(key)
        if on_device:
            from .device import reduce_row_gradients

            ids, rows = reduce_row_gradients(items, b, grad_out, mode, table.shape[1])
            table.apply_row_gradients(optimizer, state, ids, rows)
        else:
            indices, offsets, weights, cols = concat_features(items)
            table.apply_gradients(optimizer, state, indices, offsets, b, grad_out, cols, weights, mode)
