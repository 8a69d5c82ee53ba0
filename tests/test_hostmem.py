"""ibp_embed.hostmem: payload memory, large buffers on transparent huge pages."""
import gc
import mmap
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import ibp_embed
from ibp_embed import hostmem

ROOT = Path(__file__).resolve().parent.parent
MB = 1 << 20


def thp_enabled() -> bool:
    """Whether anonymous memory that asks for huge pages can get them here."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode and hasattr(mmap, "MADV_HUGEPAGE")


needs_thp = pytest.mark.skipif(not thp_enabled(), reason="no transparent huge pages on this system")


@pytest.mark.parametrize("nbytes", [0, 1, 4095, hostmem.HUGE_PAGE - 1, hostmem.HUGE_PAGE, 5 * MB + 3])
def test_zeros_are_zero_writable_bytes(nbytes):
    buf = hostmem.zeros(nbytes)
    assert buf.dtype == np.uint8 and buf.shape == (nbytes,) and buf.flags.writeable and buf.flags.c_contiguous
    assert not buf.any()
    buf[:] = 7
    assert (buf == 7).all()


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here")
def test_large_buffers_start_on_a_huge_page_and_outlive_their_maker():
    views = [hostmem.zeros(3 * MB)[10:] for _ in range(3)]  # the mapping lives on through a view of a view
    for k, v in enumerate(views):
        v[:] = k + 1
    gc.collect()
    assert [int(v[0]) for v in views] == [1, 2, 3] and all((v == v[0]).all() for v in views)
    assert hostmem.zeros(3 * MB).ctypes.data % hostmem.HUGE_PAGE == 0
    assert hostmem.zeros(MB).base is None  # small: np.zeros's own memory


@needs_thp
def test_large_buffers_get_huge_pages():
    buf = hostmem.zeros(8 * MB)
    buf[:] = 1  # the first touch gives the pages
    assert hostmem.huge_pages_bytes(buf) >= hostmem.HUGE_PAGE


# The regression this module exists for, in a process of its own: with glibc's heap
# serving large blocks (as benchmarks.common.steady_allocations sets it), a payload
# carved from memory the process touched before got 4 KiB pages however NumPy advised,
# and lookups from memory into it took up to 1.7x the time (benchmarks.pages).
_REUSED_HEAP = textwrap.dedent("""
    import ctypes, sys, numpy as np, torch
    sys.path.insert(0, {root!r})
    import ibp_embed, ibp_embed.store
    from ibp_embed import hostmem
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(-3, 1 << 30) and libc.mallopt(-1, 2 ** 31 - 1)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    used = torch.ones(96 << 20, dtype=torch.uint8)  # heap pages touched at 4 KiB (torch asks for no huge pages), freed
    del used
    w = torch.randn(120_000, 64) * 0.01
    t = ibp_embed.compress(w, progress=False)
    t.save({path!r})
    loaded = ibp_embed.load({path!r}, mmap=False)
    raw = ibp_embed.table.CompressedTable.raw(w.view(torch.uint8).numpy().reshape(120_000, -1), torch.float32, 64)
    packed = ibp_embed.store.UpdatableTable(t).to_table()
    print(t._payload.nbytes, *(hostmem.huge_pages_bytes(u._payload) for u in (t, loaded, raw, packed)))
""")


@needs_thp
def test_payloads_get_huge_pages_where_the_heap_has_4k_pages_to_reuse(tmp_path):
    path = str(tmp_path / "t.ibp")
    out = subprocess.run([sys.executable, "-c", _REUSED_HEAP.format(root=str(ROOT), path=path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    nbytes, *huge = (int(x) for x in out.stdout.split())  # compressed, loaded, raw, repacked
    assert nbytes > 16 * MB
    assert min(huge) >= nbytes // 2, out.stdout


def test_compressed_and_loaded_tables_round_trip_from_hostmem(tmp_path):
    w = torch.randn(20_000, 64) * 0.01  # a payload over 2 MiB
    t = ibp_embed.compress(w, progress=False)
    assert t._payload.nbytes > hostmem.HUGE_PAGE
    assert torch.equal(t.decompress().view(torch.uint8), w.view(torch.uint8))
    t.save(tmp_path / "t.ibp")
    for mmap_ in (False, True):
        u = ibp_embed.load(tmp_path / "t.ibp", mmap=mmap_)
        assert torch.equal(u.decompress().view(torch.uint8), w.view(torch.uint8))
    raw = ibp_embed.table.CompressedTable.raw(w.view(torch.uint8).numpy().reshape(20_000, -1), torch.float32, 64)
    assert raw._payload.ctypes.data % 64 == 0 and torch.equal(raw.decompress(), w)


_STORE = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    import ibp_embed, ibp_embed.store
    def huge():
        return sum(int(l.split()[1]) * 1024 for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages:"))
    t = ibp_embed.compress(torch.randn(120_000, 64) * 0.01, progress=False)
    before = huge()
    u = ibp_embed.store.UpdatableTable(t)
    print(u.info()["arena_bytes"], huge() - before)
""")


@needs_thp
def test_updatable_tables_arena_gets_huge_pages():
    """libibp's store asks for huge pages for its arena (ibp_store.c, advise_huge_pages)."""
    out = subprocess.run([sys.executable, "-c", _STORE.format(root=str(ROOT))], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    arena, gained = (int(x) for x in out.stdout.split())
    assert arena > 16 * MB and gained >= arena // 2, out.stdout


@pytest.mark.parametrize("row_bytes", [16, 2000])  # u16 and u32 offsets within a block
def test_a_large_index_lies_on_hostmem_and_reads_as_before(row_bytes):
    from ibp_embed.codec import split_offsets
    rng = np.random.default_rng(0)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(row_bytes // 2, row_bytes, 1_100_000))]).astype(np.uint64)
    block_base, rel = split_offsets(offsets, row_bytes)
    assert np.array_equal(block_base, offsets[::64])
    want = (offsets - np.repeat(block_base, 64)[: offsets.size])
    assert rel.dtype == (np.uint16 if row_bytes == 16 else np.uint32) and np.array_equal(rel, want)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert rel.ctypes.data % hostmem.HUGE_PAGE == 0
