"""Tables, checks and an independent .ibp writer shared by the tests."""
from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path

import numpy as np
import torch

from ibp_embed import CompressedTable, io

WORD_BITS = (16, 32, 64)
ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64,
              torch.float64, torch.uint8, torch.bool, torch.int16, torch.int32)
LOOKUP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SECTIONS = ("masks", "bitvals", "block_base", "rel", "payload")


def kernel_sets() -> list[int]:
    """The instruction sets (IBP_ISA_*) whose kernels libibp can run on this CPU."""
    from ibp_embed._native import runnable_kernel_sets

    return list(runnable_kernel_sets().values())


_poisoned = {"depth": 0, "real": None}  # poisoned_empty's nesting, and what it replaced


@contextlib.contextmanager
def poisoned_empty():
    """Inside, torch.empty and np.empty return filled memory (NaN where the dtype is a
    float, 0xA5 bytes otherwise): an output that a kernel leaves unwritten then fails
    its check, instead of holding what an earlier call wrote into the same freed block
    (glibc hands a freed block of the same size back). Booleans read 0xA5 as True: only
    a byte comparison (assert_bits_equal, assert_decodes) sees an unwritten True.
    Reentrant: nested or interleaved uses patch once and restore once."""
    if not _poisoned["depth"]:
        real_torch, real_np = _poisoned["real"] = torch.empty, np.empty

        def torch_empty(*args, **kwargs):
            x = real_torch(*args, **kwargs)
            with torch.no_grad():  # library code makes leaf tensors that require grad
                if x.is_floating_point():
                    x.fill_(float("nan"))
                elif x.numel() and x.is_contiguous() and x.dim():
                    x.view(torch.uint8).fill_(0xA5)
            return x

        def np_empty(*args, **kwargs):
            x = real_np(*args, **kwargs)
            if x.dtype.kind in "fc":
                x.fill(np.nan)
            elif x.size and x.dtype.kind in "biuV" and not x.dtype.hasobject and (x.flags.c_contiguous or
                                                                                  x.flags.f_contiguous):
                x.ravel(order="K").view(np.uint8).fill(0xA5)
            return x

        torch.empty, np.empty = torch_empty, np_empty
    _poisoned["depth"] += 1
    try:
        yield
    finally:
        _poisoned["depth"] -= 1
        if not _poisoned["depth"]:
            torch.empty, np.empty = _poisoned["real"]


def every_isa():
    """Runs the loop body once per instruction set whose kernels libibp can run on this
    CPU, with that set's kernels, the outputs of torch.empty and np.empty poisoned (see
    poisoned_empty: the sets would otherwise find each other's outputs in the blocks they
    free); the set libibp picked again afterwards."""
    from ibp_embed._native import lib

    before = lib.ibp_isa()
    try:
        with poisoned_empty():
            for isa in kernel_sets():
                assert lib.ibp_set_isa(isa) == 0
                yield isa
    finally:
        lib.ibp_set_isa(before)


def assert_decodes(table, want, ids=None, msg=None):
    """libibp decodes rows `ids` of table (None: every row) to exactly want's bytes (want:
    a tensor of rows, or their uint8 bytes), into a buffer first filled with their
    complement: a byte a decoder leaves unwritten fails too. (gather's and decompress's
    np.empty can hand back the buffer that the previous instruction set filled
    correctly.)"""
    from ibp_embed import _native

    if isinstance(want, torch.Tensor):
        want = want.contiguous().view(torch.uint8).numpy()
    want_bytes = np.asarray(want, dtype=np.uint8)
    assert want_bytes.ndim == 2
    if not want_bytes.shape[0]:  # decompress and gather make no call either
        return
    out = np.ascontiguousarray(~want_bytes)
    if ids is None:
        rc = table._native_decode(_native.ffi.NULL, 0, _native.ptr(out, "uint8_t *"))
    else:
        idx = np.ascontiguousarray(torch.as_tensor(ids).numpy(), dtype=np.int64)
        assert idx.shape == (want.shape[0],)
        rc = table._native_decode(_native.ptr(idx, "const int64_t *"), idx.size, _native.ptr(out, "uint8_t *"))
    _native.check(rc, "decode")
    assert np.array_equal(out, want_bytes), msg


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor):
    """Same dtype, shape and bytes (NaN payloads, signed zeros and all)."""
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def from_bytes(raw: np.ndarray, dtype: torch.dtype, n: int, dim: int) -> torch.Tensor:
    """uint8 [n, dim * itemsize] -> [n, dim] tensor of dtype (the same bits)."""
    if n == 0:
        return torch.empty((0, dim), dtype=dtype)
    return torch.from_numpy(np.ascontiguousarray(raw)).view(dtype).reshape(n, dim)


