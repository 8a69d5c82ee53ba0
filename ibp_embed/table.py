"""CompressedTable: an IBP-compressed embedding table held in host memory (or a mmap)."""
from __future__ import annotations

import threading

import numpy as np
import torch

from . import _native, hostmem, io
from ._native import ffi, lib
from .dtypes import LOOKUP_DTYPES, dtype_from_name, dtype_name, rows_to_tensor
from .errors import FormatError

_MODES = {"sum": 0, "mean": 1}
_COPY_LOCK = threading.Lock()  # decoded copies are made once (CompressedTable._lookup_copy)


class TableReads:
    """Reads shared by packed and updatable tables: subclasses set self._shape,
    self._dtype and self._row_bytes and implement the two native calls below."""

    _shape: tuple[int, int]
    _dtype: torch.dtype
    _row_bytes: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def raw_nbytes(self) -> int:
        return self._shape[0] * self._row_bytes

    @property
    def ratio(self) -> float:
        """raw_nbytes / nbytes (1.0 for an empty table)."""
        return self.raw_nbytes / self.nbytes if self._shape[0] else 1.0

    def __len__(self) -> int:
        return self._shape[0]

    def _native_decode(self, idx, n: int, out) -> int:
        """libibp's decode of rows idx (a C pointer, NULL: all) into out; its return code."""
        raise NotImplementedError

    def _native_lookup(self, dtype: int, idx, off, n_bags: int, weights, mode: int, out) -> int:
        raise NotImplementedError

    def decompress(self) -> torch.Tensor:
        """The whole table, bit-exact, as an [N, D] tensor of the original dtype."""
        return rows_to_tensor(self._decoded_rows(), self._dtype, self._shape[1])

    def _decoded_rows(self) -> np.ndarray:
        """Every row decoded, [N, R] uint8 (FormatError for a row that cannot be)."""
        out = np.empty((self._shape[0], self._row_bytes), dtype=np.uint8)
        if self._shape[0]:
            _native.check(self._native_decode(ffi.NULL, 0, _native.ptr(out, "uint8_t *")), "decompress")
        return out

    def gather(self, indices) -> torch.Tensor:
        """Rows at `indices` (any shape of integers), bit-exact: shape indices.shape + (D,)."""
        idx = _as_index_array(indices, "indices")
        flat = idx.reshape(-1)
        # libibp checks every id before it writes a row, so the range is looked at here only
        # to name a bad id, and the rows go straight into a tensor: a gather of 20 rows
        # took 10.2-10.3 us with a NumPy range check and output, 7.4-7.7 so (timeit, in
        # turn). Bytes viewed as the dtype (torch.empty packs quint4x2's elements two to a
        # byte), on the CPU whatever torch's default device
        out = torch.empty((flat.size, self._row_bytes), dtype=torch.uint8, device="cpu")
        if flat.size:
            rc = self._native_decode(_native.ptr(flat, "const int64_t *"), flat.size,
                                     ffi.cast("uint8_t *", out.data_ptr()))
            if rc == lib.IBP_E_INDEX:
                _check_range(flat, self._shape[0])
            _native.check(rc, "gather")
        return out.view(self._dtype).reshape(*idx.shape, self._shape[1])

    def lookup(self, indices, offsets, per_sample_weights=None, mode: str = "sum") -> torch.Tensor:
        """Pooled lookup as in TorchRec: bag b pools rows indices[offsets[b]:offsets[b+1]].

        offsets has B + 1 entries, starts at 0 and ends at len(indices). Rows are
        scaled by per_sample_weights when given; "mean" divides by the bag size
        (an empty bag gives zeros). Returns a [B, D] float32 tensor.
        """
        return self._lookup_checked(*self._lookup_args(indices, offsets, per_sample_weights, mode), mode)

    def _lookup_args(self, indices, offsets, per_sample_weights, mode: str):
        """lookup()'s checks; (ids, offsets, weights or None) as the native call takes them."""
        if self._dtype not in LOOKUP_DTYPES:
            raise TypeError(f"pooled lookup needs a float32, float16 or bfloat16 table, not {self._dtype}")
        if not isinstance(mode, str) or mode not in _MODES:
            raise ValueError(f"mode must be 'sum' or 'mean', not {mode!r}")
        if _ndim(indices) != 1:
            raise ValueError("indices must be 1-D")
        idx = _as_index_array(indices, "indices")
        off = _as_index_array(offsets, "offsets")
        if off.ndim != 1 or off.size < 1:
            raise ValueError("offsets must be 1-D with B + 1 entries")
        check_offset_ends(off, idx.size)
        # libibp checks the offsets' order and the ids' range before it reads any row:
        # checked here first as well, they cost 1-4% of a large batch
        w = None
        if per_sample_weights is not None:
            w = _as_float_array(per_sample_weights)
            if _ndim(per_sample_weights) != 1 or w.shape != idx.shape:
                raise ValueError(f"per_sample_weights must be 1-D like indices {idx.shape}, got shape "
                                 f"{tuple(np.shape(per_sample_weights))}")
        return idx, off, w

    def _lookup_checked(self, idx: np.ndarray, off: np.ndarray, w, mode: str, what: str = "lookup") -> torch.Tensor:
        """The native pooled lookup, for callers that ran lookup()'s checks: contiguous
        int64 ids, int64 offsets from 0 to len(ids), float32 weights or None, a float
        table. libibp refuses out-of-range ids and decreasing offsets before it reads a
        row (IndexError / ValueError)."""
        weights = ffi.NULL if w is None else _native.ptr(w, "const float *")
        n_bags = off.size - 1
        out = torch.empty((n_bags, self._shape[1]), dtype=torch.float32, device="cpu")
        if n_bags:
            _check_lookup_rc(self._native_lookup(
                LOOKUP_DTYPES[self._dtype], _native.ptr(idx, "const int64_t *") if idx.size else ffi.NULL,
                _native.ptr(off, "const int64_t *"), n_bags, weights, _MODES[mode],
                ffi.cast("float *", out.data_ptr())), what, idx, off, self._shape[0])
        return out


