"""The .ibp file: save/load round trips, atomic saves, and truncated, corrupted and
foreign files (which must raise FormatError: never crash, never return wrong data)."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ibp_embed
from ibp_embed import CompressedTable, FormatError, io
from ibp_embed._native import lib

from helpers import SECTIONS, table_sections, write_ibp

REPO = Path(__file__).resolve().parent.parent
HYP = settings(deadline=None, max_examples=40, suppress_health_check=list(HealthCheck))


# ---------------------------------------------------------------- helpers

@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Thousands of tiny decodes: thread start-up would dominate (and shared CI cores)."""
    old_torch, old_ibp = torch.get_num_threads(), lib.ibp_get_num_threads()
    torch.set_num_threads(1)
    lib.ibp_set_num_threads(1)
    yield
    torch.set_num_threads(old_torch)
    lib.ibp_set_num_threads(old_ibp)


def table_data(n: int, d: int, dtype=torch.float32, seed: int = 0, mixed: bool = False):
    """Embedding-like rows; `mixed` gives rows of very different magnitudes (for K > 1)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.randn(n, d, generator=g, dtype=torch.float64) * 0.01
        if mixed:
            scale = torch.tensor([1e-4, 1.0, 1e4, 1e-8], dtype=torch.float64)
            x = x * scale[torch.randint(0, 4, (n,), generator=g)][:, None]
        return x.to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -100), min(info.max, 100)
    return torch.randint(lo, hi, (n, d), generator=g, dtype=torch.int64).to(dtype)


def raw_bytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:  # torch cannot view some empty tensors' strides as bytes
        return b""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def assert_same(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
    assert raw_bytes(a) == raw_bytes(b)


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


def covered_ranges(path) -> list[tuple[str, int, int]]:
    """(name, start, end) of every checksummed byte range of an .ibp file."""
    h = io.read_header(path)
    hlen = struct.unpack_from("<I", Path(path).read_bytes(), 12)[0]
    out = [("prefix", 0, 24), ("header", 24, 24 + hlen)]
    out += [(s["name"], s["offset"], s["offset"] + s["length"]) for s in h["sections"]]
    return out


def region_of(pos: int, ranges) -> str | None:
    for name, lo, hi in ranges:
        if lo <= pos < hi:
            return name
    return None


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small saved table with K > 1 and some raw rows: (path, table, data, file bytes)."""
    x = table_data(150, 8, torch.float32, seed=2, mixed=True)
    x[7] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-42, -1e38, 3.0, -float("inf"), 0.0])
    t = ibp_embed.compress(x, clusters=3, word_bits=32, allow_raw=False)
    assert t.clusters > 1, "the fixture must exercise cluster ids"
    assert (t.cluster_ids() == -1).any() and (t.cluster_ids() >= 0).any()
    path = tmp_path_factory.mktemp("small") / "small.ibp"
    t.save(path)
    return path, t, x, path.read_bytes()


def load_bytes(tmp_path, data: bytes, name="x.ibp", **kw) -> CompressedTable:
    p = tmp_path / name
    p.write_bytes(data)
    return ibp_embed.load(p, **kw)


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


# ---------------------------------------------------------------- truncated files

@pytest.mark.parametrize("mmap", [True, False])
def test_every_truncation_raises(tmp_path, small, mmap):
    _, _, x, data = small
    p = tmp_path / "trunc.ibp"
    p.write_bytes(data)
    assert_same(ibp_embed.load(p, mmap=mmap).decompress(), x)
    for n in range(len(data) - 1, -1, -1):
        os.truncate(p, n)
        for verify in (True, False):
            with pytest.raises(FormatError):
                ibp_embed.load(p, mmap=mmap, verify=verify)


def test_truncation_messages(tmp_path, small):
    _, _, _, data = small
    with pytest.raises(FormatError, match="empty"):
        load_bytes(tmp_path, b"")
    with pytest.raises(FormatError, match="truncated"):
        load_bytes(tmp_path, data[:12])
    with pytest.raises(FormatError, match="truncated"):
        load_bytes(tmp_path, data[:100])
    with pytest.raises(FormatError, match="truncated.*payload"):
        load_bytes(tmp_path, data[:-1])


# ---------------------------------------------------------------- corrupted files

FLIPS = (0x01, 0x80, 0xFF)