def to_bytes(w: torch.Tensor) -> np.ndarray:
    """[n, dim] tensor -> its rows as uint8 [n, dim * itemsize]."""
    return w.contiguous().view(torch.uint8).reshape(w.shape[0], w.shape[1] * w.element_size()).numpy()


def random_bits(n: int, dim: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Uniformly random bit patterns (bool: random 0/1)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, dim * dtype.itemsize), dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    return from_bytes(raw, dtype, n, dim)


def structured(n: int, dim: int, dtype: torch.dtype, seed: int = 0, noise_frac: float = 0.3) -> torch.Tensor:
    """Rows sharing a base pattern, with a fraction of their bits random: many invariant bits."""
    rng = np.random.default_rng(seed)
    r = dim * dtype.itemsize
    base = rng.integers(0, 256, size=r, dtype=np.uint8)
    noise_mask = (rng.random((r, 8)) < noise_frac) @ (1 << np.arange(8))
    noise = rng.integers(0, 256, size=(n, r), dtype=np.uint8) & noise_mask.astype(np.uint8)
    raw = base ^ noise
    if dtype == torch.bool:
        raw &= 1
    return from_bytes(raw, dtype, n, dim)


def magnitude_clusters(n=256, dim=16, seed=0, scales=(1e-6, 1e-2, 1e2, 1e6)) -> torch.Tensor:
    """Rows from four groups of very different magnitudes: four exponent patterns."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor(scales)
    group = torch.arange(n) % 4
    return torch.randn(n, dim, generator=g) * scales[group][:, None]


def write_ibp(path, header: dict, sections: dict, *, version: int = 1, reserved: int = 0,
              raw_header: bytes | None = None):
    """Write an .ibp file following docs/format.md, independently of ibp_embed.io.save.

    header["sections"] is filled in from `sections` (name -> bytes) unless already present.
    """
    header = dict(header)
    if "sections" not in header:
        secs, off = [], 0
        for name in SECTIONS:
            b = sections[name]
            secs.append({"name": name, "offset": off, "length": len(b), "crc32c": io.crc32c(b)})
            off += -(-len(b) // 64) * 64
        header["sections"] = secs
        for base in range(64, 1 << 22, 64):  # the first aligned offset past the header
            for s, o in zip(secs, [x["offset"] for x in secs]):
                s["offset"] = o + base
            body = json.dumps(header).encode()
            if 24 + len(body) <= base:
                break
            for s, o in zip(secs, [x["offset"] for x in secs]):
                s["offset"] = o - base
    body = raw_header if raw_header is not None else json.dumps(header).encode()
    data = bytearray(struct.pack("<8sIIII", io.MAGIC, version, len(body), io.crc32c(body), reserved))
    data += body
    for s in header.get("sections", []) if isinstance(header.get("sections"), list) else []:
        if isinstance(s, dict) and s.get("name") in sections and isinstance(s.get("offset"), int):
            b = sections[s["name"]]
            if len(data) < s["offset"]:
                data += bytes(s["offset"] - len(data))
            data[s["offset"]: s["offset"] + len(b)] = b
    Path(path).write_bytes(bytes(data))


def table_sections(t: CompressedTable) -> tuple[dict, dict]:
    """(header fields, section bytes) of a table, per docs/format.md."""
    wd = {16: np.uint16, 32: np.uint32, 64: np.uint64}[t.word_bits]
    header = {"format": "ibp_embed table", "shape": list(t.shape),
              "dtype": str(t.dtype).removeprefix("torch."), "word_bits": t.word_bits,
              "clusters": t.clusters, "payload_bytes": t._payload_bytes}
    secs = {"masks": t.masks.astype(wd).tobytes(), "bitvals": t.bitvals.astype(wd).tobytes(),
            "block_base": t._block_base.tobytes(), "rel": t._rel.tobytes(),
            "payload": np.asarray(t._payload).tobytes()}
    return header, secs


def lane_extras(t) -> list[list[int]]:
    """Each step's lanes' extras (W - vbits, cluster 0) of a W = 16 table t."""
    extras = [bin(int(m)).count("1") for m in np.asarray(t.masks)[0]]  # a mask's bits: the invariant ones
    return [sorted(set(extras[s: s + 32]) - {0}) for s in range(0, len(extras), 32)]
