"""benchmarks/per_table.py (ibp against FBGEMM table by table) on a tiny configuration."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import per_table  # noqa: E402


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_each_table_is_timed_and_checked(tmp_path, dtype):
    got = per_table.main(["--dtype", dtype, "--dim", "16", "--rows", "50,300", "--batch", "64", "--pooling", "3",
                          "--repeats", "1", "--results-dir", str(tmp_path)])
    assert [(r["dist"], r["rows"]) for r in got["runs"]] == [("zipf", 50), ("zipf", 300), ("uniform", 50),
                                                              ("uniform", 300)]
    for r in got["runs"]:
        assert r["fbgemm_ms"] > 0 and r["ibp_ms"] > 0 and r["speed"] == r["fbgemm_ms"] / r["ibp_ms"]
        assert 0 < r["distinct"] <= 1
    saved = json.loads(next(tmp_path.glob("per_table-*.json")).read_text())
    assert saved["runs"] == json.loads(json.dumps(got["runs"]))


def test_a_wrong_sum_stops_it(tmp_path, monkeypatch):
    real = per_table.ibp_embed.lookup_many
    monkeypatch.setattr(per_table.ibp_embed, "lookup_many", lambda *a: real(*a) + 1.0)
    with pytest.raises(SystemExit, match="differ from FBGEMM"):
        per_table.main(["--dim", "8", "--rows", "40", "--batch", "16", "--pooling", "2", "--dist", "zipf",
                        "--repeats", "1", "--results-dir", str(tmp_path)])


def test_bad_arguments():
    for bad in (["--dist", "normal"], ["--dim", "0"], ["--rows", "0"], ["--rows", "1k"], ["--repeats", "0"],
                ["--scale", "0"], ["--scale", "2"], ["--scale", "0.03", "--rows", "50"], ["--min-rows", "10", "--rows", "50"],
                ["--min-rows", "100000000"]):
        with pytest.raises(SystemExit):
            per_table.parse(bad)
    assert per_table.parse([]).sizes[0] == 105 and torch.float16 in per_table.DTYPES.values()


def test_a_scale_picks_that_sets_tables():
    """--scale / --min-rows pick the sizes benchmarks.lookup's set of that scale has."""
    from benchmarks.lookup.tables import criteo_rows
    got = per_table.parse(["--scale", "0.03", "--min-rows", "10000"]).sizes
    assert got == sorted(n for n in set(criteo_rows(0.03)) if n >= 10000)
    assert got[-1] == 303937 and len(got) == 5 and got[0] >= 10000


def test_trained_rows_follow_the_ids_popularity(tmp_path, monkeypatch):
    """--init trained: benchmarks.lookup's trained-like rows, the most moved ones those the Zipf ids name most."""
    from ibp_embed import datasets
    made, real = [], datasets.make_trained_like_table

    def trained(*a, **k):
        made.append((a, k))
        return real(*a, **k)

    real_ids, drawn = datasets.zipf_ids, []

    def ids(*a, **k):
        drawn.append(k["perm_seed"])
        return real_ids(*a, **k)

    monkeypatch.setattr(per_table.datasets, "make_trained_like_table", trained)
    monkeypatch.setattr(per_table.datasets, "zipf_ids", ids)
    got = per_table.main(["--init", "trained", "--dim", "8", "--rows", "300", "--batch", "64", "--pooling", "3",
                          "--dist", "zipf", "--repeats", "1", "--results-dir", str(tmp_path)])
    assert made == [((300, 8, torch.float32), {"alpha": per_table.ALPHA, "seed": 300, "perm_seed": per_table.PERM_SEED})]
    assert drawn == [per_table.PERM_SEED] and got["config"]["init"] == "trained"
    named = real_ids(100_000, 300, per_table.ALPHA, seed=5, perm_seed=per_table.PERM_SEED).bincount(minlength=300)
    order = named.argsort(descending=True)
    init = datasets.make_table(300, 8, torch.float32, init="torchrec", seed=300)
    moved = (real(300, 8, alpha=per_table.ALPHA, seed=300, perm_seed=per_table.PERM_SEED)
             - init).abs().sum(1)
    assert moved[order[:30]].mean() > 2 * moved[order[150:]].mean()  # the rows named most moved most
