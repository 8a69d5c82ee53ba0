"""The ibp-embed command line: compress / inspect / verify, inputs, refusals, exit codes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ibp_embed
from ibp_embed import CompressedTable, cli

SCRIPT = Path(sys.executable).parent / "ibp-embed"


def data(n=300, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1e-3, 1.0, 1e3])[torch.randint(0, 3, (n,), generator=g)]
    return (torch.randn(n, d, generator=g) * 0.01 * scale[:, None]).to(dtype)


class _Evil:
    """Unpickling this runs a command that creates the file `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    x = data()
    y = data(120, 6, torch.bfloat16, seed=1)
    torch.save(x, d / "tensor.pt")
    torch.save({"emb.weight": x, "emb.bias": torch.zeros(16), "proj.weight": torch.randn(4, 3)},
               d / "state.pt")
    torch.save({"model": {"emb": {"weight": x}}, "step": 3}, d / "nested.pt")
    np.save(d / "table.npy", x.numpy())
    np.save(d / "bigendian.npy", x.numpy().astype(">f4"))
    from safetensors.torch import save_file

    save_file({"emb": y, "other": torch.zeros(3)}, d / "table.safetensors")
    save_file({"a": y, "b": y.clone()}, d / "two.safetensors")
    torch.save({"w": x, "evil": _Evil(d / "PWNED")}, d / "evil.pt")
    np.save(d / "object.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(d / "cube.npy", np.zeros((4, 4, 2), np.float32))
    np.save(d / "complex.npy", np.zeros((4, 4), np.complex64))
    torch.save(torch.zeros(10), d / "vector.pt")
    (d / "garbage.pt").write_bytes(b"not a pickle at all" * 10)
    (d / "table.csv").write_text("1,2\n3,4\n")
    return d, x, y


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_error(rc, err, code, *fragments):
    assert rc == code, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("ibp-embed: error: "), err
    for f in fragments:
        assert f in last, (f, last)


def loaded_equals(path, x):
    t = ibp_embed.load(path)
    y = t.decompress()
    assert y.dtype == x.dtype and tuple(y.shape) == tuple(x.shape)
    if x.numel():
        assert y.view(torch.uint8).numpy().tobytes() == x.contiguous().view(torch.uint8).numpy().tobytes()
    return t


# ---------------------------------------------------------------- compress

@pytest.mark.parametrize("src,key,which", [
    ("tensor.pt", None, "x"),
    ("state.pt", "emb.weight", "x"),
    ("nested.pt", None, "x"),  # exactly one 2-D tensor: no --key needed
    ("nested.pt", "model.emb.weight", "x"),
    ("table.npy", None, "x"),
    ("bigendian.npy", None, "x"),
    ("table.safetensors", None, "y"),
    ("table.safetensors", "emb", "y"),
])
def test_compress_inputs(files, tmp_path, capsys, src, key, which):
    d, x, y = files
    ref = x if which == "x" else y
    out = tmp_path / "out.ibp"
    rc, stdout, err = run(capsys, "compress", d / src, out, *(["--key", key] if key else []))
    assert rc == 0, err
    t = loaded_equals(out, ref)
    assert f"{ref.shape[0]} x {ref.shape[1]}" in stdout
    assert str(ref.dtype).removeprefix("torch.") in stdout
    assert f"{t.word_bits} bits" in stdout and f"{t.ratio:.4f}" in stdout
    assert str(t.raw_nbytes) in stdout and str(t.nbytes) in stdout
    assert "time" in stdout


def test_compress_options(files, tmp_path, capsys):
    d, x, _ = files
    for w in (16, 32, 64):
        rc, _, err = run(capsys, "compress", d / "tensor.pt", tmp_path / f"w{w}.ibp", "--word-bits", w)
        assert rc == 0, err
        assert loaded_equals(tmp_path / f"w{w}.ibp", x).word_bits == w
    rc, _, err = run(capsys, "compress", d / "tensor.pt", tmp_path / "k.ibp", "--clusters", 4,
                     "--threshold", "0.9", "--no-raw")
    assert rc == 0, err
    assert 1 <= loaded_equals(tmp_path / "k.ibp", x).clusters <= 4
    # without --no-raw, what these options give is larger than the rows: stored raw
    rc, out, err = run(capsys, "compress", d / "tensor.pt", tmp_path / "r.ibp", "--clusters", 4,
                       "--threshold", "0.9")
    assert rc == 0 and "stored raw" in out, err
    r = loaded_equals(tmp_path / "r.ibp", x)
    assert r.is_raw and r.nbytes == r.raw_nbytes


def test_compress_overwrites_atomically(files, tmp_path, capsys):
    d, x, y = files
    out = tmp_path / "o.ibp"
    assert run(capsys, "compress", d / "table.safetensors", out)[0] == 0
    assert run(capsys, "compress", d / "tensor.pt", out)[0] == 0
    loaded_equals(out, x)
    assert sorted(os.listdir(tmp_path)) == ["o.ibp"]


# ---------------------------------------------------------------- refusing to unpickle

def test_pickled_object_is_refused_not_executed(files, tmp_path, capsys):
    d, _, _ = files
    marker = d / "PWNED"
    rc, out, err = run(capsys, "compress", d / "evil.pt", tmp_path / "e.ibp")
    assert_error(rc, err, 1, "evil.pt", "refused")
    assert not marker.exists(), "the pickled object was executed"
    assert not (tmp_path / "e.ibp").exists()
    ibp_embed.compress(data()).save(tmp_path / "ok.ibp")
    rc, out, err = run(capsys, "verify", tmp_path / "ok.ibp", "--against", d / "evil.pt", "--key", "w")
    assert_error(rc, err, 1, "refused")
    assert not marker.exists()


def test_object_npy_is_refused(files, tmp_path, capsys):
    d, _, _ = files
    rc, _, err = run(capsys, "compress", d / "object.npy", tmp_path / "o.ibp")
    assert_error(rc, err, 1, "object.npy", "refused")


# ---------------------------------------------------------------- inspect

@pytest.fixture(scope="module")
def clustered(files, tmp_path_factory):
    d, x, _ = files
    path = tmp_path_factory.mktemp("inspect") / "k.ibp"
    t = ibp_embed.compress(x, clusters=3, word_bits=32, allow_raw=False)
    assert t.clusters > 1
    t.save(path)
    return path, t


def test_inspect_json(clustered, capsys):
    path, t = clustered
    rc, out, err = run(capsys, "inspect", path, "--json")
    assert rc == 0, err
    s = json.loads(out)
    assert s["shape"] == [300, 16] and s["dtype"] == "float32"
    assert (s["word_bits"], s["clusters"]) == (t.word_bits, t.clusters)
    assert (s["nbytes"], s["raw_nbytes"]) == (t.nbytes, t.raw_nbytes)
    assert s["ratio"] == pytest.approx(t.ratio)
    assert s["file_bytes"] == path.stat().st_size and s["format_version"] == 1
    ids, lengths = t.cluster_ids(), t.row_lengths()
    assert s["raw_rows"] == int((ids == -1).sum())
    assert len(s["cluster_stats"]) == t.clusters
    assert sum(c["rows"] for c in s["cluster_stats"]) + s["raw_rows"] == 300
    for c in s["cluster_stats"]:
        k = c["cluster"]
        assert c["rows"] == int((ids == k).sum())
        if c["rows"]:
            assert c["mean_stored_bytes"] == pytest.approx(lengths[ids == k].mean())
        assert c["invariant_bits_per_word"] == pytest.approx(np.bitwise_count(t.masks[k]).mean())
    assert s["payload_bytes"] + s["index_bytes"] + s["mask_bytes"] <= s["nbytes"]


def test_inspect_text(clustered, capsys):
    path, t = clustered
    rc, out, err = run(capsys, "inspect", path)
    assert rc == 0, err
    assert "300 x 16" in out and "float32" in out and f"{t.ratio:.4f}" in out
    assert f"{t.word_bits} bits" in out and "raw rows" in out
    lines = [line.split() for line in out.splitlines()]
    rows = {int(r[0]): int(r[1]) for r in lines if len(r) == 5 and r[0].isdigit()}
    ids = t.cluster_ids()
    assert rows == {k: int((ids == k).sum()) for k in range(t.clusters)}


def test_inspect_empty_table(tmp_path, capsys):
    ibp_embed.compress(torch.empty(0, 4), allow_raw=False).save(tmp_path / "z.ibp")
    rc, out, err = run(capsys, "inspect", tmp_path / "z.ibp", "--json")
    assert rc == 0, err
    s = json.loads(out)
    assert s["shape"] == [0, 4] and s["raw_rows"] == 0 and s["cluster_stats"][0]["rows"] == 0
    ibp_embed.compress(torch.empty(0, 4)).save(tmp_path / "r.ibp")  # raw: 0 bytes
    rc, out, err = run(capsys, "inspect", tmp_path / "r.ibp", "--json")
    s = json.loads(out)
    assert rc == 0 and s["clusters"] == 0 and s["nbytes"] == 0 and s["cluster_stats"] == []
    assert s["format_version"] == 2


def test_inspect_raw_table(tmp_path, capsys):
    x = torch.randint(-2**31, 2**31 - 1, (300, 16), dtype=torch.int32).view(torch.float32)  # random bits
    ibp_embed.compress(x).save(tmp_path / "r.ibp")
    rc, out, err = run(capsys, "inspect", tmp_path / "r.ibp", "--json")
    s = json.loads(out)
    assert rc == 0 and s["format_version"] == 2 and s["clusters"] == 0 and s["cluster_stats"] == []
    assert s["nbytes"] == s["raw_nbytes"] == s["payload_bytes"] == 300 * 64 and s["raw_rows"] == 300
    assert s["index_bytes"] == s["mask_bytes"] == 0
    rc, out, err = run(capsys, "inspect", tmp_path / "r.ibp")
    assert rc == 0 and "a raw table" in out and "tail pad 0" in out, err


# ---------------------------------------------------------------- verify

def test_verify(files, tmp_path, capsys):
    d, x, y = files
    out = tmp_path / "v.ibp"
    assert run(capsys, "compress", d / "state.pt", out, "--key", "emb.weight")[0] == 0
    rc, stdout, err = run(capsys, "verify", out)
    assert rc == 0, err
    assert "OK" in stdout
    for src, key in (("state.pt", "emb.weight"), ("tensor.pt", None), ("table.npy", None)):
        rc, stdout, err = run(capsys, "verify", out, "--against", d / src, *(["--key", key] if key else []))
        assert rc == 0, err
        assert "bit-identical" in stdout


def test_verify_against_different_data(files, tmp_path, capsys):
    d, x, _ = files
    out = tmp_path / "v.ibp"
    ibp_embed.compress(x).save(out)
    z = x.clone()
    z.view(torch.int32)[137, 5] ^= 1  # one bit of one element
    torch.save(z, tmp_path / "z.pt")
    rc, _, err = run(capsys, "verify", out, "--against", tmp_path / "z.pt")
    assert_error(rc, err, 1, "FAILED", "row 137", "column 5")
    torch.save(x.to(torch.bfloat16), tmp_path / "bf16.pt")
    rc, _, err = run(capsys, "verify", out, "--against", tmp_path / "bf16.pt")
    assert_error(rc, err, 1, "dtype float32", "bfloat16")
    torch.save(x[:-1].clone(), tmp_path / "short.pt")
    rc, _, err = run(capsys, "verify", out, "--against", tmp_path / "short.pt")
    assert_error(rc, err, 1, "shape 300 x 16", "299 x 16")


def test_verify_reports_mismatch_in_a_later_chunk(files, tmp_path, capsys, monkeypatch):
    _, x, _ = files
    out = tmp_path / "v.ibp"
    ibp_embed.compress(x).save(out)
    z = x.clone()
    z[251, 0] = -z[251, 0] if z[251, 0] != 0 else 1.0
    np.save(tmp_path / "z.npy", z.numpy())
    monkeypatch.setattr(cli, "VERIFY_CHUNK_BYTES", 64 * 16 * 4)  # 64 rows a chunk, with a bar
    rc, stdout, err = run(capsys, "verify", out, "--against", tmp_path / "z.npy")
    assert_error(rc, err, 1, "row 251")
    rc, stdout, err = run(capsys, "verify", out, "--against", tmp_path / "z.npy", "--quiet")
    assert_error(rc, err, 1, "row 251")
    assert err.strip().count("\n") == 0  # --quiet: no progress bar, one line
    np.save(tmp_path / "x.npy", x.numpy())
    rc, stdout, err = run(capsys, "verify", out, "--against", tmp_path / "x.npy")
    assert rc == 0, err


def _undecodable_table(x) -> tuple[CompressedTable, int]:
    """A table with valid structure whose row `bad` has a broken bitstream."""
    t = ibp_embed.compress(x, word_bits=32, allow_raw=False)
    lengths = t.row_lengths()
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    for row in range(200, x.shape[0]):
        if lengths[row] >= x.shape[1] * x.dtype.itemsize:
            continue
        for pos in range(starts[row], starts[row + 1]):
            payload = np.array(t._payload)
            payload[pos] ^= 0xFF
            u = CompressedTable(shape=t.shape, dtype=t.dtype, word_bits=t.word_bits, masks=t._masks,
                                bitvals=t._bitvals, block_base=t._block_base, rel=t._rel,
                                payload=payload, payload_bytes=t._payload_bytes)
            try:
                u.gather([row])
            except ibp_embed.FormatError:
                return u, row
    raise AssertionError("no undecodable corruption found")


def test_verify_corrupt_files(files, tmp_path, capsys):
    _, x, _ = files
    out = tmp_path / "c.ibp"
    ibp_embed.compress(x).save(out)
    raw = bytearray(out.read_bytes())
    raw[-100] ^= 0x10  # inside the payload
    out.write_bytes(bytes(raw))
    rc, _, err = run(capsys, "verify", out)
    assert_error(rc, err, 1, "checksum")
    # Checksums that match corrupt rows (as a buggy writer would make): decoding catches it.
    u, bad = _undecodable_table(x)
    u.save(tmp_path / "u.ibp")
    rc, _, err = run(capsys, "verify", tmp_path / "u.ibp")
    assert_error(rc, err, 1, f"row {bad}", "does not decode")


# ---------------------------------------------------------------- errors and exit codes

@pytest.mark.parametrize("argv,code,fragment", [
    (["compress", "{d}/missing.pt", "{o}"], 1, "no such file"),
    (["compress", "{d}/table.csv", "{o}"], 2, "unknown input type"),
    (["compress", "{d}/state.pt", "{o}"], 2, "--key"),  # two 2-D tensors
    (["compress", "{d}/two.safetensors", "{o}"], 2, "a, b"),
    (["compress", "{d}/state.pt", "{o}", "--key", "nope"], 2, "emb.weight"),
    (["compress", "{d}/state.pt", "{o}", "--key", "emb.bias"], 1, "2-D"),
    (["compress", "{d}/tensor.pt", "{o}", "--key", "x"], 2, "single tensor"),
    (["compress", "{d}/table.npy", "{o}", "--key", "x"], 2, "--key"),
    (["compress", "{d}/vector.pt", "{o}"], 1, "2-D"),
    (["compress", "{d}/cube.npy", "{o}"], 1, "2-D"),
    (["compress", "{d}/complex.npy", "{o}"], 1, "complex64"),
    (["compress", "{d}/garbage.pt", "{o}"], 1, "not a readable PyTorch file"),
    (["compress", "{d}/tensor.pt", "{d}/no/such/dir/x.ibp"], 1, "cannot write"),
    (["compress", "{d}/tensor.pt", "{o}", "--word-bits", "8"], 2, "--word-bits"),
    (["compress", "{d}/tensor.pt", "{o}", "--clusters", "0"], 2, "--clusters"),
    (["compress", "{d}/tensor.pt", "{o}", "--clusters", "300"], 2, "--clusters"),
    (["compress", "{d}/tensor.pt", "{o}", "--threshold", "0.3"], 2, "--threshold"),
    (["compress", "{d}/tensor.pt"], 2, "OUT"),
    ([], 2, "COMMAND"),
    (["frobnicate"], 2, "frobnicate"),
    (["inspect", "{d}/missing.ibp"], 1, "missing.ibp"),
    (["inspect", "{d}/tensor.pt"], 1, "not an .ibp file"),
    (["verify", "{d}/table.npy"], 1, "not an .ibp file"),
    (["verify", "{o0}", "--key", "emb"], 2, "--against"),
    (["verify", "{o0}", "--against", "{d}/missing.npy"], 1, "no such file"),
])
def test_errors(files, tmp_path, capsys, argv, code, fragment):
    d, x, _ = files
    ibp_embed.compress(x).save(tmp_path / "o0.ibp")
    argv = [a.format(d=d, o=tmp_path / "o.ibp", o0=tmp_path / "o0.ibp") for a in argv]
    rc, out, err = run(capsys, *argv)
    assert_error(rc, err, code, fragment)
    if code == 1:
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o.ibp").exists()


def test_help_and_version(capsys):
    rc, out, _ = run(capsys, "--help")
    assert rc == 0 and "compress" in out and "inspect" in out and "verify" in out
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and "format version 2" in out


# ---------------------------------------------------------------- the console script

def test_console_script(files, tmp_path):
    d, x, y = files
    assert SCRIPT.exists(), f"{SCRIPT} missing: pip install -e ."
    out = tmp_path / "s.ibp"
    env = dict(os.environ, IBP_NUM_THREADS="1")
    r = subprocess.run([str(SCRIPT), "compress", str(d / "table.safetensors"), str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "120 x 6" in r.stdout
    loaded_equals(out, y)
    r = subprocess.run([str(SCRIPT), "verify", str(out), "--against", str(d / "table.safetensors")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and "bit-identical" in r.stdout, r.stderr
    r = subprocess.run([str(SCRIPT), "compress", str(d / "evil.pt"), str(tmp_path / "e.ibp")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 1 and "refused" in r.stderr and "Traceback" not in r.stderr
    assert not (d / "PWNED").exists()
