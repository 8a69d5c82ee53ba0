"""Truncated, corrupted and foreign .ibp files, which must raise FormatError: never
crash, never return wrong data; and corrupt in-memory tables decoded against a guard
page. Round trips and atomic saves: tests/test_io.py."""
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
from hypothesis import given
from hypothesis import strategies as st

import ibp_embed
from ibp_embed import CompressedTable, FormatError, io

from helpers import SECTIONS, table_sections, write_ibp
from io_cases import HYP, assert_same, raw_bytes

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- helpers

pytestmark = pytest.mark.usefixtures("one_thread")  # thousands of tiny decodes


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


def load_bytes(tmp_path, data: bytes, name="x.ibp", **kw) -> CompressedTable:
    p = tmp_path / name
    p.write_bytes(data)
    return ibp_embed.load(p, **kw)


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
    # one step a row, one plan for every step, most rows with an outlier: decode_packed_rows
    h = 1 + torch.rand(40, 32, generator=g)
    h[torch.rand(40, 32, generator=g) < 0.05] *= 1024
    tables.append(ibp_embed.compress(h.half(), word_bits=32, allow_raw=False))
    # raw tables: no tail pad, so their rows must be read exactly (the last one ends at the guard)
    tables.append(ibp_embed.compress(x[:9]))
    tables.append(ibp_embed.compress(x[:7].to(torch.float16)[:, :3].contiguous(), word_bits=64))
    wide = (torch.randn(8, 40, generator=g) * 10.0 ** torch.randint(-20, 20, (8, 40), generator=g)).float()
    tables.append(ibp_embed.compress(wide))  # vector pooling (16 floats a load) up to the guard
    tables.append(ibp_embed.compress(wide[:, :24].to(torch.bfloat16)))
    assert [t.is_raw for t in tables] == [False, False, False, False, True, True, True, True]
    total = 0
    kernels = list(ibp_embed._native.runnable_kernel_sets().values())
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
    """Every single-byte corruption of the payload, offsets index and codebook of four
    tables, decoded with the payload ending at a PROT_NONE page: FormatError or output,
    never a crash. The script then checks that an over-read does trap."""
    env = dict(os.environ, IBP_NUM_THREADS="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _GUARD_SCRIPT], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert "FUZZ OK" in r.stdout, f"corrupt data crashed the decoder (rc {r.returncode}):\n" \
                                   f"{r.stdout}\n{r.stderr[-4000:]}"
    assert r.returncode in (-signal.SIGSEGV, -signal.SIGBUS), \
        f"the guard page did not trap (rc {r.returncode}):\n{r.stdout}\n{r.stderr[-2000:]}"
