"""dlrm_example: data sources, the trainer on both backends, checkpoints, bad input."""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dlrm_example import checkpoint as ckpt  # noqa: E402
from dlrm_example import train  # noqa: E402
from dlrm_example.data import (  # noqa: E402
    NUM_SPARSE, CriteoNpy, CriteoTSV, DataError, GeneratedData, scaled_cardinalities, write_tsv,
)
from ibp_embed.datasets import DLRMV2_MULTI_HOT  # noqa: E402

SMALL = ["--scale", "0.0005", "--batch-size", "64", "--eval-batches", "2", "--threads", "1", "--no-progress",
         "--dense-arch", "16,8", "--embedding-dim", "8", "--over-arch", "16,1"]


def run_main(args, capsys):
    rc = train.main(list(args) + SMALL)
    out, err = capsys.readouterr()
    return rc, out, err


def final_line(out):
    lines = [x for x in out.strip().splitlines() if x.startswith("final:")]
    assert lines, out
    return lines[-1]


def cards():
    return scaled_cardinalities(0.0005)


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------

def test_generator_is_deterministic_and_learnable():
    g1 = GeneratedData(cards(), seed=5, alpha=1.1)
    g2 = GeneratedData(cards(), seed=5, alpha=1.1)
    a, b = g1.train_batch(3, 256), g2.train_batch(3, 256)
    for x, y in zip((a.dense, a.values, a.lengths, a.labels), (b.dense, b.values, b.lengths, b.labels)):
        assert torch.equal(x, y)
    assert not torch.equal(g1.train_batch(4, 256).values, a.values)
    assert not torch.equal(GeneratedData(cards(), seed=6).train_batch(3, 256).values, a.values)
    assert not torch.equal(g1.eval_batch(3, 256).values, a.values)  # eval is another split
    assert a.dense.shape == (256, 13) and a.values.numel() == NUM_SPARSE * 256
    for f, n in enumerate(cards()):
        ids = a.values[f * 256:(f + 1) * 256]
        assert ids.min() >= 0 and ids.max() < n
    rate = float(torch.cat([g1.train_batch(i, 512).labels for i in range(4)]).mean())
    assert 0.1 < rate < 0.4  # Criteo-like click rate
    mh = GeneratedData(cards(), seed=5, multi_hot=DLRMV2_MULTI_HOT).train_batch(0, 8)
    assert mh.lengths.view(NUM_SPARSE, 8).tolist() == [[m] * 8 for m in DLRMV2_MULTI_HOT]
    # a rank's slice of a global batch
    part = mh.rows(2, 5)
    assert part.size == 3 and torch.equal(part.dense, mh.dense[2:5])
    off = torch.cat([torch.zeros(1, dtype=torch.int64), mh.lengths.cumsum(0)])
    expect = torch.cat([mh.values[off[f * 8 + 2]:off[f * 8 + 5]] for f in range(NUM_SPARSE)])
    assert torch.equal(part.values, expect)


def test_tsv_reader_counts_malformed_lines(tmp_path):
    src = GeneratedData(cards(), seed=1).train_batch(0, 40)
    good = tmp_path / "good.tsv"
    write_tsv(good, src)
    lines = good.read_text().splitlines()
    fields = lines[0].split("\t")
    empty = fields[:]
    empty[2], empty[20] = "", ""  # empty integer and empty categorical: allowed
    bad = [
        "\t".join(fields[:-1]),                  # 39 fields
        "\t".join(["2"] + fields[1:]),           # label not 0/1
        "\t".join(fields[:3] + ["x1"] + fields[4:]),  # non-integer dense
        "\t".join(fields[:30] + ["zz!"] + fields[31:]),  # non-hex id
    ]
    path = tmp_path / "mixed.tsv"
    path.write_text("\n".join(lines[:10] + bad[:2] + ["\t".join(empty)] + lines[10:] + bad[2:]) + "\n")
    r = CriteoTSV(path, cards(), eval_samples=8)
    assert r.bad_lines == 4 and r.lines_read == 45
    assert "mixed.tsv:11" in r.report() and "39 fields" in r.report()
    assert r._n_samples() == 41
    # values round-trip: labels, ids hashed into the tables, dense log1p(max(x, 0))
    ref = CriteoTSV(good, cards(), eval_samples=8)
    assert torch.equal(ref.train_batch(0, 4).labels, src.labels[8:12])
    ids = src.values.view(NUM_SPARSE, 40)[:, 8:12]
    assert torch.equal(ref.train_batch(0, 4).values.view(NUM_SPARSE, 4), ids % torch.tensor(cards())[:, None])
    torch.testing.assert_close(ref.eval_batch(0, 8).dense, src.dense[:8], rtol=0, atol=1e-6)
    e = r._take(np.array([10]))  # the line with empty fields
    assert e[0][0, 1] == 0 and e[1][0, 6] == 0  # fields 2 (dense 2) and 20 (categorical 7)
    # over the limit: fatal, with a clear message
    with pytest.raises(DataError, match="malformed lines"):
        CriteoTSV(path, cards(), max_bad_lines=2, max_bad_fraction=0.01)
    with pytest.raises(DataError, match="no such file"):
        CriteoTSV(tmp_path / "missing.tsv", cards())


