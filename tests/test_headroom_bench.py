"""benchmarks/headroom.py: compressed against uncompressed and raw tables and FBGEMM, on a tiny table set."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import headroom  # noqa: E402
from ibp_embed import CompressedTable  # noqa: E402
from ibp_embed.dtypes import as_rows  # noqa: E402

TINY = ["--scale", "1e-6", "--min-rows", "1000", "--dim", "8", "--batch", "32", "--pooling", "3", "--rounds", "3"]


def test_times_the_four_systems_and_saves_them(tmp_path):
    got = headroom.main([*TINY, "--dist", "uniform", "--results-dir", str(tmp_path)])
    (run,) = got["runs"]
    assert set(run) == set(headroom.SYSTEMS)
    assert all(r["median_ms"] > 0 and r["speed_vs_fbgemm_median"] > 0 for r in run.values())
    tiny_lookups = 15 * 32 * 3  # fifteen 1000-row tables, B32 x P3
    assert all(r["ns_per_lookup_median"] == pytest.approx(r["median_ms"] * 1e6 / tiny_lookups) for r in run.values())
    # 32-byte rows (in the model: the tiny tables are pooled from decoded copies): a raw or
    # uncompressed one, or FBGEMM's, lies in one line; packed ones cross lines and read the index
    assert (run["fbgemm"]["lines_per_row"] == run["ibp raw"]["lines_per_row"] ==
            run["ibp uncompressed"]["lines_per_row"] == 1.0 < run["ibp"]["lines_per_row"])
    saved = json.loads(next(tmp_path.glob("headroom-*.json")).read_text())
    assert "1000-1000 rows" in saved["config"]["label"] and saved["config"]["rounds"] == 3


def spoiled(rows: np.ndarray) -> np.ndarray:
    rows = rows.copy()
    rows[:, 2] ^= 0x40  # the top mantissa bit of each row's first float
    return rows


def test_refuses_uncompressed_tables_whose_sums_differ(tmp_path, monkeypatch):
    build = headroom.uncompressed_table

    def other_rows(weights, word_bits):
        return build(torch.from_numpy(spoiled(weights.numpy().view(np.uint8)).view(np.float32)), word_bits)

    monkeypatch.setattr(headroom, "uncompressed_table", other_rows)
    with pytest.raises(SystemExit, match="uncompressed tables' sums differ"):
        headroom.main([*TINY, "--results-dir", str(tmp_path)])


def test_refuses_raw_tables_whose_sums_differ(tmp_path, monkeypatch):
    class SpoiledRaw(CompressedTable):  # headroom's raw copies only (compress stores tiny tables raw too)
        @classmethod
        def raw(cls, rows, dtype, dim, word_bits=64):
            return CompressedTable.raw(spoiled(rows), dtype, dim, word_bits)

    monkeypatch.setattr(headroom, "CompressedTable", SpoiledRaw)
    with pytest.raises(SystemExit, match="raw tables' sums differ"):
        headroom.main([*TINY, "--results-dir", str(tmp_path)])


@pytest.mark.parametrize("word_bits", [16, 32, 64])
@pytest.mark.parametrize("n_rows,dim", [(1, 3), (64, 8), (200, 40), (100, 300)])  # 1200-byte rows: 4-byte rel
def test_uncompressed_table_stores_every_row_whole(n_rows, dim, word_bits):
    g = torch.Generator().manual_seed(n_rows)
    weights = torch.randn(n_rows, dim, generator=g)
    bits = weights.view(torch.int32)
    bits[0, 0] = 0x7FC00123  # a NaN with a payload
    bits[-1, -1] = -0x80000000  # -0.0
    table = headroom.uncompressed_table(weights, word_bits)
    assert table.clusters == 1 and table.word_bits == word_bits and not table.is_raw
    assert (table.row_lengths() == dim * 4).all()  # every row stored whole
    assert table._c.fixed_len == dim * 4  # found without the index
    assert table._payload.ctypes.data % 64 == 0
    assert torch.equal(table.decompress().view(torch.int32), bits)
    ids = torch.tensor([n_rows - 1, 0, n_rows // 2])
    assert torch.equal(table.gather(ids).view(torch.int32), bits[ids])


def test_lines_count_where_rows_lie():
    # 48-byte rows from a line's start: one, two, two and one line
    starts = np.arange(4) * 48
    assert headroom.lines_spanned(0, starts, 48) == 1.5
    assert headroom.lines_spanned(64 * 7, starts[[0, 3, 3]], 48) == 1.0
    # the first row from 16 bytes into a line lies in it, from 32 it crosses into the next
    assert headroom.lines_spanned(16, starts[:1], 48) == 1.0
    assert headroom.lines_spanned(32, starts[:1], 48) == 2.0
    rows, dtype, dim = as_rows(torch.zeros(4, 12))
    raw = CompressedTable.raw(rows, dtype, dim)  # its payload starts on a line: no index read
    assert headroom.table_lines(raw, np.arange(4)) == 1.5
    assert headroom.tbe_lines(torch.zeros(4, 16), np.arange(4)) == 1.0  # torch's 64-byte aligned storage



@pytest.mark.parametrize("dist", ["zipf", "uniform"])
def test_uncompressed_table_takes_the_packed_tables_path(dist):
    """Pooled lookups over an uncompressed table of more rows than a call's row cache has
    slots (1.5 MB of them) take the packed tables' path (Zipf ids: the deduplication's
    scratch; uniform ids, 88% distinct: decode windows) and pool its rows bit for bit as
    the raw table pools them straight."""
    from ibp_embed.datasets import uniform_ids, zipf_ids

    n_rows, dim, bags, pooling = 8000, 40, 256, 8
    weights = torch.randn(n_rows, dim, generator=torch.Generator().manual_seed(5))
    n = bags * pooling
    ids = zipf_ids(n, n_rows, 1.05, seed=3) if dist == "zipf" else uniform_ids(n, n_rows, seed=3)
    offsets = torch.arange(0, n + 1, pooling)
    table = headroom.uncompressed_table(weights, 64)
    raw = CompressedTable.raw(*as_rows(weights))
    got, want = table.lookup(ids, offsets), raw.lookup(ids, offsets)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    pooled = torch.nn.functional.embedding_bag(ids, weights, offsets, mode="sum", include_last_offset=True)
    assert torch.allclose(want, pooled, atol=1e-5)


@pytest.mark.parametrize("bad", [["--rounds", "0"], ["--scale", "0"], ["--alpha", "-1"]])
def test_refuses_bad_options(bad):
    with pytest.raises(SystemExit):
        headroom.parse(bad)


def test_says_when_no_table_is_large_enough(tmp_path):
    with pytest.raises(SystemExit, match=r"no table of the set has 2000 rows or more \(--min-rows\)"):
        headroom.main([*TINY, "--min-rows", "2000", "--results-dir", str(tmp_path)])
