"""File handling under hostile or unlucky conditions: modes, failed saves, foreign
manifests, non-regular files and symlinks (each reproduced before the fix)."""
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ibp_embed
from ibp_embed.errors import FormatError

pytest.importorskip("torchrec")

from torchrec import EmbeddingBagConfig  # noqa: E402

from ibp_embed.optim import RowWiseAdagrad  # noqa: E402
from ibp_embed.torchrec import IBPEmbeddingBagCollection  # noqa: E402
from ibp_embed.torchrec import checkpoint as ck  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def module(optimizer=None):
    torch.manual_seed(0)
    configs = [EmbeddingBagConfig(name=n, num_embeddings=50, embedding_dim=8, feature_names=[f"f{n}"])
               for n in ("a", "b", "c")]
    return IBPEmbeddingBagCollection(configs, optimizer=optimizer)


def mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(old)


def test_files_take_the_umask_and_keep_the_mode_they_replace(tmp_path, umask):
    t = ibp_embed.compress(torch.randn(100, 8))
    umask(0o077)
    t.save(tmp_path / "t.ibp")
    assert mode(tmp_path / "t.ibp") == 0o600
    m = module(RowWiseAdagrad(0.1))
    m.save_compressed(tmp_path / "ck")
    assert {mode(p) for p in (tmp_path / "ck").iterdir()} == {0o600}
    umask(0o022)
    t.save(tmp_path / "new.ibp")
    assert mode(tmp_path / "new.ibp") == 0o644
    os.chmod(tmp_path / "t.ibp", 0o640)
    t.save(tmp_path / "t.ibp")  # a re-save keeps the file's mode
    assert mode(tmp_path / "t.ibp") == 0o640
    os.chmod(tmp_path / "ck" / "manifest.json", 0o640)
    m.save_compressed(tmp_path / "ck")  # a re-saved checkpoint keeps its manifest's mode
    assert {mode(p) for p in (tmp_path / "ck").iterdir()} == {0o640}


def test_a_failed_save_removes_what_it_wrote(tmp_path, monkeypatch):
    m = module(RowWiseAdagrad(0.1))
    m.save_compressed(tmp_path)
    before = sorted(os.listdir(tmp_path))
    calls = {"n": 0}
    real = ibp_embed.CompressedTable.save

    def failing(self, path):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        real(self, path)

    monkeypatch.setattr(ibp_embed.CompressedTable, "save", failing)
    for _ in range(3):  # retries on a full disk do not pile files up
        calls["n"] = 0
        with pytest.raises(OSError, match="No space"):
            m.save_compressed(tmp_path)
        assert sorted(os.listdir(tmp_path)) == before
    monkeypatch.undo()

    def partial_npy(target, array):
        Path(target).write_bytes(b"\x93NUMPY partial")
        raise OSError(27, "File too large")

    monkeypatch.setattr(ck, "_write_npy", partial_npy)
    with pytest.raises(OSError, match="too large"):
        m.save_compressed(tmp_path)
    assert sorted(os.listdir(tmp_path)) == before
    again = IBPEmbeddingBagCollection.load_compressed(tmp_path, optimizer="saved")
    assert torch.equal(again.embedding_bags["b"].weight, m.embedding_bags["b"].weight)


def test_a_real_file_size_limit(tmp_path):
    """The same under RLIMIT_FSIZE: the kernel refuses the write part-way."""
    script = f"""
import os, resource, signal, sys, torch
sys.path.insert(0, {str(ROOT)!r})
from torchrec import EmbeddingBagConfig
from ibp_embed.torchrec import IBPEmbeddingBagCollection
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
torch.manual_seed(0)
m = IBPEmbeddingBagCollection([EmbeddingBagConfig(name="big", num_embeddings=20000, embedding_dim=32,
                                                  feature_names=["f"])])
d = {str(tmp_path)!r}
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
try:
    m.save_compressed(d)
except OSError as e:
    print("refused", e.errno, sorted(os.listdir(d)))
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("refused") and p.stdout.strip().endswith("[]"), p.stdout


def test_saves_delete_only_the_files_they_generate(tmp_path):
    m = module()
    m.save_compressed(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    old_c = manifest["tables"][2]["file"]
    manifest["tables"][0]["file"] = "manifest.json"  # a tampered manifest
    manifest["tables"][1]["file"] = "notes.txt"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    m.save_compressed(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    again = IBPEmbeddingBagCollection.load_compressed(tmp_path)  # its fresh manifest survived
    assert torch.equal(again.embedding_bags["a"].weight, m.embedding_bags["a"].weight)
    new = [e["file"] for e in json.loads((tmp_path / "manifest.json").read_text())["tables"]]
    assert all((tmp_path / f).is_file() for f in new)
    assert not (tmp_path / old_c).exists()  # the old manifest named it and the save made it: removed
    assert ck.GENERATED.fullmatch("0001-t_a.0123abcd.ibp") and ck.GENERATED.fullmatch("0001-t.0123abcd.momentum1.npy")
    assert not ck.GENERATED.fullmatch("manifest.json") and not ck.GENERATED.fullmatch("0001-t.0123abcd.ibp.bak")


def test_non_regular_files_are_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "pipe.ibp"
    os.mkfifo(fifo)
    ckpt = tmp_path / "ck"
    module().save_compressed(ckpt)
    (ckpt / "manifest.json").unlink()
    os.mkfifo(ckpt / "manifest.json")
    script = f"""
import ibp_embed
from ibp_embed.torchrec import IBPEmbeddingBagCollection
for call in (lambda: ibp_embed.load({str(fifo)!r}), lambda: ibp_embed.io.read_header({str(fifo)!r}),
             lambda: IBPEmbeddingBagCollection.load_compressed({str(ckpt)!r})):
    try:
        call()
    except Exception as e:
        print(type(e).__name__, e)
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 3, (p.stdout, p.stderr[-2000:])
    assert lines[0].startswith("FormatError") and "a FIFO, not a regular file" in lines[0]
    assert lines[1].startswith("FormatError") and "a FIFO" in lines[1]
    assert lines[2].startswith("ValueError") and "a FIFO" in lines[2]
    for cmd in (["inspect", str(fifo)], ["verify", str(fifo)]):
        p = subprocess.run([sys.executable, "-m", "ibp_embed.cli", *cmd], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
        assert p.returncode == 1 and "a FIFO, not a regular file" in p.stderr, (cmd, p.stderr)
    with pytest.raises(FormatError, match="a directory"):
        ibp_embed.load(tmp_path)


def test_symlinks_leading_out_of_a_checkpoint_are_refused(tmp_path):
    m = module()
    ckpt = tmp_path / "ck"
    m.save_compressed(ckpt)
    name = json.loads((ckpt / "manifest.json").read_text())["tables"][0]["file"]
    outside = tmp_path / "elsewhere.ibp"
    os.replace(ckpt / name, outside)
    os.symlink(outside, ckpt / name)
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        IBPEmbeddingBagCollection.load_compressed(ckpt)
    # a link to a file inside the directory is fine
    (ckpt / name).unlink()
    os.replace(outside, ckpt / "real.ibp")
    os.symlink("real.ibp", ckpt / name)
    again = IBPEmbeddingBagCollection.load_compressed(ckpt)
    assert torch.equal(again.embedding_bags["a"].weight, m.embedding_bags["a"].weight)
