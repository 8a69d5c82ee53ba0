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
        assert set(r["ms"]) == set(pages.SYSTEMS) and min(r["ms"].values()) > 0 and r["small_over_huge"] > 0
        small = r["huge_page_bytes"][1]
        assert small in (None, 0)  # the copy refuses huge pages
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


def test_bad_arguments():
    for bad in (["--rows", "0"], ["--rows", "1k"], ["--dim", "0"], ["--repeats", "0"], ["--batch", "0"]):
        with pytest.raises(SystemExit):
            pages.parse(bad)