class _Flipper:
    """Flips single bytes of a file in place (and back), faster than rewriting it."""

    def __init__(self, path, data: bytes):
        self.path, self.data = path, data
        path.write_bytes(data)
        self.fd = os.open(path, os.O_RDWR)

    def flip(self, pos: int, xor: int):
        os.pwrite(self.fd, bytes([self.data[pos] ^ xor]), pos)

    def restore(self, pos: int):
        os.pwrite(self.fd, self.data[pos: pos + 1], pos)

    def close(self):
        os.close(self.fd)


def test_every_byte_flip_is_detected(tmp_path, small):
    """verify=True: a flipped byte anywhere in a checksummed range raises FormatError; one
    in the alignment gaps between sections (no data there) leaves the table intact."""
    _, _, x, data = small
    f = _Flipper(tmp_path / "flip.ibp", data)
    ranges = covered_ranges(f.path)
    seen = set()
    for pos in range(len(data)):
        region = region_of(pos, ranges)
        for xor in FLIPS:
            f.flip(pos, xor)
            try:
                t = ibp_embed.load(f.path, mmap=False, verify=True)
            except FormatError:
                seen.add(region)
            else:
                assert region is None, f"flip {xor:#x} at byte {pos} ({region}) was not detected"
                assert_same(t.decompress(), x)
            f.restore(pos)
    f.close()
    assert seen == {"prefix", "header", *SECTIONS}


def test_index_and_codebook_flips_raise_without_verify(tmp_path, small):
    """verify=False skips only the payload checksum: flips anywhere else still raise at load."""
    _, _, x, data = small
    f = _Flipper(tmp_path / "flip.ibp", data)
    for name, lo, hi in covered_ranges(f.path):
        if name == "payload":
            continue
        for pos in range(lo, hi):
            for xor in FLIPS:
                f.flip(pos, xor)
                with pytest.raises(FormatError):
                    ibp_embed.load(f.path, mmap=False, verify=False)
                f.restore(pos)
    f.close()


def test_payload_flips_without_verify(tmp_path, small):
    """verify=False: a flipped payload byte gives FormatError (at load or decode) or some
    output, never a crash; the checksum then catches every one of them."""
    _, t, x, data = small
    f = _Flipper(tmp_path / "flip.ibp", data)
    name, lo, hi = next(r for r in covered_ranges(f.path) if r[0] == "payload")
    outcomes = {"load": 0, "decode": 0, "wrong": 0, "same": 0}
    idx = torch.arange(x.shape[0])
    off = torch.tensor(list(range(0, x.shape[0], 7)) + [x.shape[0]])
    for pos in range(lo, hi, 2):
        f.flip(pos, 0x5A)
        try:
            u = ibp_embed.load(f.path, mmap=pos % 4 == 0, verify=False)
        except FormatError:
            outcomes["load"] += 1
            f.restore(pos)
            continue
        try:
            y = u.decompress()
        except FormatError:
            outcomes["decode"] += 1
            with pytest.raises(FormatError):
                u.gather(idx)
            with pytest.raises(FormatError):
                u.lookup(idx, off)
        else:
            outcomes["same" if raw_bytes(y) == raw_bytes(x) else "wrong"] += 1
            assert_same(u.gather(idx), y)
            ref = torch.nn.functional.embedding_bag(idx, y, off[:-1], mode="sum")
            torch.testing.assert_close(u.lookup(idx, off), ref, equal_nan=True)
        with pytest.raises(FormatError, match="checksum"):
            ibp_embed.load(f.path, verify=True)
        del u
        f.restore(pos)
    f.close()
    # Corrupt cluster ids fail at load, broken bitstreams at decode; flips of data bits
    # decode to other values (only the checksum can tell), flips in the tail pad to the same.
    assert all(outcomes.values()), outcomes


@HYP
@given(flips=st.lists(st.tuples(st.integers(0, 10**9), st.integers(1, 255)), min_size=1, max_size=6),
       cut=st.one_of(st.none(), st.integers(0, 10**9)), mmap=st.booleans())
def test_random_corruption_property(tmp_path_factory, small, flips, cut, mmap):
    _, _, x, data = small
    bad = bytearray(data)
    for pos, xor in flips:
        bad[pos % len(bad)] ^= xor
    if cut is not None:
        bad = bad[: cut % len(bad)]
    p = tmp_path_factory.mktemp("fuzz") / "f.ibp"
    p.write_bytes(bytes(bad))
    try:
        t = ibp_embed.load(p, mmap=mmap, verify=True)
    except FormatError:
        pass
    else:
        assert_same(t.decompress(), x)  # only flips in the alignment gaps get through
    try:
        t = ibp_embed.load(p, mmap=mmap, verify=False)
        t.decompress()
    except FormatError:
        pass


