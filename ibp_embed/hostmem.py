"""Host memory for table payloads: large ones on transparent huge pages of their own.

A lookup into a large table reads rows scattered over all of its payload, a new 4 KiB
page with nearly every row, and each such row first waits for a page walk, which the
row decoders' prefetches (rows ahead of the decode) do not hide; on 2 MiB pages a
500 MB payload needs 250 TLB entries. NumPy asks for huge pages for its large arrays
(MADV_HUGEPAGE), but that only helps memory not yet touched: an array carved from
memory the process used before (glibc's heap, where a raised mmap threshold keeps
large blocks, as the benchmarks set it) stays on the 4 KiB pages it had, so a
table's lookups ran at one speed or the other by what the process had freed
before. `python -m benchmarks.pages` (a
payload on huge pages against a copy on 4 KiB pages, one process, 1 thread, B4096 x
P20; an AMD EPYC of the Zen 4 generation, pages-20261207T025151Z.json): 4 KiB pages
took 1.70x the time with uniform ids into 1.1M fp32 d128 rows, 1.20x into 304k rows,
1.11x into 66k; with Zipf ids 1.10x, 1.02x and 1.11x.

So payloads of 2 MiB and more get an anonymous mapping of their own, asked for huge
pages before its first touch; the kernel gives them where it can (transparent huge
pages "always" or "madvise", see /sys/kernel/mm/transparent_hugepage/enabled), and 4 KiB
pages otherwise, as before. A mapping lives as long as the arrays that view it.
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np

HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25  # linux/mman.h, Linux 6.1 and newer


def zeros(nbytes: int) -> np.ndarray:
    """nbytes zero bytes (writable uint8). From HUGE_PAGE bytes on, where the system has
    MADV_HUGEPAGE (Linux), they start on a huge page boundary of a mapping of their own
    that asks for huge pages; smaller buffers and other systems take np.zeros."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advice is None:
        return np.zeros(nbytes, dtype=np.uint8)
    # private: a shared anonymous mapping is shmem, which has huge pages of its own setting
    # (shmem_enabled, "never" by default); a huge page's slack to align in
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # huge pages off or unsupported: 4 KiB pages, as np.zeros would give
        pass
    whole = np.frombuffer(region, dtype=np.uint8)  # holds the mapping open until no view is left
    skip = -whole.ctypes.data % HUGE_PAGE
    return whole[skip: skip + nbytes]


def collapse(address: int, nbytes: int) -> bool:
    """Moves the whole huge pages of memory already in use at [address, address + nbytes)
    onto transparent huge pages (madvise MADV_COLLAPSE, Linux 6.1 and newer); returns
    False only where the kernel refused (or could not be asked): a range that holds no
    whole huge page has none to move. For memory allocated elsewhere (a torch tensor,
    whose allocator asks for no huge pages), so that a comparison puts both sides on the
    same pages."""
    lo, hi = -(-address // HUGE_PAGE) * HUGE_PAGE, (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return True
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError, TypeError):  # no C library to ask (CDLL(None): TypeError on Windows)
        return False
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise(lo, hi - lo, MADV_COLLAPSE) == 0


def huge_pages_bytes(buf: np.ndarray) -> int | None:
    """The bytes on transparent huge pages (/proc/self/smaps' AnonHugePages) of the
    mappings that buf lies in, or None where the system does not tell. smaps counts whole
    mappings, and the kernel merges neighbouring ones of the same kind: an upper bound
    for buf where its mapping holds more than buf (two TBEs' weights side by side read
    the same figure)."""
    lo = buf.ctypes.data
    hi = lo + buf.nbytes
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                field = line.split(maxsplit=2)
                if "-" in field[0] and ":" not in field[0]:  # a mapping's first line: start-end ...
                    start, end = (int(x, 16) for x in field[0].split("-"))
                    inside = start < hi and end > lo
                elif inside and field[0] == "AnonHugePages:":
                    total += int(field[1]) * 1024
    except OSError:
        return None
    return total
