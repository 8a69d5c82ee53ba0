"""The .ibp file: a fixed prefix, a JSON header and checksummed, aligned sections.

    bytes 0-7    magic b"\\x89IBP\\r\\n\\x1a\\n"
    bytes 8-23   u32 format version (1, or 2 for a raw table), u32 header length,
                 u32 header CRC-32C, u32 zero
    then         the JSON header (shape, dtype, word size, clusters, section table)
    then         sections at 64-byte aligned offsets: masks, bitvals, block_base, rel, payload

Every section carries a CRC-32C in the header. Saving is atomic: the file is
written beside the target under a temporary name, synced, then renamed over it.
Opening an .ibp file is ibp_embed.load (ibp_embed.table), built on read_sections.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from . import _native, hostmem
from ._native import lib
from .dtypes import dtype_from_name, dtype_name
from .errors import FormatError
from .files import atomic_file, open_regular

MAGIC = b"\x89IBP\r\n\x1a\n"
_PREFIX = struct.Struct("<8sIIII")
_ALIGN = 64
_MAX_HEADER = 1 << 20
_SECTIONS = ("masks", "bitvals", "block_base", "rel", "payload")
_WRITE_CHUNK = 64 << 20


def crc32c(data, crc: int = 0) -> int:
    buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    return int(lib.ibp_crc32c(crc, _native.ptr(buf, "const uint8_t *"), buf.size)) if buf.size else crc


def _word_dtype(word_bits: int):
    return {16: np.uint16, 32: np.uint32, 64: np.uint64}[word_bits]


def _section_arrays(t) -> dict[str, np.ndarray]:
    wd = _word_dtype(t.word_bits)
    return {
        "masks": t._masks.astype(wd), "bitvals": t._bitvals.astype(wd),
        "block_base": t._block_base, "rel": t._rel, "payload": t._payload,
    }


def save(table, path) -> None:
    """Write a CompressedTable to `path` atomically; an existing file is replaced only on success."""
    path = Path(path)
    arrays = _section_arrays(table)
    sections, offset = [], 0
    for name in _SECTIONS:
        a = arrays[name]
        sections.append({"name": name, "offset": offset, "length": int(a.nbytes), "crc32c": crc32c(a)})
        offset += -(-a.nbytes // _ALIGN) * _ALIGN
    header = {
        "format": "ibp_embed table", "shape": list(table.shape), "dtype": dtype_name(table.dtype),
        "word_bits": table.word_bits, "clusters": table.clusters,
        "payload_bytes": table._payload_bytes, "sections": sections,
    }
    body = json.dumps(header, sort_keys=True).encode()
    data_start = -(-(_PREFIX.size + len(body)) // _ALIGN) * _ALIGN
    for s in sections:
        s["offset"] += data_start
    body = json.dumps(header, sort_keys=True).encode()
    data_start2 = -(-(_PREFIX.size + len(body)) // _ALIGN) * _ALIGN
    if data_start2 != data_start:  # offsets grew the header past an alignment boundary
        shift = data_start2 - data_start
        for s in sections:
            s["offset"] += shift
        body = json.dumps(header, sort_keys=True).encode()
        data_start = data_start2
    # the oldest version that holds the table, so older readers open what they can
    version = 2 if table.is_raw else 1
    prefix = _PREFIX.pack(MAGIC, version, len(body), crc32c(body), 0)

    with atomic_file(path) as f:
        f.write(prefix + body)
        total = sum(s["length"] for s in sections)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {path.name}",
                  disable=total < (256 << 20)) as bar:
            for s in sections:
                f.seek(s["offset"])
                raw = arrays[s["name"]].reshape(-1).view(np.uint8)
                for lo in range(0, raw.size, _WRITE_CHUNK):
                    f.write(memoryview(raw[lo: lo + _WRITE_CHUNK]))
                    bar.update(min(_WRITE_CHUNK, raw.size - lo))
        f.truncate(sections[-1]["offset"] + sections[-1]["length"])  # an empty last section still ends in the file


def read_sections(path, mmap: bool = True, verify: bool = True):
    """(header, {section name: uint8 array}) of an .ibp file: read_header's checks, then
    every section's checksum (the payload's only when verify)."""
    path = Path(path)
    h = read_header(path)
    try:
        with open_regular(path) as f:
            data = np.memmap(f, dtype=np.uint8, mode="r") if mmap else _read_all(f)
    except FormatError:
        raise
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: cannot read: {e}") from None
    if data.size != h["file_size"]:
        raise FormatError(f"{path}: the file changed while it was opened")
    views = {}
    for s in h["sections"]:
        raw = data[s["offset"]: s["offset"] + s["length"]]
        if (verify or s["name"] != "payload") and crc32c(raw) != s["crc32c"]:
            raise FormatError(f"{path}: section {s['name']} checksum mismatch (corrupt file)")
        views[s["name"]] = raw
    return h, views


def _read_all(f) -> np.ndarray:
    """The rest of file f, read into memory of its own (on huge pages where large, as
    compress's payloads are: see hostmem); shorter where the file shrank meanwhile."""
    buf = hostmem.zeros(os.fstat(f.fileno()).st_size - f.tell())
    got, view = 0, memoryview(buf)
    while got < buf.size:
        n = f.readinto(view[got:])
        if not n:
            return buf[:got]
        got += n
    return buf


def read_header(path) -> dict:
    """The JSON header of an .ibp file, after checking magic, version, checksum and that
    the section table fits the table it describes and the file (see docs/format.md).

    The returned dict also holds "file_size" and "format_version" (the prefix's). Raises
    FormatError for anything else.
    """
    path = Path(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(_PREFIX.size)
            if not prefix:
                raise FormatError(f"{path}: empty file, not an .ibp file")
            if prefix[:8] != MAGIC[: len(prefix)]:
                raise FormatError(f"{path}: not an .ibp file (bad magic)")
            if len(prefix) < _PREFIX.size:
                raise FormatError(f"{path}: truncated: {len(prefix)} bytes, shorter than the "
                                  f"{_PREFIX.size}-byte file prefix")
            _, version, header_len, header_crc, reserved = _PREFIX.unpack(prefix)
            if not 1 <= version <= _native.FORMAT_VERSION:
                raise FormatError(f"{path}: format version {version}; this ibp_embed reads versions "
                                  f"1 to {_native.FORMAT_VERSION}")
            if reserved != 0:
                raise FormatError(f"{path}: the reserved prefix field is {reserved:#x}, not 0 "
                                  f"(corrupt file)")
            if header_len > _MAX_HEADER:
                raise FormatError(f"{path}: corrupt prefix: a {header_len}-byte header")
            if _PREFIX.size + header_len > size:
                raise FormatError(f"{path}: truncated: the {header_len}-byte header ends at byte "
                                  f"{_PREFIX.size + header_len}, the file has {size}")
            body = f.read(header_len)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e}") from None
    if crc32c(body) != header_crc:
        raise FormatError(f"{path}: header checksum mismatch (corrupt file)")
    try:
        header = json.loads(body)
        _check_header(header, size, _PREFIX.size + header_len, version)
    except FormatError as e:
        raise FormatError(f"{path}: {e}") from None
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as e:
        raise FormatError(f"{path}: malformed header: {type(e).__name__}: {e}") from None
    header["file_size"] = size
    header["format_version"] = version
    return header


def _int(value, what: str) -> int:
    """A JSON integer (not a bool, float or string)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise FormatError(f"malformed header: {what} is {value!r}, not an integer")
    return value


def _check_header(h: dict, file_size: int, header_end: int, version: int) -> None:
    if not isinstance(h, dict):
        raise FormatError(f"malformed header: a JSON {type(h).__name__}, not an object")
    if h.get("format") != "ibp_embed table":
        raise FormatError("not an ibp_embed table")
    shape = h["shape"]
    if not isinstance(shape, list) or len(shape) != 2:
        raise FormatError(f"malformed header: shape {shape!r} is not [rows, dim]")
    n, d = (_int(x, "shape") for x in shape)
    if not isinstance(h["dtype"], str):
        raise FormatError(f"malformed header: dtype {h['dtype']!r}")
    dtype = dtype_from_name(h["dtype"])
    w, k = _int(h["word_bits"], "word_bits"), _int(h["clusters"], "clusters")
    if k == 0 and version < 2:
        raise FormatError(f"bad table description: clusters 0 (a raw table) needs format version 2, "
                          f"the file says {version}")
    if n < 0 or n >= 1 << 62 or d < 1 or w not in (16, 32, 64) or not 0 <= k <= 256:
        raise FormatError(f"bad table description: shape {h['shape']}, word_bits {w}, clusters {k}")
    row_bytes = d * dtype.itemsize
    rel_bytes = lib.ibp_rel_bytes(row_bytes) if row_bytes < 1 << 32 else 0
    if rel_bytes == 0:
        raise FormatError(f"bad table description: rows of {row_bytes} bytes are too large")
    m = -(-row_bytes // (w // 8))
    pb = _int(h["payload_bytes"], "payload_bytes")
    if pb < 0 or pb > n * row_bytes or (k == 0 and pb != n * row_bytes):
        raise FormatError(f"bad table description: {pb} payload bytes for {n} rows of {row_bytes} bytes"
                          + (f" (a raw table has exactly {n * row_bytes})" if k == 0 else ""))
    if k == 0:  # a raw table: its rows, nothing else
        expect = {"masks": 0, "bitvals": 0, "block_base": 0, "rel": 0, "payload": pb}
    else:
        expect = {
            "masks": k * m * w // 8, "bitvals": k * m * w // 8, "block_base": 8 * (n // 64 + 1),
            "rel": rel_bytes * (n + 1), "payload": pb + lib.ibp_tail_pad(row_bytes, w),
        }
    sections = h["sections"]
    if not isinstance(sections, list) or not all(isinstance(s, dict) for s in sections) \
            or [s.get("name") for s in sections] != list(_SECTIONS):
        raise FormatError("bad section table: expected the sections " + ", ".join(_SECTIONS))
    end = header_end  # sections follow the header and each other, in order, without overlap
    for s in sections:
        name = s["name"]
        off, length = _int(s["offset"], f"{name} offset"), _int(s["length"], f"{name} length")
        crc = _int(s["crc32c"], f"{name} crc32c")
        if length != expect[name]:
            raise FormatError(f"section {name} is {length} bytes, the table needs {expect[name]}")
        if off % _ALIGN or off < end or not 0 <= crc < 1 << 32:
            raise FormatError(f"section {name} at a bad offset {off} or with a bad checksum")
        end = off + length
        if off + length > file_size:
            raise FormatError(f"truncated: section {name} ends at byte {off + length}, "
                              f"the file has {file_size}")