def test_npy_reader(tmp_path):
    n = 50
    rng = np.random.default_rng(0)
    dense = rng.random((n, 13), dtype=np.float32)
    sparse = rng.integers(0, 2**40, (n, 26), dtype=np.int64)
    labels = rng.integers(0, 2, (n, 1)).astype(np.int32)
    for k, sl in ((0, slice(0, 30)), (1, slice(30, n))):
        np.save(tmp_path / f"day_{k}_dense.npy", dense[sl])
        np.save(tmp_path / f"day_{k}_sparse.npy", sparse[sl])
        np.save(tmp_path / f"day_{k}_labels.npy", labels[sl])
    r = CriteoNpy(tmp_path, cards(), eval_samples=10)
    b = r.train_batch(1, 16)  # samples 10 + 16 .. 10 + 31: crosses the day boundary
    idx = np.arange(26, 42)
    assert np.array_equal(b.dense.numpy(), dense[idx])
    assert np.array_equal(b.labels.numpy(), labels[idx, 0].astype(np.float32))
    assert np.array_equal(b.values.view(26, 16).numpy(), (sparse[idx] % np.array(cards())).T)
    assert torch.equal(r.eval_batch(0, 10).dense, torch.from_numpy(dense[:10]))
    np.save(tmp_path / "day_1_sparse.npy", sparse[:5])
    with pytest.raises(DataError, match="day_1_sparse.npy"):
        CriteoNpy(tmp_path, cards())
    os.remove(tmp_path / "day_1_labels.npy")
    with pytest.raises(DataError, match="missing"):
        CriteoNpy(tmp_path, cards())
    with pytest.raises(DataError, match="no such directory"):
        CriteoNpy(tmp_path / "nope", cards())


# ---------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("model,optimizer", [("dlrm", "adagrad"), ("dcn", "sgd")])
def test_backends_give_equal_losses(capsys, model, optimizer):
    lines = {}
    for backend in ("ibp", "torchrec"):
        rc, out, err = run_main(["--backend", backend, "--steps", "8", "--model", model,
                                 "--optimizer", optimizer], capsys)
        assert rc == 0, err
        lines[backend] = final_line(out)
    assert lines["ibp"].replace("backend=ibp", "") == lines["torchrec"].replace("backend=torchrec", "")
    assert "steps=8" in lines["ibp"] and "train_loss=0." in lines["ibp"]


def _flatten(v, prefix=""):
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _flatten(x, f"{prefix}{k}/")
    else:
        yield prefix, v


def test_learns_above_chance(capsys):
    rc = train.main(["--backend", "ibp", "--steps", "60", "--scale", "0.001", "--batch-size", "512",
                               "--threads", "1", "--no-progress", "--eval-batches", "4"])
    out = capsys.readouterr().out
    assert rc == 0
    auc = float(final_line(out).split("eval_auc=")[1].split()[0])
    assert auc > 0.7


