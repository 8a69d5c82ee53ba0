"""benchmarks/pages.py (a payload on huge pages against a copy on 4 KiB pages) on a tiny configuration."""
import json
import mmap
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import pages  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_NOHUGEPAGE"), reason="no MADV_NOHUGEPAGE here")


def test_both_layouts_are_timed_and_checked(tmp_path):
    got = pages.main(["--rows", "50,3000", "--dim", "16", "--batch", "64", "--pooling", "3", "--repeats", "1",
                      "--results-dir", str(tmp_path)])
    assert [(r["rows"], r["dist"]) for r in got["runs"]] == [(50, "zipf"), (50, "uniform"), (3000, "zipf"),
                                                              (3000, "uniform")]
    for r in got["runs"]:
        assert set(r["ms"]) in (set(pages.SYSTEMS), set(pages.SYSTEMS[:3]))  # MADV_COLLAPSE may be refused
        assert min(r["ms"].values()) > 0 and r["small_over_huge"] > 0
        assert r["huge_page_bytes"][pages.SYSTEMS[1]] in (None, 0)  # the copy refuses huge pages
    saved = json.loads(next(tmp_path.glob("pages-*.json")).read_text())
    assert saved["runs"] == json.loads(json.dumps(got["runs"]))


def test_the_copy_is_the_same_table_on_other_pages():
    import torch
    import ibp_embed
    t = ibp_embed.compress(torch.randn(3000, 16), progress=False)
    c = pages.on_small_pages(t)
    assert c._payload.ctypes.data != t._payload.ctypes.data and (c._payload == t._payload).all()
    assert torch.equal(c.decompress(), t.decompress())


def test_a_wrong_sum_stops_it(tmp_path, monkeypatch):
    real = pages.ibp_embed.lookup_many
    monkeypatch.setattr(pages.ibp_embed, "lookup_many", lambda ts, *a: real(ts, *a) + (ts[0]._payload.base is not None))
    with pytest.raises(SystemExit, match="differ from FBGEMM"):
        pages.main(["--rows", "40", "--dim", "8", "--batch", "16", "--pooling", "2", "--repeats", "1",
                    "--results-dir", str(tmp_path)])


def test_collapse_moves_touched_memory_onto_huge_pages():
    import numpy as np
    import torch
    from ibp_embed import hostmem
    t = torch.ones(8 << 20, dtype=torch.uint8)  # torch asks for no huge pages (NumPy would)
    if not pages.collapse_onto_huge_pages(t):
        pytest.skip("this kernel refuses MADV_COLLAPSE")
    assert hostmem.huge_pages_bytes(t.numpy()) >= hostmem.HUGE_PAGE and bool((t == 1).all())
    assert pages.collapse_onto_huge_pages(torch.ones(100, dtype=torch.uint8))  # no whole huge page: none refused


def test_benchmarks_tbes_are_on_huge_pages():
    """build_tbe (every benchmark's FBGEMM) collapses the TBE's weights, as ibp_embed's payloads ask."""
    import torch
    from ibp_embed import hostmem
    if not pages.collapse_onto_huge_pages(torch.ones(4 << 20, dtype=torch.uint8)):
        pytest.skip("this kernel refuses MADV_COLLAPSE")
    tbe = pages.build_tbe([100_000], [16], torch.float32)
    assert hostmem.huge_pages_bytes(tbe.weights_host.detach().numpy()) >= 2 * hostmem.HUGE_PAGE  # 6.4 MB


def test_bad_arguments():
    for bad in (["--rows", "0"], ["--rows", "1k"], ["--dim", "0"], ["--repeats", "0"], ["--batch", "0"]):
        with pytest.raises(SystemExit):
            pages.parse(bad)


def test_fbgemm_weights_left_on_small_pages_are_said(monkeypatch):
    """build_tbe warns where the kernel refuses to move FBGEMM's weights onto huge pages:
    a comparison with ibp_embed's huge-page payloads is then not like for like."""
    import warnings

    import torch
    from benchmarks.lookup import systems

    monkeypatch.setattr(systems, "collapse_onto_huge_pages", lambda t: False)
    with pytest.warns(RuntimeWarning, match="MADV_COLLAPSE"):
        assert systems.build_tbe([100], [8], torch.float32).collapse_refused is True  # for the JSONs
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no whole huge page to move: nothing refused
        assert systems.build_tbe([100], [8], torch.float32).collapse_refused is False
        assert systems.build_tbe([100], [8], torch.float32, huge_pages=False).collapse_refused is None


@pytest.mark.parametrize("collapsed", [False, True])
def test_demo_says_when_torch_weights_stay_on_small_pages(monkeypatch, capsys, collapsed):
    import torch
    from ibp_embed import _native, demo

    monkeypatch.setattr(demo.hostmem, "collapse", lambda address, nbytes: collapsed)
    threads = (torch.get_num_threads(), _native.lib.ibp_get_num_threads())  # the demo sets both
    try:
        assert demo.main(["--rows", "2000", "--dim", "16", "--batch-size", "32", "--pooling", "2",
                          "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads[0])
        _native.set_num_threads(threads[1])
    assert ("refused madvise(MADV_COLLAPSE)" in capsys.readouterr().out) is not collapsed