# ---------------------------------------------------------------- foreign and malformed files

def test_foreign_files(tmp_path, small):
    cases = {
        "empty.ibp": b"",
        "short.ibp": b"\x89IB",
        "random.ibp": np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes(),
        "text.ibp": b"hello, world\n" * 50,
    }
    np.save(tmp_path / "arr.npy", np.zeros((10, 4), np.float32))
    cases["npy.ibp"] = (tmp_path / "arr.npy").read_bytes()
    torch.save(torch.zeros(10, 4), tmp_path / "t.pt")
    cases["pt.ibp"] = (tmp_path / "t.pt").read_bytes()
    for name, data in cases.items():
        for mmap in (True, False):
            with pytest.raises(FormatError):
                load_bytes(tmp_path, data, name, mmap=mmap)
            with pytest.raises(FormatError):
                io.read_header(tmp_path / name)
    with pytest.raises(FormatError):
        ibp_embed.load(tmp_path)  # a directory


@pytest.mark.parametrize("version", [0, 3, 7, 2**32 - 1])
def test_other_format_versions(tmp_path, small, version):
    _, t, _, data = small
    bad = bytearray(data)
    struct.pack_into("<I", bad, 8, version)
    with pytest.raises(FormatError, match=rf"version {version}\b"):
        load_bytes(tmp_path, bytes(bad))
    header, secs = table_sections(t)
    write_ibp(tmp_path / "v.ibp", header, secs, version=version)
    with pytest.raises(FormatError, match=rf"version {version}\b"):
        ibp_embed.load(tmp_path / "v.ibp")
    with pytest.raises(FormatError, match=rf"version {version}\b"):
        io.read_header(tmp_path / "v.ibp")


def test_reserved_field_must_be_zero(tmp_path, small):
    _, t, _, _ = small
    header, secs = table_sections(t)
    write_ibp(tmp_path / "r.ibp", header, secs, reserved=1)
    with pytest.raises(FormatError, match="reserved"):
        ibp_embed.load(tmp_path / "r.ibp")


def _mutations(h: dict, secs: dict):
    """(description, header, section bytes) of malformed files with valid checksums."""
    def edit(**kw):
        out = dict(h)
        out.update(kw)
        return out

    def sec_edit(which, **kw):
        out = dict(h)
        out["sections"] = [dict(s, **kw) if s["name"] == which else dict(s) for s in h["sections"]]
        return out

    n, d = h["shape"]
    yield "format", edit(format="something else"), secs
    yield "no format", {k: v for k, v in h.items() if k != "format"}, secs
    yield "shape 1-D", edit(shape=[n]), secs
    yield "shape 3-D", edit(shape=[n, d, 1]), secs
    yield "shape string", edit(shape="12"), secs
    yield "shape floats", edit(shape=[n + 0.5, d]), secs
    yield "shape bools", edit(shape=[True, True]), secs
    yield "more rows", edit(shape=[n + 1, d]), secs
    yield "fewer rows", edit(shape=[n - 1, d]), secs
    yield "negative rows", edit(shape=[-1, d]), secs
    yield "zero dim", edit(shape=[n, 0]), secs
    yield "huge dim", edit(shape=[n, 2**40]), secs
    yield "huge rows", edit(shape=[2**62, d]), secs
    yield "dtype other size", edit(dtype="float64"), secs
    yield "dtype complex", edit(dtype="complex64"), secs
    yield "dtype unknown", edit(dtype="float33"), secs
    yield "dtype not a dtype", edit(dtype="nn"), secs
    yield "dtype number", edit(dtype=5), secs
    yield "word bits 8", edit(word_bits=8), secs
    # (Another word size gives sections of the same sizes when rows are whole 8-byte words:
    # only decoding can tell, so it is not a header check.)
    yield "word bits string", edit(word_bits="32"), secs
    yield "clusters 0", edit(clusters=0), secs
    yield "clusters 257", edit(clusters=257), secs
    yield "clusters other", edit(clusters=h["clusters"] + 1), secs
    yield "payload bytes", edit(payload_bytes=h["payload_bytes"] + 1), secs
    yield "payload bytes less", edit(payload_bytes=h["payload_bytes"] - 1), secs
    yield "payload bytes negative", edit(payload_bytes=-1), secs
    yield "sections missing", edit(sections=h["sections"][:-1]), secs
    yield "sections dup", edit(sections=h["sections"][:-1] + [h["sections"][0]]), secs
    yield "sections reordered", edit(sections=h["sections"][::-1]), secs
    yield "sections not list", edit(sections={"masks": 1}), secs
    yield "section not dict", edit(sections=[1, 2, 3, 4, 5]), secs
    yield "sections renamed", sec_edit("rel", name="offsets"), secs
    for name in SECTIONS:
        s = next(x for x in h["sections"] if x["name"] == name)
        yield f"{name} misaligned", sec_edit(name, offset=s["offset"] + 8), secs
        yield f"{name} offset negative", sec_edit(name, offset=-64), secs
        yield f"{name} offset in prefix", sec_edit(name, offset=0), secs
        yield f"{name} past the end", sec_edit(name, offset=s["offset"] + (1 << 20)), secs
        yield f"{name} longer", sec_edit(name, length=s["length"] + 1), secs
        yield f"{name} shorter", sec_edit(name, length=s["length"] - 1), secs
        yield f"{name} offset float", sec_edit(name, offset=float(s["offset"])), secs
        yield f"{name} crc wrong", sec_edit(name, crc32c=s["crc32c"] ^ 1), secs
        yield f"{name} crc string", sec_edit(name, crc32c="0"), secs
    yield "header a list", [h], secs
    yield "header a number", 5, secs
    yield "header null", None, secs


