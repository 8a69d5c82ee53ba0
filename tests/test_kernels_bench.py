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
    picked = next(name for name, isa in got["config"]["sets"].items() if isa == before)
    assert saved["issue11_decode"] == json.loads(json.dumps(kernels.decode_targets(got["runs"], picked)))


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


def _case(init, w, ns, row_bytes=512):
    return {"init": init, "dtype": "torch.float32", "dim": 128, "word_bits": w, "row_bytes": row_bytes,
            "ns_per_row_fresh": {"avx512": ns, "generic": 10 * ns}, "ns_per_row_repeated": {}}


def test_decode_targets_at_their_lines():
    # 512-byte rows: 51.2 ns a row is exactly 10 GB/s; W = 16 and 32 as fast as W = 64 at ratio 1
    runs = [_case("torchrec", 16, 40.0), _case("torchrec", 32, 40.0), _case("torchrec", 64, 40.0)]
    t = kernels.decode_targets(runs, "avx512")
    assert t["gbps_met"] and t["w16_w32_as_fast_met"] and [x["gbps"] for x in t["gbps"]] == [12.8] * 3
    assert "10 GB/s for every word size: met; W = 16 and 32 as fast as W = 64: met (1.00-1.00x" in \
        kernels.format_decode_targets(t)
    runs[0] = _case("torchrec", 16, 51.2)  # at the speed line, 1.28x W = 64's time
    t = kernels.decode_targets(runs, "avx512")
    assert t["gbps_met"] and not t["w16_w32_as_fast_met"]
    assert [x["time_vs_w64"] for x in t["time_vs_w64"]] == [1.28, 1.0]
    runs += [_case("trained", 16, 52.0), _case("trained", 32, 30.0), _case("trained", 64, 31.0)]
    t = kernels.decode_targets(runs, "avx512")
    assert not t["gbps_met"] and [(x["init"], x["word_bits"]) for x in t["below_line"]] == [("trained", 16)]
    text = kernels.format_decode_targets(t)
    assert "MISSED (1 of 6 below: trained float32 d128 W = 16 9.8)" in text and "(0.97-1.68x its time)" in text
    assert not kernels.decode_targets(runs, "generic")["gbps_met"]  # the set asked for, not another
    short = kernels.decode_targets([_case("torchrec", 64, 12.8, row_bytes=128)], "avx512")  # fp16 d64 rows
    assert short["gbps"][0]["gbps"] == 10.0 and short["gbps_met"]


def test_step_mix_counts_the_steps_whose_words_all_participate():
    """step_mix against a word-by-word count through the reference's words."""
    import torch
    from ibp_embed import compress, datasets, reference
    for dtype, dim, w in ((torch.float16, 64, 16), (torch.float32, 32, 32), (torch.float16, 64, 64)):
        weights = datasets.make_trained_like_table(300, dim, dtype)
        bits = weights.view(torch.uint8)
        bits[:5] = torch.randint(0, 256, bits[:5].shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(w))
        table = compress(weights, word_bits=w, progress=False)
        raw, cid, lanes = weights.contiguous().view(torch.uint8).numpy(), table.cluster_ids(), 512 // w
        assert (cid < 0).any()  # random bits: rows stored raw, which have no steps
        full = total = 0
        for r in range(300):
            if cid[r] < 0:  # stored raw: no steps
                continue
            words = reference.row_words(raw[r].tobytes(), w)
            m, v = table.masks[cid[r]], table.bitvals[cid[r]]
            for s in range(len(words) // lanes):
                total += 1
                full += all(int(words[j]) & int(m[j]) == int(v[j]) for j in range(s * lanes, (s + 1) * lanes))
        got = kernels.step_mix(weights, table)
        assert got["direct_steps"] == full / total and 0 < full < total  # some of each
        assert got["bytes_per_row"] == table.nbytes / 300