@pytest.mark.parametrize("backend", ["ibp", "torchrec"])
def test_checkpoint_resume_is_exact(tmp_path, capsys, backend):
    base = ["--backend", backend, "--optimizer", "adagrad"]
    rc, straight, _ = run_main(base + ["--steps", "6", "--checkpoint", str(tmp_path / "a")], capsys)
    assert rc == 0
    rc, _, _ = run_main(base + ["--steps", "3", "--checkpoint", str(tmp_path / "b")], capsys)
    assert rc == 0
    rc, resumed, _ = run_main(base + ["--steps", "6", "--checkpoint", str(tmp_path / "b"), "--resume"], capsys)
    assert rc == 0
    assert "resumed from" in resumed
    assert final_line(resumed) == final_line(straight)
    # both checkpoints hold the same tables and optimizer state (torch.distributed.checkpoint)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    a, b = ckpt.latest(tmp_path / "a"), ckpt.latest(tmp_path / "b")
    assert a.name.split(".")[0] == b.name.split(".")[0] == "step-00000006"
    loaded = []
    for c in (a, b):
        dcp_to_torch_save(c / "model", tmp_path / f"{c.parent.name}.pt")
        loaded.append(torch.load(tmp_path / f"{c.parent.name}.pt"))
    flat = [{f"{k}/{kk}": vv for k, v in d.items() for kk, vv in _flatten(v)} for d in loaded]
    assert sorted(flat[0]) == sorted(flat[1])
    assert any("momentum1" in k for k in flat[0]) and any("t_cat_0.weight" in k for k in flat[0])
    for k in flat[0]:
        if isinstance(flat[0][k], torch.Tensor):
            assert torch.equal(flat[0][k], flat[1][k]), k
    # eval-only reproduces the trained model's evaluation (inference path)
    rc, ev, _ = run_main(["--backend", backend, "--steps", "6", "--checkpoint", str(tmp_path / "a"),
                          "--eval-only"], capsys)
    assert rc == 0
    assert final_line(ev).split("eval_auc=")[1] == final_line(straight).split("eval_auc=")[1]
    assert "train_loss=n/a" in final_line(ev)


def test_interrupted_run_resumes_from_its_checkpoint(tmp_path, capsys, monkeypatch):
    base = ["--backend", "ibp", "--steps", "7", "--checkpoint", str(tmp_path / "c")]
    rc, straight, _ = run_main(["--backend", "ibp", "--steps", "7"], capsys)
    orig = GeneratedData.train_batch

    def killing(self, index, batch_size):
        if index == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # handled: the step finishes, then a checkpoint
        return orig(self, index, batch_size)

    monkeypatch.setattr(GeneratedData, "train_batch", killing)
    rc, out, err = run_main(base, capsys)
    assert rc == train.EXIT_INTERRUPTED
    assert "interrupted after step 4" in err and "--resume" in err
    assert ckpt.latest(tmp_path / "c").name.startswith("step-00000004.")
    monkeypatch.setattr(GeneratedData, "train_batch", orig)
    rc, resumed, _ = run_main(base + ["--resume"], capsys)
    assert rc == 0
    assert final_line(resumed) == final_line(straight)


def test_nan_loss_exits_nonzero(tmp_path, capsys):
    rc, out, err = run_main(["--backend", "ibp", "--optimizer", "sgd", "--lr", "1e30", "--steps", "20"], capsys)
    assert rc == train.EXIT_NAN
    assert "loss is nan" in err or "loss is inf" in err
    assert "final:" not in out


