"""The .ibp file: save/load round trips, the documented layout, and atomic saves.
Truncated, corrupted, foreign and malformed files: tests/test_io_corruption.py."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ibp_embed
from ibp_embed import CompressedTable, FormatError, io
from ibp_embed._native import lib

from helpers import SECTIONS, table_sections, write_ibp
from io_cases import HYP, assert_same, table_data


# ---------------------------------------------------------------- helpers

pytestmark = pytest.mark.usefixtures("one_thread")  # thousands of tiny decodes


def assert_same_table(t: CompressedTable, u: CompressedTable, x: torch.Tensor):
    assert (u.shape, u.dtype, u.word_bits, u.clusters) == (t.shape, t.dtype, t.word_bits, t.clusters)
    assert (u.nbytes, u.raw_nbytes) == (t.nbytes, t.raw_nbytes)
    np.testing.assert_array_equal(u.masks, t.masks)
    np.testing.assert_array_equal(u.bitvals, t.bitvals)
    np.testing.assert_array_equal(u.row_lengths(), t.row_lengths())
    np.testing.assert_array_equal(u.cluster_ids(), t.cluster_ids())
    assert_same(u.decompress(), x)
    if x.shape[0]:
        idx = torch.tensor([x.shape[0] - 1, 0, x.shape[0] // 2, 0])
        assert_same(u.gather(idx), x[idx])
        if x.dtype in (torch.float32, torch.float16, torch.bfloat16):
            off = torch.tensor([0, 1, 4])
            ref = torch.nn.functional.embedding_bag(idx, x.float(), off[:-1], mode="sum")
            torch.testing.assert_close(u.lookup(idx, off), ref)


def empty_table(d: int = 8, dtype=torch.float32, word_bits: int = 32) -> CompressedTable:
    """A 0-row table built directly from its sections (see docs/format.md)."""
    r = d * dtype.itemsize
    m = -(-r // (word_bits // 8))
    rel = np.zeros(1, np.uint16 if lib.ibp_rel_bytes(r) == 2 else np.uint32)
    return CompressedTable(shape=(0, d), dtype=dtype, word_bits=word_bits,
                           masks=np.zeros((1, m), np.uint64), bitvals=np.zeros((1, m), np.uint64),
                           block_base=np.zeros(1, np.uint64), rel=rel,
                           payload=np.zeros(lib.ibp_tail_pad(r, word_bits), np.uint8), payload_bytes=0)


# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("dtype,d", [(torch.float32, 16), (torch.bfloat16, 13), (torch.float16, 7),
                                     (torch.int8, 5), (torch.int64, 3), (torch.float64, 4)])
def test_round_trip(tmp_path, dtype, d, mmap, verify):
    x = table_data(300, d, dtype, seed=d)
    t = ibp_embed.compress(x)
    t.save(tmp_path / "t.ibp")
    u = ibp_embed.load(tmp_path / "t.ibp", mmap=mmap, verify=verify)
    assert_same_table(t, u, x)


@pytest.mark.parametrize("word_bits", [16, 32, 64])
@pytest.mark.parametrize("d", [1, 3, 8])  # bf16 rows of 2, 6, 16 bytes: padded for most W
@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip_word_sizes(tmp_path, word_bits, d, mmap):
    x = table_data(200, d, torch.bfloat16, seed=word_bits + d)
    t = ibp_embed.compress(x, word_bits=word_bits)
    assert t.word_bits == word_bits
    t.save(tmp_path / "t.ibp")
    assert_same_table(t, ibp_embed.load(tmp_path / "t.ibp", mmap=mmap), x)


@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip_clusters(tmp_path, mmap, small):
    _, t, x, _ = small
    t.save(tmp_path / "k.ibp")
    u = ibp_embed.load(tmp_path / "k.ibp", mmap=mmap)
    assert u.clusters == t.clusters > 1
    assert_same_table(t, u, x)


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("verify", [True, False])
def test_round_trip_one_row(tmp_path, mmap, verify):
    x = table_data(1, 9, torch.float32)
    t = ibp_embed.compress(x)
    t.save(tmp_path / "one.ibp")
    assert_same_table(t, ibp_embed.load(tmp_path / "one.ibp", mmap=mmap, verify=verify), x)


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("word_bits", [16, 64])
def test_round_trip_zero_rows_file(tmp_path, mmap, word_bits):
    t = empty_table(d=5, dtype=torch.bfloat16, word_bits=word_bits)
    t.save(tmp_path / "zero.ibp")
    u = ibp_embed.load(tmp_path / "zero.ibp", mmap=mmap)
    assert u.shape == (0, 5) and u.dtype == torch.bfloat16 and len(u) == 0
    assert u.decompress().shape == (0, 5) and u.gather([]).shape == (0, 5)
    assert u.lookup([], [0]).shape == (0, 5) and u.lookup([], [0, 0]).shape == (1, 5)
    assert u.ratio == 1.0 and u.nbytes == t.nbytes
    assert u.cluster_ids().shape == (0,) and u.row_lengths().shape == (0,)


def test_compress_zero_rows_round_trip(tmp_path):
    x = torch.empty(0, 8, dtype=torch.float32)
    t = ibp_embed.compress(x)
    t.save(tmp_path / "zero.ibp")
    assert_same_table(t, ibp_embed.load(tmp_path / "zero.ibp"), x)


def test_file_matches_the_documented_layout(tmp_path, small):
    """A file written from docs/format.md alone loads, and save() writes the same bytes."""
    _, t, x, data = small
    header, secs = table_sections(t)
    write_ibp(tmp_path / "doc.ibp", header, secs)
    assert_same_table(t, ibp_embed.load(tmp_path / "doc.ibp"), x)
    assert data[:8] == b"\x89IBP\r\n\x1a\n"
    version, hlen, hcrc, zero = struct.unpack_from("<IIII", data, 8)
    assert (version, zero) == (1, 0) and hcrc == io.crc32c(data[24:24 + hlen])
    h = json.loads(data[24:24 + hlen])
    assert [s["name"] for s in h["sections"]] == list(SECTIONS)
    for s in h["sections"]:
        assert s["offset"] % 64 == 0 and s["offset"] >= 24 + hlen
        chunk = data[s["offset"]: s["offset"] + s["length"]]
        assert chunk == secs[s["name"]] and io.crc32c(chunk) == s["crc32c"]
    assert io.crc32c(b"123456789") == 0xE3069283


def test_read_header(small):
    path, t, _, data = small
    h = io.read_header(path)
    assert h["format"] == "ibp_embed table"
    assert h["shape"] == list(t.shape) and h["dtype"] == "float32"
    assert (h["word_bits"], h["clusters"]) == (t.word_bits, t.clusters)
    assert h["file_size"] == len(data) and h["payload_bytes"] == t._payload_bytes
    assert [s["name"] for s in h["sections"]] == list(SECTIONS)
    with pytest.raises(FormatError, match="not an .ibp"):
        io.read_header(Path(__file__))


def test_mmap_keeps_file_mapped(tmp_path, small):
    _, t, x, _ = small
    t.save(tmp_path / "m.ibp")
    u = ibp_embed.load(tmp_path / "m.ibp", mmap=True)
    assert isinstance(u._payload.base, np.memmap) or isinstance(u._payload, np.memmap)
    v = ibp_embed.load(tmp_path / "m.ibp", mmap=False)
    assert not isinstance(v._payload, np.memmap) and not isinstance(v._payload.base, np.memmap)


@HYP
@given(n=st.integers(0, 70), d=st.integers(1, 9),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64]),
       word_bits=st.sampled_from([None, 16, 32, 64]), clusters=st.integers(1, 3),
       mmap=st.booleans(), seed=st.integers(0, 2**16))
def test_round_trip_property(tmp_path_factory, n, d, dtype, word_bits, clusters, mmap, seed):
    x = table_data(n, d, dtype, seed=seed, mixed=seed % 2 == 0)
    if n == 0:
        t = empty_table(d, dtype, word_bits or 32)
    else:
        t = ibp_embed.compress(x, word_bits=word_bits, clusters=clusters)
    path = tmp_path_factory.mktemp("prop") / "p.ibp"
    t.save(path)
    assert_same_table(t, ibp_embed.load(path, mmap=mmap), x)


# ---------------------------------------------------------------- atomic saves

def test_save_replaces_existing_file(tmp_path):
    a, b = table_data(50, 4, seed=1), table_data(80, 6, seed=2)
    path = tmp_path / "t.ibp"
    ibp_embed.compress(a).save(path)
    old = ibp_embed.load(path, mmap=True)  # a reader holding the old file mapped
    ibp_embed.compress(b).save(path)
    assert_same(ibp_embed.load(path).decompress(), b)
    assert_same(old.decompress(), a)  # the old inode is untouched: rename, not rewrite
    assert sorted(os.listdir(tmp_path)) == ["t.ibp"]


@pytest.mark.parametrize("mmap", [True, False])
def test_resave_loaded_table(tmp_path, small, mmap):
    """A loaded table saves to the same bytes, even over the file it is mapped from."""
    path, _, x, data = small
    p = tmp_path / "copy.ibp"
    p.write_bytes(data)
    t = ibp_embed.load(p, mmap=mmap)
    t.save(tmp_path / "other.ibp")
    assert (tmp_path / "other.ibp").read_bytes() == data
    t.save(p)
    assert p.read_bytes() == data
    assert_same(t.decompress(), x)
    assert sorted(os.listdir(tmp_path)) == ["copy.ibp", "other.ibp"]


class _FailingFile:
    """Wraps a file object; the n-th write raises `exc`."""

    def __init__(self, f, fail_at: int, exc: BaseException):
        self._f, self._left, self._exc = f, fail_at, exc

    def write(self, b):
        self._left -= 1
        if self._left < 0:
            raise self._exc
        return self._f.write(b)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return self._f.__exit__(*a)


@pytest.mark.parametrize("fail_at", [0, 1, 3])
@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_failed_save_leaves_old_file(tmp_path, monkeypatch, fail_at, exc):
    a, b = table_data(50, 4, seed=1), table_data(500, 32, seed=2)
    path = tmp_path / "t.ibp"
    ibp_embed.compress(a).save(path)
    before = path.read_bytes()
    real_fdopen = os.fdopen
    monkeypatch.setattr(io.os, "fdopen", lambda *a, **k: _FailingFile(real_fdopen(*a, **k), fail_at, exc))
    with pytest.raises(type(exc)):
        ibp_embed.compress(b).save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["t.ibp"], "temporary file left behind"
    assert_same(ibp_embed.load(path).decompress(), a)


def test_failed_fsync_leaves_old_file(tmp_path, monkeypatch):
    path = tmp_path / "t.ibp"
    ibp_embed.compress(table_data(50, 4, seed=1)).save(path)
    before = path.read_bytes()

    def boom(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(io.os, "fsync", boom)
    with pytest.raises(OSError):
        ibp_embed.compress(table_data(60, 4, seed=2)).save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["t.ibp"]


def test_save_into_missing_directory(tmp_path):
    with pytest.raises(OSError):
        ibp_embed.compress(table_data(5, 4)).save(tmp_path / "nope" / "t.ibp")
    assert os.listdir(tmp_path) == []