def test_malformed_headers(tmp_path, small):
    """Headers with valid checksums but wrong content: FormatError, whatever is wrong."""
    _, t, x, _ = small
    header, secs = table_sections(t)
    write_ibp(tmp_path / "ok.ibp", header, secs)
    h = io.read_header(tmp_path / "ok.ibp")
    del h["file_size"]
    data = (tmp_path / "ok.ibp").read_bytes()
    hlen = struct.unpack_from("<I", data, 12)[0]
    first = min(s["offset"] for s in h["sections"])
    for what, mh, ms in _mutations(h, secs):
        body = json.dumps(mh).encode()
        assert 24 + len(body) <= first, what
        body = body + b" " * (hlen - len(body)) if len(body) < hlen else body
        bad = bytearray(data)
        struct.pack_into("<II", bad, 12, len(body), io.crc32c(body))
        bad[24: 24 + len(body)] = body
        p = tmp_path / "bad.ibp"
        p.write_bytes(bytes(bad))
        for verify in (True, False) if what != "payload crc wrong" else (True,):
            try:
                u = ibp_embed.load(p, verify=verify)
            except FormatError:
                continue
            except Exception as e:  # noqa: BLE001
                pytest.fail(f"{what}: {type(e).__name__}: {e}")
            pytest.fail(f"{what}: loaded ({u}) from a malformed header")


@pytest.mark.parametrize("body", [b"{", b"\xff\xfe", b"[" * 100000, b"null", b'{"format": 1}',
                                  b"{}", b'"ibp_embed table"'])
def test_unparseable_headers(tmp_path, small, body):
    _, t, _, _ = small
    header, secs = table_sections(t)
    write_ibp(tmp_path / "u.ibp", header, secs, raw_header=body)
    with pytest.raises(FormatError):
        ibp_embed.load(tmp_path / "u.ibp")


def test_header_length_field(tmp_path, small):
    _, _, _, data = small
    for hlen in (0, 1, 2**20 + 1, 2**32 - 1, len(data)):
        bad = bytearray(data)
        struct.pack_into("<I", bad, 12, hlen)
        with pytest.raises(FormatError):
            load_bytes(tmp_path, bytes(bad))


# ---------------------------------------------------------------- no out-of-bounds reads

