"""libibp's lookups as PyTorch operators: ``torch.ops.ibp.pooled_lookup`` (one table),
``torch.ops.ibp.pooled_lookup_many`` (a collection in one call) and ``torch.ops.ibp.gather``.

As FBGEMM exposes its kernels as ``torch.ops.fbgemm.*``, these are registered with
``torch.library`` (a schema, a CPU kernel, a fake kernel for shape propagation and, for
the two pooled lookups, the gradient of per_sample_weights), so fx,
``torch.compile(fullgraph=True)``, ``torch.export`` and ``torch.jit.script`` see a
lookup as one node. They are defined through ``torch.library.Library`` rather than
``torch.library.custom_op``, whose Python wrappers cost about 20 us a call. A
compressed table enters them as plain tensors (``table_tensors``): masks and bitvals
([K, M]), block_base, rel and payload, plus ``meta`` = [rows, dim, word_bits,
payload_bytes]. The tensors hold the table's bytes as signed integers (int64 for the
uint64 arrays, int16 / int32 for rel, uint8 payload): torch pickles those, and not
its unsigned 16/32/64-bit dtypes. Modules keep these tensors as buffers.

The operators trust the table's structure (tables from ``compress``, ``load`` or
``table_from_tensors`` are validated once). The table tensors' shapes and sizes are
checked against meta when the operators first meet them, and again after a change of
their memory or version counter (_TensorCache); the table tensors must not be written
in place otherwise (the module's buffers never are). The inputs of every call are
checked: offsets, id ranges, weights. Bad inputs raise IndexError / ValueError naming ``what`` (the
feature and table).
"""
from __future__ import annotations

import operator
import warnings
import weakref
from collections import OrderedDict
from typing import List, Optional

import numpy as np
import torch

from . import _native
from ._native import ffi, lib
from .dtypes import LOOKUP_DTYPES
from .batched import keyed_layout
from .packed_jobs import PackedJobs
from .table import CompressedTable, check_integers, check_offset_ends, check_real_weights

TABLE_TENSORS = ("masks", "bitvals", "block_base", "rel", "payload")
# numpy dtype of each table array -> the signed dtype of the same width the tensors use
_SIGNED = {np.dtype(np.uint64): np.int64, np.dtype(np.uint32): np.int32, np.dtype(np.uint16): np.int16,
           np.dtype(np.uint8): np.uint8}
_DTYPE_OF_CODE = {code: dtype for dtype, code in LOOKUP_DTYPES.items()}  # pooled_lookup_many's dtypes
_UNSIGNED = {torch.int64: np.uint64, torch.int32: np.uint32, torch.int16: np.uint16, torch.uint8: np.uint8}


def table_tensors(t: CompressedTable) -> dict:
    """The tensors (sharing the table's memory) and meta list a CompressedTable enters
    the operators as."""
    with warnings.catch_warnings():  # mmap'd tables are read-only; the operators never write
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensors = {}
        for name in TABLE_TENSORS:
            a = getattr(t, f"_{name}")
            tensors[name] = torch.from_numpy(a.view(_SIGNED[a.dtype]))
    return dict(tensors, meta=table_meta(t))


def table_meta(t: CompressedTable) -> List[int]:
    return [t.shape[0], t.shape[1], t.word_bits, t._payload_bytes]


def table_from_tensors(tensors: dict, meta: List[int], dtype: torch.dtype) -> CompressedTable:
    """The CompressedTable over these tensors' memory (validated: raises FormatError)."""
    n, d, w, payload_bytes = meta
    arrays = {}
    for name in TABLE_TENSORS:
        t = tensors[name]
        if t.device.type != "cpu" or t.dtype not in _UNSIGNED:
            raise ValueError(f"table tensor {name} must be an integer CPU tensor, got {t.dtype} on {t.device}")
        arrays[name] = t.contiguous().numpy().view(_UNSIGNED[t.dtype])
    return CompressedTable(shape=(n, d), dtype=dtype, word_bits=w, masks=arrays["masks"],
                           bitvals=arrays["bitvals"], block_base=arrays["block_base"], rel=arrays["rel"],
                           payload=arrays["payload"], payload_bytes=payload_bytes, validate=True)


_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr


