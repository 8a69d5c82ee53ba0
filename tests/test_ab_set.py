"""The set-level A/B harness (benchmarks/ab_set.py) on a tiny table set."""
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import ab_set  # noqa: E402
from test_ab import package_library  # noqa: E402

# at this scale every Criteo table keeps min(its rows, 1000); --min-rows keeps the 1000-row ones
TINY = ["--scale", "1e-6", "--min-rows", "1000", "--dim", "8", "--batch", "32", "--pooling", "3",
        "--seconds", "0", "--min-rounds", "3"]


def test_builds_and_fbgemm_rotate_through_rounds(tmp_path):
    lib = package_library()
    got = ab_set.main([lib, lib, *TINY, "--dtype", "float16", "--dist", "uniform", "--results-dir", str(tmp_path)])
    (run,) = got["runs"]
    assert run["rounds"] >= 3 and set(run["median_ms"]) == {"A", "B", "fbgemm"}
    assert run["b_over_a_median"] > 0 and run["A_speed_vs_fbgemm_median"] > 0
    saved = json.loads(next(tmp_path.glob("ab_set-*.json")).read_text())
    assert saved["config"]["dtype"] == "float16" and "1000-1000 rows" in saved["config"]["label"]


def test_each_build_runs_its_own_calls(tmp_path, monkeypatch):
    """Two copies of the library (two libraries to dlopen): every lookup of a build goes
    to that build, once a round, once to warm up and once for the output check."""
    paths = [str(shutil.copy(package_library(), tmp_path / f"{name}.so")) for name in ("a", "b")]
    calls, real_load = {}, ab_set.ab.load

    class Counted:  # the loaded library, counting its batched lookups
        def __init__(self, lib, path):
            self._lib, self._path = lib, str(path)

        def __getattr__(self, name):
            if name not in ("ibp_lookup_many", "ibp_lookup_keyed"):
                return getattr(self._lib, name)

            def counted(*args):
                calls[self._path] = calls.get(self._path, 0) + 1
                return getattr(self._lib, name)(*args)
            return counted

    monkeypatch.setattr(ab_set.ab, "load", lambda path: Counted(real_load(path), path))
    got = ab_set.main([*paths, *TINY, "--results-dir", str(tmp_path)])
    rounds = got["runs"][0]["rounds"]
    assert rounds % len(ab_set.ORDERS) == 0  # whole cycles
    assert calls == {p: rounds + 2 for p in paths}


def test_dtype_without_fbgemm_kernel_times_the_builds_alone(tmp_path):
    lib = package_library()
    got = ab_set.main([lib, lib, *TINY, "--dtype", "bfloat16", "--results-dir", str(tmp_path)])
    (run,) = got["runs"]
    assert set(run["median_ms"]) == {"A", "B"} and "A_speed_vs_fbgemm_median" not in run


def test_bad_options_are_refused(tmp_path):
    lib = package_library()
    with pytest.raises(SystemExit):
        ab_set.main([lib, lib, *TINY, "--min-rows", "10000000", "--results-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        ab_set.main([lib, str(tmp_path / "missing.so"), *TINY, "--results-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        ab_set.main([lib, lib, *TINY, "--pooling", "0", "--results-dir", str(tmp_path)])
    for alpha in ("0", "-1"):  # refused before the builds are compiled
        with pytest.raises(SystemExit):
            ab_set.parse(["HEAD", ".", "--alpha", alpha])


def test_builds_whose_sums_differ_are_refused(tmp_path, monkeypatch):
    lib, calls = package_library(), []
    real = ab_set.ibp_embed.lookup_many

    def second_call_off_by_one(*args, **kwargs):  # build B's first call, as if its sums differed
        calls.append(1)
        out = real(*args, **kwargs)
        return out + 1 if len(calls) == 2 else out

    monkeypatch.setattr(ab_set.ibp_embed, "lookup_many", second_call_off_by_one)
    with pytest.raises(SystemExit, match="outputs differ"):
        ab_set.main([lib, lib, *TINY, "--results-dir", str(tmp_path)])


def test_no_system_is_timed_right_after_itself():
    orders = ab_set.ORDERS
    assert sorted(orders) == sorted(set(orders)) and len(orders) == 6
    assert all(orders[i][-1] != orders[(i + 1) % len(orders)][0] for i in range(len(orders)))
