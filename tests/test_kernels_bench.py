"""benchmarks/kernels.py (every kernel set's decode speed) on a tiny configuration."""
import json
import sys
from pathlib import Path

import numpy as np

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
        for mode in ("ns_per_row_fresh", "ns_per_row_repeated"):
            assert set(run[mode]) == set(got["config"]["sets"]) and min(run[mode].values()) > 0
    saved = json.loads(next(tmp_path.glob("kernels-*.json")).read_text())
    assert saved["runs"] == json.loads(json.dumps(got["runs"]))


def test_fresh_orders_are_new_orders_of_the_same_rows_taken_in_turn():
    from benchmarks import common
    ids = np.arange(100, 1100, dtype=np.int64)
    orders = common.fresh_orders(ids)
    assert len(orders) == common.FRESH_ORDERS
    assert all(np.array_equal(np.sort(o), ids) and o.flags.c_contiguous for o in orders)
    assert len({o.tobytes() for o in orders}) == len(orders)  # every call a new order
    seen = []
    call = common.in_turn([lambda k=k: seen.append(k) for k in range(3)])
    for _ in range(7):
        call()
    assert seen == [0, 1, 2, 0, 1, 2, 0]


def test_each_round_takes_its_own_order_of_the_sets(monkeypatch, tmp_path):
    from benchmarks import common
    seen = []
    timed = common.time_interleaved

    def spy(fns, **kw):
        seen.append(kw.get("shuffle", False))
        return timed(fns, **kw)
    monkeypatch.setattr(common, "time_interleaved", spy)
    kernels.main(["--rows", "1000", "--repeats", "1", "--results-dir", str(tmp_path)])
    assert seen and all(seen)