def _check_lookup_rc(rc: int, what: str, idx: np.ndarray, off: np.ndarray, n_rows: int) -> None:
    """Raise for a native lookup's return code, naming the first bad id or the offsets
    (found here, on the error path only: libibp says which check failed, not where)."""
    if rc == lib.IBP_E_INDEX:
        _check_range(idx, n_rows, what)
    if rc == lib.IBP_E_ARG and np.any(off[1:] < off[:-1]):
        raise ValueError(f"{what}: offsets must be non-decreasing")
    _native.check(rc, what)


class CompressedTable(TableReads):
    """N rows of D elements, stored with Invariant Bit Packing (docs/format.md).

    Build one with :func:`ibp_embed.compress` or :func:`ibp_embed.load`. Reads are
    thread-safe; the table is immutable.
    """

    def __init__(self, *, shape, dtype: torch.dtype, word_bits: int, masks: np.ndarray,
                 bitvals: np.ndarray, block_base: np.ndarray, rel: np.ndarray,
                 payload: np.ndarray, payload_bytes: int, validate: bool = True):
        n_rows, dim = (int(s) for s in shape)
        self._shape = (n_rows, dim)
        self._dtype = dtype
        row_bytes = dim * dtype.itemsize
        self._row_bytes = row_bytes
        self._word_bits = int(word_bits)
        n_words = -(-row_bytes // (self._word_bits // 8))
        masks = np.ascontiguousarray(masks, dtype=np.uint64)
        bitvals = np.ascontiguousarray(bitvals, dtype=np.uint64)
        if masks.ndim != 2 or masks.shape[1] != n_words or bitvals.shape != masks.shape:
            raise FormatError(f"masks of shape {masks.shape} / {bitvals.shape} do not fit "
                              f"{n_words} words per row")
        if not 0 <= masks.shape[0] <= 256:
            raise FormatError(f"{masks.shape[0]} clusters; a table has 1 to 256 (0: raw)")
        rel_bytes = int(lib.ibp_rel_bytes(row_bytes))
        if rel_bytes == 0:
            raise FormatError(f"rows of {row_bytes} bytes are too large")
        raw = masks.shape[0] == 0  # rows stored as they are: no index, no tail pad
        index_shape = ((0,), (0,)) if raw else ((n_rows // 64 + 1,), (n_rows + 1,))
        if (block_base.shape, rel.shape) != index_shape or rel.dtype.itemsize != rel_bytes:
            raise FormatError("the offsets index does not match the table's shape")
        if raw and (payload_bytes != n_rows * row_bytes or payload.shape[0] > payload_bytes):
            raise FormatError(f"a raw table of {n_rows} rows of {row_bytes} bytes has exactly "
                              f"{n_rows * row_bytes} payload bytes, not {payload_bytes} ({payload.shape[0]} given)")
        if payload.shape[0] < payload_bytes + (0 if raw else lib.ibp_tail_pad(row_bytes, self._word_bits)):
            raise FormatError("the payload is shorter than its rows and tail padding")
        self._masks, self._bitvals = masks, bitvals
        self._vbits = (self._word_bits - np.bitwise_count(masks)).astype(np.uint8)
        self._block_base, self._rel, self._payload = block_base, rel, payload
        self._payload_bytes = int(payload_bytes)

        cb = ffi.new("ibp_table *")
        cb.cb.row_bytes = row_bytes
        cb.cb.word_bits = self._word_bits
        cb.cb.n_words = n_words
        cb.cb.n_clusters = masks.shape[0]
        cb.cb.masks = _native.ptr(masks, "const uint64_t *")
        cb.cb.bitvals = _native.ptr(bitvals, "const uint64_t *")
        cb.cb.vbits = _native.ptr(self._vbits, "const uint8_t *")
        cb.n_rows = n_rows
        cb.rel_bytes = rel_bytes
        cb.block_base = ffi.NULL if raw else _native.ptr(block_base, "const uint64_t *")
        cb.rel = ffi.NULL if raw else _native.ptr(rel, "const void *")
        cb.payload = _native.ptr(payload, "const uint8_t *") if payload.size else ffi.NULL
        cb.payload_bytes = self._payload_bytes
        cb.fixed_len = lib.ibp_fixed_row_bytes(cb)  # rows all one length: read with no index
        self._c = cb
        if validate:
            bad = ffi.new("uint64_t *")
            rc = lib.ibp_validate(cb, bad)
            if rc != lib.IBP_OK:
                raise FormatError(f"invalid compressed table (first bad row {bad[0]}): "
                                  f"{ffi.string(lib.ibp_error_string(rc)).decode()}")

    def _native_decode(self, idx, n: int, out) -> int:
        return lib.ibp_decode(self._c, idx, n, out)

    def _native_lookup(self, dtype: int, idx, off, n_bags: int, weights, mode: int, out) -> int:
        return lib.ibp_lookup(self._c, dtype, self._shape[1], idx, off, n_bags, weights, mode, out)

    def _lookup_copy(self) -> "CompressedTable | None":
        """The rows decoded (bit-exact) as a raw table, made on first use and kept while
        the table lives, for lookups that pool small tables from it (packed_jobs); None
        where a row cannot be decoded (a table loaded without verification), which
        only the lookups that name that row report."""
        copy = self.__dict__.get("_copy")
        if copy is None:
            with _COPY_LOCK:
                copy = self.__dict__.get("_copy")
                if copy is None:
                    try:
                        copy = CompressedTable.raw(self._decoded_rows(), self._dtype, self._shape[1],
                                                   self._word_bits)
                    except FormatError:
                        copy = False
                    self._copy = copy
        return copy or None

    @property
    def lookup_copy_nbytes(self) -> int:
        """Bytes of the decoded copy small tables keep for lookups of few ids a row
        (0 until one such lookup made it; see ibp_embed.packed_jobs)."""
        copy = self.__dict__.get("_copy")
        return copy.nbytes if copy else 0

    # ---- description ----
    @property
    def word_bits(self) -> int:
        return self._word_bits

    @property
    def clusters(self) -> int:
        """Masks in the codebook; 0 for a raw table (see `is_raw`)."""
        return int(self._masks.shape[0])

    @property
    def is_raw(self) -> bool:
        """Whether every row is stored as it is, with no masks, index or tail pad
        (docs/format.md, version 2): compress() stores a table so where encoding would
        not make it smaller, so it never grows."""
        return self._masks.shape[0] == 0

    @classmethod
    def raw(cls, rows: np.ndarray, dtype: torch.dtype, dim: int, word_bits: int = 64) -> "CompressedTable":
        """A raw table of `rows` ([N, R] uint8, copied to memory that starts on a cache
        line, where lookups pool them from; a large one on huge pages, see hostmem):
        nbytes == N * R."""
        n_rows, row_bytes = rows.shape
        n_words = -(-row_bytes // (word_bits // 8))
        rel_dtype = np.uint16 if lib.ibp_rel_bytes(row_bytes) == 2 else np.uint32
        buf = hostmem.zeros(n_rows * row_bytes + 64)
        payload = buf[-buf.ctypes.data % 64:][:n_rows * row_bytes]
        payload.reshape(n_rows, row_bytes)[:] = rows
        return cls(shape=(n_rows, dim), dtype=dtype, word_bits=word_bits,
                   masks=np.zeros((0, n_words), np.uint64), bitvals=np.zeros((0, n_words), np.uint64),
                   block_base=np.zeros(0, np.uint64), rel=np.zeros(0, rel_dtype),
                   payload=payload, payload_bytes=n_rows * row_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes needed to decode: payload, tail pad, offsets index and masks (W-bit words);
        a raw table's are its rows (N * R)."""
        mask_bytes = 2 * self._masks.size * (self._word_bits // 8)
        return int(self._payload.nbytes + self._block_base.nbytes + self._rel.nbytes + mask_bytes)

    @property
    def masks(self) -> np.ndarray:
        """[clusters, words] invariant-bit masks (read-only view)."""
        return _readonly(self._masks)

    @property
    def bitvals(self) -> np.ndarray:
        return _readonly(self._bitvals)

    def row_lengths(self) -> np.ndarray:
        """Stored bytes of every row (the row size when it is stored raw)."""
        starts = self._row_starts()
        return np.diff(starts)

    def _row_starts(self) -> np.ndarray:
        if self.is_raw:
            return np.arange(self._shape[0] + 1, dtype=np.uint64) * np.uint64(self._row_bytes)
        base = np.repeat(self._block_base, 64)[: self._shape[0] + 1]
        return base + self._rel.astype(np.uint64)

    def cluster_ids(self) -> np.ndarray:
        """Cluster of every row; -1 for rows stored raw."""
        starts = self._row_starts()
        lengths = np.diff(starts)
        ids = np.full(self._shape[0], -1, dtype=np.int16)
        enc = lengths < self._row_bytes
        if self.clusters == 1:
            ids[enc] = 0
        else:
            ids[enc] = self._payload[starts[:-1][enc].astype(np.int64)]
        return ids

    def __repr__(self) -> str:
        return (f"CompressedTable(shape={self._shape}, dtype={dtype_name(self._dtype)}, "
                f"word_bits={self._word_bits}, clusters={self.clusters}, ratio={self.ratio:.3f})")

    def save(self, path) -> None:
        """Write the table to an .ibp file atomically (see :func:`ibp_embed.load`)."""
        io.save(self, path)


def load(path, mmap: bool = True, verify: bool = True) -> CompressedTable:
    """Open an .ibp file. mmap=True maps it read-only instead of reading it into memory.

    The header, the masks and the offsets index are always checked against their
    CRC-32C and for consistency, so corrupt metadata raises FormatError instead of
    crashing or decoding wrongly. verify=True also checks the payload's checksum (one
    pass over the file); with verify=False a corrupt payload is caught only where its
    structure breaks (FormatError when a row is decoded) and may otherwise decode to
    wrong values.
    """
    h, views = io.read_sections(path, mmap=mmap, verify=verify)
    dtype = dtype_from_name(h["dtype"])
    n, d = h["shape"]
    w, k = h["word_bits"], h["clusters"]
    rel_dtype = np.uint16 if lib.ibp_rel_bytes(d * dtype.itemsize) == 2 else np.uint32
    wd = {16: np.uint16, 32: np.uint32, 64: np.uint64}[w]
    m = -(-d * dtype.itemsize // (w // 8))
    try:
        return CompressedTable(
            shape=(n, d), dtype=dtype, word_bits=w,
            masks=views["masks"].view(wd).reshape(k, m).astype(np.uint64),
            bitvals=views["bitvals"].view(wd).reshape(k, m).astype(np.uint64),
            block_base=views["block_base"].view(np.uint64), rel=views["rel"].view(rel_dtype),
            payload=views["payload"], payload_bytes=h["payload_bytes"], validate=True)
    except FormatError as e:
        raise FormatError(f"{path}: {e}") from None


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


def _ndim(x) -> int:
    return x.dim() if isinstance(x, torch.Tensor) else np.ndim(x)


def check_integers(x: torch.Tensor, name: str) -> None:
    """Ids and offsets must be integers: a float is not truncated to a row, and bool (a
    mask passed for ids) is not taken as rows 0 and 1."""
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be integers, got {x.dtype}")


def check_offset_ends(off: np.ndarray, n_ids: int, name: str = "indices", who: str = "") -> None:
    """libibp takes the ids' count of a lookup (or backward) from its last offset, and
    checks only that none decreases: the first must be 0 and the last len(ids)."""
    if off[0] != 0 or off[-1] != n_ids:
        raise ValueError(f"{who}{': ' if who else ''}offsets must start at 0 and end at len({name}) = {n_ids}, "
                         f"got {int(off[0])} .. {int(off[-1])}")


def _as_index_array(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.int64 and x.device.type == "cpu" and not x.is_neg():  # 1.6 us, not 2.4
            return np.asarray(x.numpy(), order="C")
        check_integers(x, name)
        return np.asarray(x.detach().resolve_neg().to("cpu", torch.int64).numpy(), order="C")  # keeps 0-d
    a = np.asarray(x)
    if a.dtype == object and a.size and all(isinstance(v, int) for v in a.reshape(-1)):
        raise IndexError(f"{name} out of range: {max(a.reshape(-1), key=abs)} does not fit in int64")
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got {a.dtype}")
    if a.dtype.kind == "u" and a.size and a.max() > np.iinfo(np.int64).max:
        raise IndexError(f"{name} out of range")
    return np.asarray(a, dtype=np.int64, order="C")  # ascontiguousarray would make 0-d 1-d


def check_real_weights(w: torch.Tensor, who: str = "") -> None:
    """Weights must be real numbers: a complex weight's imaginary part would be dropped by
    the cast to float32 (with a warning only), a bool one taken as 0 or 1."""
    if w.is_complex() or w.dtype == torch.bool:
        raise TypeError(f"{who}{': ' if who else ''}per_sample_weights must be real numbers, got {w.dtype}")


def _as_float_array(x) -> np.ndarray:
    """Weights as float32 (real numbers only, see check_real_weights)."""
    if isinstance(x, torch.Tensor):
        check_real_weights(x)
        return np.ascontiguousarray(x.detach().resolve_neg().to("cpu", torch.float32).numpy()).reshape(-1)
    a = np.asarray(x)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"per_sample_weights must be real numbers, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32).reshape(-1)


def _id_out_of_range(ids: np.ndarray, n_rows: int, what: str) -> IndexError | None:
    """The error naming `what` and the first of ids outside [0, n_rows), or None."""
    bad = ids[(ids < 0) | (ids >= n_rows)]
    if not bad.size:
        return None
    return IndexError(f"{what}: id {int(bad[0])} out of range for a table of {n_rows} rows")


def _check_range(idx: np.ndarray, n_rows: int, what: str = "") -> None:
    if idx.size and (idx.min() < 0 or idx.max() >= n_rows):
        bad = idx[(idx < 0) | (idx >= n_rows)][0]
        raise IndexError(f"{what}: " * bool(what) + f"row index {int(bad)} out of range for a table of {n_rows} rows")
