"""The A/B harness of two libibp builds (benchmarks/ab.py) on a tiny configuration."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import ab  # noqa: E402
from ibp_embed import _native  # noqa: E402

TINY = ["--rows", "3000", "--cached-rows", "200", "--batch", "64", "--pooling", "4", "--repeats", "2",
        "--dim", "16"]


def package_library() -> str:
    return str(_native.library_path)


def test_two_built_libraries_in_both_orders(tmp_path):
    lib = package_library()
    got = ab.main([lib, lib, *TINY, "--dtype", "float16", "--word-bits", "16", "--results-dir", str(tmp_path)])
    assert set(got["runs"]) == set(ab.WHAT)
    for what, orders in got["runs"].items():
        assert [r["order"] for r in orders] == ["A, B", "B, A"]
        for r in orders:
            assert r["A"]["min_s"] > 0 and r["B"]["min_s"] > 0 and r["units"] > 0
    for fresh, same in (("decode-fresh", "decode"), ("lookup-fresh", "lookup")):
        runs = got["runs"][fresh]  # a new order or batch every call, both orders ending on the same one
        assert runs[0]["digest"] == runs[1]["digest"] and runs[0]["digest"] != got["runs"][same][0]["digest"]
    for stream, same in (("lookup-stream", "lookup"), ("decode-stream", "decode")):
        runs = got["runs"][stream]  # every call ids of its own: the orders end on different ones
        assert runs[0]["digest"] != runs[1]["digest"] != got["runs"][same][0]["digest"]
    saved = json.loads(next(tmp_path.glob("ab-*.json")).read_text())
    assert saved["config"]["dtype"] == "float16" and saved["config"]["word_bits"] == 16


def test_isolated_builds_run_in_processes_of_their_own(tmp_path):
    """--isolated: each build timed in its own process, both orders, the same output."""
    lib = package_library()
    got = ab.main([lib, lib, *TINY, "--what", "decode,lookup,lookup-stream", "--isolated",
                   "--results-dir", str(tmp_path)])
    assert got["config"]["isolated"]
    for what in ("decode", "lookup", "lookup-stream"):
        orders = got["runs"][what]
        assert [r["order"] for r in orders] == ["A, B", "B, A"]
        assert orders[0]["digest"] == orders[1]["digest"]  # the same table and ids in every process
        for r in orders:
            assert r["A"]["min_s"] > 0 and r["B"]["min_s"] > 0 and r["units"] > 0


def test_swapped_runs_load_b_first_and_name_rows_for_the_builds(tmp_path):
    """--swapped: every measure again in a process that loads B first, its rows mapped
    back so that A is still build A (the libraries each name ran say so)."""
    lib = package_library()
    other = tmp_path / "copy" / "libibp.so"  # the same code under another path: a build of its own
    other.parent.mkdir()
    other.write_bytes(Path(lib).read_bytes())
    got = ab.main([lib, str(other), *TINY, "--what", "decode,lookup", "--swapped", "--results-dir", str(tmp_path)])
    assert set(got["runs"]) == {"decode", "lookup", "decode swapped", "lookup swapped"}
    for what in ("decode", "lookup"):
        swapped = got["runs"][f"{what} swapped"]
        assert [r["order"] for r in swapped] == ["B, A", "A, B"]  # its A, B order is B first
        for r in swapped:
            assert r["libs"] == {"A": lib, "B": str(other)}
            assert r["A"]["min_s"] > 0 and r["B"]["min_s"] > 0
            assert r["digest"] == got["runs"][what][0]["digest"]
    with pytest.raises(SystemExit):
        ab.main([lib, lib, *TINY, "--swapped", "--isolated"])


def test_kernel_set_is_chosen_then_given_back(tmp_path):
    lib = package_library()
    before = _native.lib.ibp_isa()
    got = ab.main([lib, lib, *TINY, "--what", "decode", "--isa", "generic", "--word-bits", "32",
                   "--results-dir", str(tmp_path)])
    assert got["config"]["isa"] == "generic"
    assert _native.lib.ibp_isa() == before  # the package's library is back on its own kernels


def test_revision_and_working_tree_are_built(tmp_path):
    got = ab.main(["HEAD", ".", *TINY, "--what", "lookup", "--dist", "uniform", "--results-dir", str(tmp_path)])
    assert [r["order"] for r in got["runs"]["lookup"]] == ["A, B", "B, A"]


def test_bad_builds_and_options_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="no such library"):
        ab.main([str(tmp_path / "missing.so"), *TINY])
    with pytest.raises(SystemExit, match="git archive"):
        ab.main(["no-such-revision-xyz", *TINY])
    for bad in (["--what", "decode,squeeze"], ["--repeats", "0"], ["--rows", "-5"], ["--clusters", "0"],
                ["--clusters", "257"], ["--alpha", "0"], ["--alpha", "nan"]):
        with pytest.raises(SystemExit):
            ab.parse(["HEAD", *bad])


def test_clusters_option_reaches_compress(monkeypatch):
    seen = []
    monkeypatch.setattr(ab, "compress", lambda weights, **kw: seen.append(kw["clusters"]))
    for extra, clusters in (([], 1), (["--clusters", "4"], 4)):
        ab.make_table(ab.parse(["HEAD", *TINY, *extra]))
        assert seen.pop() == clusters
