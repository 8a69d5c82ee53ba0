"""benchmarks/serving.py (the IBP collection against TorchRec's fused EBC, lookup_many against
FBGEMM's TBE, at small batches) on a tiny configuration."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import serving  # noqa: E402

TINY = ["--dim", "8", "--scale", "0.0002", "--batches", "1,5", "--pooling", "3", "--calls", "2", "--repeats", "1"]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_each_batch_is_timed_and_checked(tmp_path, dtype):
    got = serving.main(TINY + ["--dtype", dtype, "--results-dir", str(tmp_path)])
    assert [r["batch"] for r in got["runs"]] == [1, 5]
    for r in got["runs"]:
        assert r["fused_us"] > 0 and r["ibp_us"] > 0 and r["speed"] == r["fused_us"] / r["ibp_us"]
        assert r["tbe_us"] > 0 and r["many_speed"] == r["tbe_us"] / r["many_us"]
        assert r["many_lists_speed"] == r["tbe_lists_us"] / r["many_lists_us"]
        assert r["captured_speed"] == r["quant_captured_us"] / r["ibp_captured_us"]
        assert r["quant_speed"] == r["quant_us"] / r["ibp_with_quant_us"]
    saved = json.loads(next(tmp_path.glob("serving-*.json")).read_text())
    assert saved["runs"] == json.loads(json.dumps(got["runs"]))


def test_a_stream_of_batches_is_checked_batch_by_batch(tmp_path, monkeypatch):
    real, seen = serving.check, []
    monkeypatch.setattr(serving, "check", lambda calls, x, *a: seen.append(x) or real(calls, x, *a))
    got = serving.main(TINY + ["--batches", "3", "--stream", "3", "--results-dir", str(tmp_path)])
    assert len(seen) == 3 and len({tuple(x.ids.tolist()) for x in seen}) == 3  # three distinct batches
    assert got["config"]["stream"] == 3


def test_a_wrong_output_stops_it(tmp_path, monkeypatch):
    real = serving.ibp_ebc

    def wrong(*a):
        ebc = real(*a)
        forward = ebc.forward
        ebc.forward = lambda kjt: type(forward(kjt))(keys=forward(kjt).keys(), values=forward(kjt).values() + 1,
                                                     length_per_key=forward(kjt).length_per_key())
        return ebc

    monkeypatch.setattr(serving, "ibp_ebc", wrong)
    with pytest.raises(SystemExit, match="differs from the fused EBC"):
        serving.main(TINY + ["--results-dir", str(tmp_path)])


@pytest.mark.parametrize("layout", ["TBE layout", "lists"])
def test_a_wrong_lookup_many_stops_it(tmp_path, monkeypatch, layout):
    real = serving.ibp_embed.lookup_many

    def wrong(tables, ids, offsets):
        out = real(tables, ids, offsets)
        return out + 1 if isinstance(ids, list) == (layout == "lists") else out

    monkeypatch.setattr(serving.ibp_embed, "lookup_many", wrong)
    with pytest.raises(SystemExit, match=rf"lookup_many \({layout}\)'s output differs from the TBE's"):
        serving.main(TINY + ["--results-dir", str(tmp_path)])


def test_a_wrong_captured_collection_stops_it(tmp_path, monkeypatch):
    real = serving.captured

    def wrong(module):
        graph = real(module)
        if type(module).__name__ != "IBPEmbeddingBagCollection":
            return graph
        return lambda kjt: type(graph(kjt))(keys=graph(kjt).keys(), values=graph(kjt).values() + 1,
                                            length_per_key=graph(kjt).length_per_key())

    monkeypatch.setattr(serving, "captured", wrong)
    with pytest.raises(SystemExit, match="the captured IBP collection's output differs from the captured quant EBC's"):
        serving.main(TINY + ["--results-dir", str(tmp_path)])


def test_bad_arguments():
    for bad in (["--batches", "0"], ["--batches", "1k"], ["--dim", "0"], ["--calls", "0"], ["--scale", "2"],
                ["--threads", "0"], ["--stream", "0"]):
        with pytest.raises(SystemExit):
            serving.parse(bad)
    assert serving.parse([]).sizes == [1, 16, 128, 1024]