def test_bad_input_exits_with_clear_messages(tmp_path, capsys):
    rc, _, err = run_main(["--data", "criteo-tsv", str(tmp_path / "none.tsv"), "--steps", "1"], capsys)
    assert rc == 2 and "none.tsv: no such file" in err
    rc, _, err = run_main(["--data", "criteo-npy", str(tmp_path / "none"), "--steps", "1"], capsys)
    assert rc == 2 and "no such directory" in err
    unreadable = tmp_path / "locked.tsv"
    unreadable.write_text("1\t" * 39 + "\n")
    unreadable.chmod(0)
    if not os.access(unreadable, os.R_OK):  # root can read anything
        rc, _, err = run_main(["--data", "criteo-tsv", str(unreadable), "--steps", "1"], capsys)
        assert rc == 2 and "permission denied" in err
    rc, _, err = run_main(["--resume", "--steps", "1"], capsys)
    assert rc == 2 and "--resume needs --checkpoint" in err
    # a checkpoint of another model, and one of another format version
    rc, _, _ = run_main(["--steps", "1", "--checkpoint", str(tmp_path / "k")], capsys)
    assert rc == 0
    rc, _, err = run_main(["--steps", "2", "--checkpoint", str(tmp_path / "k"), "--resume", "--model", "dcn"],
                          capsys)
    assert rc == 2 and "another model" in err and "model" in err
    rc, _, err = run_main(["--steps", "2", "--checkpoint", str(tmp_path / "k"), "--resume", "--backend",
                           "torchrec"], capsys)
    assert rc == 2 and "--backend ibp" in err
    meta = ckpt.latest(tmp_path / "k") / "meta.json"
    m = json.loads(meta.read_text())
    m["version"] = 99
    meta.write_text(json.dumps(m))
    rc, _, err = run_main(["--steps", "2", "--checkpoint", str(tmp_path / "k"), "--resume"], capsys)
    assert rc == 2 and "version 99" in err
    m["version"], m["format"] = ckpt.VERSION, "something else"
    meta.write_text(json.dumps(m))
    rc, _, err = run_main(["--steps", "2", "--checkpoint", str(tmp_path / "k"), "--resume"], capsys)
    assert rc == 2 and "not a dlrm_example.checkpoint" in err


def test_cli_runs_as_a_module(tmp_path):
    tsv = tmp_path / "day.tsv"
    write_tsv(tsv, GeneratedData(cards(), seed=2).train_batch(0, 300))
    with open(tsv, "a") as f:
        f.write("garbage line\n")
    p = subprocess.run([sys.executable, "-m", "dlrm_example.train", "--data", "criteo-tsv", str(tsv),
                        "--steps", "3"] + SMALL, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "skipped 1 malformed line(s) of 301" in p.stdout
    assert p.stdout.strip().splitlines()[-1].startswith("final: backend=ibp model=dlrm steps=3 train_loss=")


def test_two_ranks_with_torchrun_match_across_backends(tmp_path):
    """torchrun, 2 processes, gloo: both backends under DMP with the same plan (large
    tables row-wise, on the IBP kernel for ibp); same losses; each rank holds its shards."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to the interpreter")
    finals = {}
    for backend in ("ibp", "torchrec"):
        with socket.socket() as sock:  # a free port: a fixed one may still be held
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        p = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", str(port), "-m",
                            "dlrm_example.train", "--backend", backend, "--steps", "4"] + SMALL,
                           cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert p.returncode == 0, p.stderr[-3000:]
        assert "on 2 rank(s)" in p.stdout
        memory = [line for line in p.stdout.splitlines() if line.startswith("table memory, rank")]
        assert [line.split(":")[0] for line in memory] == ["table memory, rank 0", "table memory, rank 1"]
        if backend == "ibp":
            raw = [float(line.split(": ")[1].split(" MiB")[0]) for line in memory]
            total = sum(n * 8 * 4 for n in cards()) / 2 ** 20
            assert all(r < 0.75 * total for r in raw), (raw, total)  # shards, not replicas
        finals[backend] = final_line(p.stdout)
    assert finals["ibp"].replace("backend=ibp", "") == finals["torchrec"].replace("backend=torchrec", "")


def test_demo_lookup_throughput_is_the_fastest_pass(monkeypatch):
    """make demo's lookup line: the fastest of the timed passes (after a warm-up pass),
    not a median of a few, which swung from 0.55x to 1.56x between two runs."""
    from types import SimpleNamespace

    from dlrm_example import demo

    calls = []
    batches = [SimpleNamespace(values=torch.zeros(6), size=2, kjt=lambda k=k: k) for k in range(3)]
    ticks = iter([10.0, 13.0, 20.0, 21.0, 30.0, 32.0])  # passes of 3, 1 and 2 s
    monkeypatch.setattr(demo.time, "perf_counter", lambda: next(ticks))
    samples, ids = demo._throughput(lambda kjt: calls.append(kjt) or torch.zeros(1), batches, repeats=3)
    assert (samples, ids) == (6 / 1.0, 18 / 1.0)
    assert calls == [0, 1, 2] * 4  # one warm-up pass over every batch, then the three timed
