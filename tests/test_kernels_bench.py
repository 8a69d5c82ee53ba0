"""benchmarks/kernels.py (every kernel set's decode speed) on a tiny configuration."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import kernels  # noqa: E402
from helpers import kernel_sets  # noqa: E402
from ibp_embed import _native  # noqa: E402


def test_every_runnable_set_is_timed_and_the_picked_one_kept(tmp_path):
    before = _native.lib.ibp_isa()
    got = kernels.main(["--rows", "1000", "--repeats", "1", "--results-dir", str(tmp_path)])
    assert _native.lib.ibp_isa() == before
    assert sorted(got["config"]["sets"].values()) == sorted(kernel_sets())
    assert len(got["runs"]) == len(kernels.INITS) * len(kernels.CASES) * len(kernels.WORD_BITS)
    for run in got["runs"]:
        assert set(run["ns_per_row"]) == set(got["config"]["sets"]) and min(run["ns_per_row"].values()) > 0
    saved = json.loads(next(tmp_path.glob("kernels-*.json")).read_text())
    assert saved["runs"] == json.loads(json.dumps(got["runs"]))