_GUARD_SCRIPT = textwrap.dedent(r"""
    import ctypes, faulthandler, mmap, sys
    import numpy as np, torch
    faulthandler.enable()
    import ibp_embed
    from ibp_embed import CompressedTable, FormatError
    from ibp_embed._native import lib

    PAGE = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _keep = []

    def guarded(n):
        # n writable bytes that end exactly where a PROT_NONE page begins.
        pages = -(-n // PAGE) + 1
        mm = mmap.mmap(-1, pages * PAGE + PAGE)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        assert libc.mprotect(addr + pages * PAGE, PAGE, 0) == 0
        _keep.append(mm)
        start = pages * PAGE - n
        return np.frombuffer(mm, np.uint8)[start: start + n]

    def rebuild(t, **over):
        a = dict(shape=t.shape, dtype=t.dtype, word_bits=t.word_bits, masks=t._masks,
                 bitvals=t._bitvals, block_base=t._block_base, rel=t._rel,
                 payload=t._payload, payload_bytes=t._payload_bytes)
        a.update(over)
        return CompressedTable(**a)

    def exercise(t):
        n = t.shape[0]
        try:
            t.decompress()
        except FormatError:
            pass
        idx = np.arange(n)[::-1].copy()
        try:
            t.gather(idx)
        except FormatError:
            pass
        if t.dtype in (torch.float32, torch.float16, torch.bfloat16):
            try:
                t.lookup(idx, np.r_[np.arange(0, n, 5), n])
            except FormatError:
                pass
        t.cluster_ids(); t.row_lengths()

    def fuzz(t, field, arr, xors):
        count = 0
        flat = arr.view(np.uint8).reshape(-1)
        g = guarded(arr.size) if field == "payload" else None
        for pos in range(flat.size):
            for xor in xors:
                bad = arr.copy()
                bad.view(np.uint8).reshape(-1)[pos] ^= xor
                if g is not None:  # the payload ends at the guard page
                    g[:] = bad
                    bad = g
                try:
                    u = rebuild(t, **{field: bad})
                except FormatError:
                    continue
                exercise(u)
                count += 1
        return count

    tables = []
    g = torch.Generator().manual_seed(1)
    scale = torch.tensor([1e-4, 1.0, 1e4])[torch.randint(0, 3, (90,), generator=g)]
    x = (torch.randn(90, 6, generator=g) * scale[:, None]).float()
    tables.append(ibp_embed.compress(x, clusters=3, word_bits=32, allow_raw=False))
    tables.append(ibp_embed.compress(x[:70].to(torch.bfloat16)[:, :5].contiguous(), word_bits=64, allow_raw=False))
    tables.append(ibp_embed.compress((x[:80] * 100).to(torch.int8), word_bits=16, allow_raw=False))
    # raw tables: no tail pad, so their rows must be read exactly (the last one ends at the guard)
    tables.append(ibp_embed.compress(x[:9]))
    tables.append(ibp_embed.compress(x[:7].to(torch.float16)[:, :3].contiguous(), word_bits=64))
    wide = (torch.randn(8, 40, generator=g) * 10.0 ** torch.randint(-20, 20, (8, 40), generator=g)).float()
    tables.append(ibp_embed.compress(wide))  # vector pooling (16 floats a load) up to the guard
    tables.append(ibp_embed.compress(wide[:, :24].to(torch.bfloat16)))
    assert [t.is_raw for t in tables] == [False, False, False, True, True, True, True]
    total = 0
    kernels = [isa for isa in (0, 1, 2) if isa <= lib.ibp_isa()]
    for isa in kernels:
        assert lib.ibp_set_isa(isa) == 0
        for t in tables:
            payload = np.asarray(t._payload).copy()
            g = guarded(payload.size); g[:] = payload
            t = rebuild(t, payload=g)
            exercise(t)
            total += fuzz(t, "payload", payload, (0x01, 0x10, 0xA5))
            total += fuzz(t, "rel", t._rel, (0x01, 0x04, 0x80))
            total += fuzz(t, "block_base", t._block_base, (0x01, 0x40))
            total += fuzz(t, "masks", t._masks, (0x01, 0x80))
            total += fuzz(t, "bitvals", t._bitvals, (0x02,))
    print("FUZZ OK", total, flush=True)

    # Control: the guard page really traps. Decoding the last row of a table whose
    # tail pad is cut off must read past the end (the bit reader loads 8 bytes).
    t = tables[0]
    assert t.row_lengths()[-1] < t.shape[1] * 4, "the control needs an encoded last row"
    cut = guarded(t._payload_bytes)
    cut[:] = np.asarray(t._payload)[: t._payload_bytes]
    t._c.payload = ibp_embed._native.ptr(cut, "const uint8_t *")
    t.gather([t.shape[0] - 1])
    print("GUARD DID NOT TRAP", flush=True)
    sys.exit(3)
""")


def test_corrupt_tables_never_read_out_of_bounds():
    """Every single-byte corruption of the payload, offsets index and codebook of three
    tables, decoded with the payload ending at a PROT_NONE page: FormatError or output,
    never a crash. The script then checks that an over-read does trap."""
    env = dict(os.environ, IBP_NUM_THREADS="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _GUARD_SCRIPT], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert "FUZZ OK" in r.stdout, f"corrupt data crashed the decoder (rc {r.returncode}):\n" \
                                   f"{r.stdout}\n{r.stderr[-4000:]}"
    assert r.returncode in (-signal.SIGSEGV, -signal.SIGBUS), \
        f"the guard page did not trap (rc {r.returncode}):\n{r.stdout}\n{r.stderr[-2000:]}"