def _states(tensors: tuple) -> tuple:
    """What a value built from these tensors depends on beyond their identity: their
    memory (share_memory_, ``.data =`` and swap_tensors move it, keeping the object and
    its version) and version counters (an in-place write such as copy_ bumps them).
    Inference tensors keep no counter (-1): they are trusted not to be written in place,
    as are writes that bypass the counter (through NumPy, ``.data`` or the storage)."""
    try:
        versions = tuple(map(_VERSION, tensors))  # (map: 8 us for 130 tensors, a generator 12)
    except RuntimeError:
        versions = tuple(-1 if t.is_inference() else t._version for t in tensors)
    return (*map(_DATA_PTR, tensors), *versions)


class _TensorCache:
    """Values built from sets of tensors, kept while the tensors live. Keyed on the
    tensors' ids (with the caller's other arguments): an entry goes when one of its
    tensors dies (a weak reference's callback), so an entry's ids name live tensors, the
    same objects, and it serves only while their _states are those it was built on. It
    holds no reference to the tensors (a dropped model's tables are freed); the least
    recently used entries go past max_entries."""

    def __init__(self, max_entries: int):
        self._entries: "OrderedDict[tuple, tuple]" = OrderedDict()
        self._max = max_entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple, states: tuple):
        entry = self._entries.get(key)
        if entry is None or entry[1] != states:
            return None
        try:
            self._entries.move_to_end(key)
        except KeyError:  # evicted by another thread meanwhile
            pass
        return entry[0]

    def put(self, key: tuple, tensors: tuple, states: tuple, value):
        """Keep value, built from tensors whose _states were `states` before it was built."""
        token = object()

        def forget(_):  # unless replaced meanwhile
            got = self._entries.get(key)
            if got is not None and got[2] is token:
                self._entries.pop(key, None)

        refs = tuple(weakref.ref(t, forget) for t in {id(t): t for t in tensors}.values())
        self._entries[key] = (value, states, token, refs)
        while len(self._entries) > self._max:
            try:
                self._entries.popitem(last=False)
            except KeyError:
                break
        return value


# The CompressedTable over each set of table tensors, built (and the tensors checked
# against meta) on first use; its arrays are views of the tensors' memory that hold no
# reference to them. Its struct holds vbits and fixed_len read from the masks, so it
# must not outlive a change of them (_TensorCache).
_TABLES = _TensorCache(4096)


def _unowned(t: torch.Tensor) -> np.ndarray:
    """t's memory (contiguous, on the CPU) as a NumPy array of its unsigned dtype that
    holds no reference to t."""
    dtype = np.dtype(_UNSIGNED[t.dtype])
    if t.numel() == 0:
        return np.empty(tuple(t.shape), dtype)
    buf = ffi.buffer(ffi.cast("char *", t.data_ptr()), t.numel() * dtype.itemsize)
    return np.frombuffer(buf, dtype).reshape(tuple(t.shape))


def _table_of(masks, bitvals, block_base, rel, payload, meta, dtype: torch.dtype, what: str) -> CompressedTable:
    """The CompressedTable over these tensors (cached, see above)."""
    tensors = (masks, bitvals, block_base, rel, payload)
    key = (*map(id, tensors), *meta, dtype)
    states = _states(tensors)
    table = _TABLES.get(key, states)
    if table is not None:
        return table
    _check_table(masks, bitvals, block_base, rel, payload, meta, dtype, what)
    n, d, w, payload_bytes = meta
    table = CompressedTable(shape=(n, d), dtype=dtype, word_bits=w, masks=_unowned(masks),
                            bitvals=_unowned(bitvals), block_base=_unowned(block_base), rel=_unowned(rel),
                            payload=_unowned(payload), payload_bytes=payload_bytes, validate=False)
    return _TABLES.put(key, tensors, states, table)


def _check_table(masks, bitvals, block_base, rel, payload, meta, dtype: torch.dtype, what: str) -> None:
    """O(1) checks that the tensors have the sizes the table's description needs."""
    if len(meta) != 4:
        raise ValueError(f"{what}: meta must be [rows, dim, word_bits, payload_bytes], got {meta}")
    n, d, w, payload_bytes = meta
    if w not in (16, 32, 64) or n < 0 or d < 1 or payload_bytes < 0:
        raise ValueError(f"{what}: bad table description {meta}")
    row_bytes = d * dtype.itemsize
    m = -(-row_bytes // (w // 8))
    raw = masks.dim() == 2 and masks.shape[0] == 0  # rows at i * R, no index, no tail pad
    index = ((0,), (0,)) if raw else ((n // 64 + 1,), (n + 1,))
    ok = (masks.dim() == 2 and masks.shape[1] == m and masks.shape[0] <= 256 and bitvals.shape == masks.shape
          and masks.dtype == bitvals.dtype == block_base.dtype == torch.int64 and payload.dtype == torch.uint8
          and (tuple(block_base.shape), tuple(rel.shape)) == index and (not raw or payload_bytes == n * row_bytes)
          and rel.element_size() == lib.ibp_rel_bytes(row_bytes) and rel.dtype in (torch.int16, torch.int32)
          and payload.dim() == 1 and payload.numel() >= payload_bytes + (0 if raw else lib.ibp_tail_pad(row_bytes, w))
          and all(x.device.type == "cpu" and x.is_contiguous() for x in (masks, bitvals, block_base, rel, payload)))
    if not ok:
        raise ValueError(f"{what}: the table tensors do not fit the description {meta}")


def _check_on_cpu(what: str, *tensors: Optional[torch.Tensor]) -> None:
    """The operators decode host tables on the CPU: device ids would reach libibp as
    device pointers."""
    for x in tensors:
        if x is not None and x.device.type != "cpu":
            raise RuntimeError(f"{what}: torch.ops.ibp lookups take CPU tensors, got one on {x.device} "
                               f"(a module on cuda looks its tables up eagerly and cannot be scripted, "
                               f"traced or exported: capture it on the CPU)")


def _bad_id(idx: torch.Tensor, n_rows: int) -> int:
    bad = idx[(idx < 0) | (idx >= n_rows)]
    return int(bad[0]) if bad.numel() else -1


_LIB = torch.library.Library("ibp", "DEF")
_LIB.define("pooled_lookup(Tensor masks, Tensor bitvals, Tensor block_base, Tensor rel, Tensor payload, "
            "int[] meta, ScalarType dtype, Tensor indices, Tensor offsets, Tensor? per_sample_weights, "
            "int mode, str what) -> Tensor")
_LIB.define("pooled_lookup_many(Tensor[] masks, Tensor[] bitvals, Tensor[] block_base, Tensor[] rel, "
            "Tensor[] payload, int[] metas, int[] dtypes, Tensor values, Tensor offsets, "
            "Tensor? per_sample_weights, int batch_size, int num_keys, int[] key_index, int[] modes, "
            "str[] what) -> Tensor")
_LIB.define("gather(Tensor masks, Tensor bitvals, Tensor block_base, Tensor rel, Tensor payload, int[] meta, "
            "ScalarType dtype, Tensor indices, str what) -> Tensor")


def pooled_lookup(masks: torch.Tensor, bitvals: torch.Tensor, block_base: torch.Tensor, rel: torch.Tensor,
                  payload: torch.Tensor, meta: List[int], dtype: torch.dtype, indices: torch.Tensor,
                  offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor], mode: int,
                  what: str) -> torch.Tensor:
    """[B, dim] float32: bag b pools rows indices[offsets[b]:offsets[b + 1]] (scaled by
    per_sample_weights when given); mode 0 = SUM, 1 = MEAN (an empty bag gives zeros).
    libibp deduplicates the ids itself where that pays."""
    if dtype not in LOOKUP_DTYPES:
        raise TypeError(f"{what}: pooled lookups need a float32, float16 or bfloat16 table, not {dtype}")
    table = _table_of(masks, bitvals, block_base, rel, payload, meta, dtype, what)
    n, d = table.shape
    if mode not in (0, 1):
        raise ValueError(f"{what}: mode must be 0 (sum) or 1 (mean), not {mode}")
    if indices.dim() != 1 or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{what}: indices must be 1-D and offsets 1-D with B + 1 entries")
    check_integers(indices, f"{what}: ids")
    check_integers(offsets, f"{what}: offsets")
    _check_on_cpu(what, indices, offsets, per_sample_weights)
    idx = indices.to(torch.int64).resolve_neg().contiguous()  # (resolve_neg: free where no bit is set)
    off = offsets.to(torch.int64).resolve_neg().contiguous()
    check_offset_ends(off.numpy(), idx.numel(), "ids", what)  # through NumPy: 1.1 us, not 2.5
    w = None
    if per_sample_weights is not None:
        check_real_weights(per_sample_weights, what)
        if per_sample_weights.shape != indices.shape:
            raise ValueError(f"{what}: per_sample_weights of shape {tuple(per_sample_weights.shape)} for ids of "
                             f"shape {tuple(indices.shape)}")
        w = per_sample_weights.detach().to(torch.float32).resolve_neg().contiguous()
    n_bags = off.numel() - 1
    out = torch.empty((n_bags, d), dtype=torch.float32, device="cpu")
    if n_bags == 0:
        return out
    rc = lib.ibp_lookup(table._c, LOOKUP_DTYPES[dtype], d, ffi.cast("const int64_t *", idx.data_ptr()) if idx.numel()
                        else ffi.NULL, ffi.cast("const int64_t *", off.data_ptr()), n_bags,
                        ffi.NULL if w is None else ffi.cast("const float *", w.data_ptr()), mode,
                        ffi.cast("float *", out.data_ptr()))
    if rc == lib.IBP_E_INDEX:
        raise IndexError(f"{what}: id {_bad_id(idx, n)} out of range for a table of {n} rows")
    if rc == lib.IBP_E_ARG:
        raise ValueError(f"{what}: offsets must be non-decreasing")  # their ends were checked
    _native.check(rc, what)
    return out


_LIB.impl("pooled_lookup", pooled_lookup, "CPU")


@torch.library.register_fake("ibp::pooled_lookup")
def _pooled_lookup_fake(masks, bitvals, block_base, rel, payload, meta, dtype, indices, offsets,
                        per_sample_weights, mode, what):
    return offsets.new_empty((offsets.shape[0] - 1, meta[1]), dtype=torch.float32)


class _PooledLookupWithWeightsGrad(torch.autograd.Function):
    """pooled_lookup whose per_sample_weights require grad: d out[b] / d w[i] is the row
    of ids[i] for the ids i of bag b (divided by the bag's length for MEAN), as FBGEMM's
    TBE gives per_sample_weights a gradient. The table itself is frozen here (trainable
    tables run eagerly and update in their own backward)."""

    @staticmethod
    def forward(ctx, *inputs):
        masks, bitvals, block_base, rel, payload, meta, dtype, indices, offsets, weights, mode, what = inputs
        ctx.save_for_backward(masks, bitvals, block_base, rel, payload, indices, offsets)
        ctx.table, ctx.mode, ctx.what, ctx.weights_dtype = (meta, dtype), mode, what, weights.dtype
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.ibp.pooled_lookup.default(*inputs)

    @staticmethod
    def backward(ctx, grad):
        masks, bitvals, block_base, rel, payload, indices, offsets = ctx.saved_tensors
        rows = torch.ops.ibp.gather(masks, bitvals, block_base, rel, payload, *ctx.table, indices, ctx.what)
        grad_weights = _weights_grad(rows, grad, offsets.to(torch.int64), ctx.mode)
        return (None,) * 9 + (grad_weights.to(ctx.weights_dtype), None, None)


def _weights_grad(rows: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor, mode: int) -> torch.Tensor:
    """float32 d loss / d w[i] of the ids of one table's bags (bag offsets from 0, rows
    their decoded rows, grad the bags' output gradient [B, dim]): grad[bag(i)] . rows[i],
    divided by the bag's length for MEAN."""
    lengths = offsets[1:] - offsets[:-1]
    bag_of_id = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    g = grad[bag_of_id]
    if mode == 1:
        g = g / lengths[bag_of_id].unsqueeze(1)  # ids only sit in bags of length >= 1
    return (g * rows.to(torch.float32)).sum(1)


def _autograd_kernel(name: str, kernel, with_weights_grad):
    """The Autograd kernel of pooled lookup `name` (whose weights are input 9): a graph
    node (with_weights_grad) only where the weights need a gradient. (A kernel of our
    own: torch.library.register_autograd's Python wrappers cost ~15 us a call, as much as
    a small lookup.)"""
    op = getattr(torch.ops.ibp, name).default

    def autograd_kernel(*inputs):
        weights = inputs[9]
        if weights is not None and weights.requires_grad and torch.is_grad_enabled():
            return with_weights_grad.apply(*inputs)
        return _below_autograd(op, kernel, inputs)

    return autograd_kernel


def _below_autograd(op, kernel, inputs):
    """op's CPU kernel, from its Autograd kernel: called straight where the dispatcher
    would only reach it (ids, offsets and weights plain CPU tensors, no dispatch mode:
    not traced, compiled, exported, faked or checked), as its second trip costs ~5 us a
    call of one table and ~22 of the 26 Criteo tables' collection (with its 130 table
    tensors); else through the dispatcher. The kernels resolve negative-bit views themselves
    (the one fallback a plain tensor can still need); C++ functionalization or vmap
    wrappers reach here as plain tensors and have no memory the kernels could read."""
    ids, offsets, weights = inputs[7], inputs[8], inputs[9]
    if _plain(ids) and _plain(offsets) and ids.device.type == "cpu" and (weights is None or _plain(weights)) \
            and torch._C._len_torch_dispatch_stack() == 0:
        return kernel(*inputs)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*inputs)


def _plain(x: torch.Tensor) -> bool:
    """A tensor of torch's own with memory to read (an efficient zero tensor has none:
    the dispatcher materialises it)."""
    return type(x) is torch.Tensor and not x._is_zerotensor()


_LIB.impl("pooled_lookup", _autograd_kernel("pooled_lookup", pooled_lookup, _PooledLookupWithWeightsGrad),
          "Autograd")


def pooled_lookup_many(masks: List[torch.Tensor], bitvals: List[torch.Tensor], block_base: List[torch.Tensor],
                       rel: List[torch.Tensor], payload: List[torch.Tensor], metas: List[int],
                       dtypes: List[int], values: torch.Tensor, offsets: torch.Tensor,
                       per_sample_weights: Optional[torch.Tensor], batch_size: int, num_keys: int,
                       key_index: List[int], modes: List[int], what: List[str]) -> torch.Tensor:
    """[B, sum of dims] float32: a collection's lookups in one call, as FBGEMM's TBE
    forward makes them. A batch laid out as a KeyedJaggedTensor's (values, offsets of
    num_keys x batch_size bags + 1, per_sample_weights like values or None); job j (table j's
    tensors, metas[4j:4j + 4], dtypes[j]: 0 float32, 1 float16, 2 bfloat16, as
    ibp_embed.dtypes.LOOKUP_DTYPES codes them) pools key key_index[j] with modes[j] (0 SUM,
    1 MEAN) into columns [D_0 + .. + D_{j-1}, + D_j); what[j] names the job in errors.
    Runs as ibp_embed.lookup_many: one native call over all the jobs' bags, small
    tables from decoded copies, kept native jobs."""
    who = "pooled_lookup_many"
    if batch_size < 0 or values.dim() != 1 or offsets.dim() != 1:
        raise ValueError(f"{who}: values and offsets must be 1-D and batch_size >= 0")
    if offsets.numel() != num_keys * batch_size + 1:  # (a KJT of a batch size per key: VBE)
        raise ValueError(f"{who}: offsets have {offsets.numel()} entries, expected {num_keys} keys x batch "
                         f"{batch_size} + 1 = {num_keys * batch_size + 1} (variable batch sizes per key are "
                         f"not supported)")
    if per_sample_weights is not None and per_sample_weights.shape != values.shape:
        raise ValueError(f"{who}: per_sample_weights of shape {tuple(per_sample_weights.shape)} for values of "
                         f"shape {tuple(values.shape)}")
    _check_on_cpu(who, values, offsets, per_sample_weights)
    vals, off, w = keyed_layout(values, offsets, per_sample_weights, who)
    tables, packed = _collection_jobs(masks, bitvals, block_base, rel, payload, metas, dtypes, key_index, modes,
                                      what)
    return packed(vals, off, w, batch_size, what.__getitem__, tables.__getitem__)


# The tables and PackedJobs of each collection's call (its tensors, metas, dtypes, keys
# and modes; _TensorCache): building them took 90 of a B1 call's 150 us into the 26
# Criteo tables.
_JOBS = _TensorCache(64)


def _collection_jobs(masks, bitvals, block_base, rel, payload, metas, dtypes, key_index, modes, what):
    lists = (masks, bitvals, block_base, rel, payload, metas, dtypes, key_index, modes)
    tensors = (*masks, *bitvals, *block_base, *rel, *payload)
    key = (*map(len, lists), *map(id, tensors), *metas, *dtypes, *key_index, *modes)
    states = _states(tensors)
    entry = _JOBS.get(key, states)
    if entry is not None:
        return entry
    n = len(masks)
    if not len(bitvals) == len(block_base) == len(rel) == len(payload) == len(dtypes) == len(key_index) == \
            len(modes) == len(what) == n or len(metas) != 4 * n:
        raise ValueError(f"pooled_lookup_many: {n} jobs need as many table tensors, dtypes, key indices, modes "
                         f"and names, and 4 metas each")
    tables = []
    for j in range(n):
        if dtypes[j] not in _DTYPE_OF_CODE:
            raise TypeError(f"{what[j]}: dtype code {dtypes[j]}: pooled lookups need a float32 (0), float16 (1) or "
                            f"bfloat16 (2) table")
        if modes[j] not in (0, 1):
            raise ValueError(f"{what[j]}: mode must be 0 (sum) or 1 (mean), not {modes[j]}")
        tables.append(_table_of(masks[j], bitvals[j], block_base[j], rel[j], payload[j], metas[4 * j:4 * j + 4],
                                _DTYPE_OF_CODE[dtypes[j]], what[j]))
    return _JOBS.put(key, tensors, states,
                     (tables, PackedJobs(tables, [("sum", "mean")[m] for m in modes], key_index)))


_LIB.impl("pooled_lookup_many", pooled_lookup_many, "CPU")


@torch.library.register_fake("ibp::pooled_lookup_many")
def _pooled_lookup_many_fake(masks, bitvals, block_base, rel, payload, metas, dtypes, values, offsets,
                             per_sample_weights, batch_size, num_keys, key_index, modes, what):
    return values.new_empty((batch_size, sum(metas[1::4])), dtype=torch.float32)


class _PooledLookupManyWithWeightsGrad(torch.autograd.Function):
    """pooled_lookup_many whose per_sample_weights require grad (see
    _PooledLookupWithWeightsGrad): a key that several jobs pool sums their gradients."""

    @staticmethod
    def forward(ctx, *inputs):
        masks, bitvals, block_base, rel, payload, metas, dtypes, values, offsets, weights, b, _, key_index, modes, \
            what = inputs
        ctx.save_for_backward(values, offsets, *masks, *bitvals, *block_base, *rel, *payload)
        ctx.args = (metas, dtypes, b, key_index, modes, what, weights.dtype)
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.ibp.pooled_lookup_many.default(*inputs)

    @staticmethod
    def backward(ctx, grad):
        values, offsets, *tensors = ctx.saved_tensors
        metas, dtypes, b, key_index, modes, what, weights_dtype = ctx.args
        n = len(dtypes)
        off = offsets.to(torch.int64)
        grad_weights = torch.zeros(values.shape, dtype=torch.float32)
        col = 0
        for j in range(n):
            k, d = key_index[j], metas[4 * j + 1]
            lo, hi = int(off[k * b]), int(off[(k + 1) * b])
            rows = torch.ops.ibp.gather(*tensors[j::n], metas[4 * j:4 * j + 4], _DTYPE_OF_CODE[dtypes[j]],
                                        values[lo:hi], what[j])
            grad_weights[lo:hi] += _weights_grad(rows, grad[:, col:col + d], off[k * b:(k + 1) * b + 1] - lo,
                                                 modes[j])
            col += d
        return (None,) * 9 + (grad_weights.to(weights_dtype),) + (None,) * 5


_LIB.impl("pooled_lookup_many", _autograd_kernel("pooled_lookup_many", pooled_lookup_many,
                                                  _PooledLookupManyWithWeightsGrad), "Autograd")


def gather(masks: torch.Tensor, bitvals: torch.Tensor, block_base: torch.Tensor, rel: torch.Tensor,
           payload: torch.Tensor, meta: List[int], dtype: torch.dtype, indices: torch.Tensor,
           what: str) -> torch.Tensor:
    """Rows `indices` (any shape of integers), bit-exact: indices.shape + [dim] of dtype."""
    table = _table_of(masks, bitvals, block_base, rel, payload, meta, dtype, what)
    n, d = table.shape
    check_integers(indices, f"{what}: ids")
    _check_on_cpu(what, indices)
    idx = indices.to(torch.int64).contiguous().reshape(-1)
    out = torch.empty((idx.numel(), d * dtype.itemsize), dtype=torch.uint8, device="cpu")
    if idx.numel():
        rc = lib.ibp_decode(table._c, ffi.cast("const int64_t *", idx.data_ptr()), idx.numel(),
                            ffi.cast("uint8_t *", out.data_ptr()))
        if rc == lib.IBP_E_INDEX:
            raise IndexError(f"{what}: id {_bad_id(idx, n)} out of range for a table of {n} rows")
        _native.check(rc, what)
    return out.view(dtype).reshape(*indices.shape, d)


_LIB.impl("gather", gather, "CPU")


@torch.library.register_fake("ibp::gather")
def _gather_fake(masks, bitvals, block_base, rel, payload, meta, dtype, indices, what):
    return indices.new_empty((*indices.shape, meta[1]), dtype=dtype)
