"""Atomic training checkpoints, TorchRec's way: torch.distributed.checkpoint.

Layout of a checkpoint directory DIR::

    DIR/LATEST                    name of the newest complete checkpoint (replaced atomically)
    DIR/step-00000200.<id>/meta.json  format, version, backend, model config, step, world size, ...
    DIR/step-00000200.<id>/model/     torch.distributed.checkpoint of the model's state_dict
                                  (tables as ShardedTensors, IBP ones decompressed) and of
                                  the fused optimizer state; every rank writes its shards,
                                  and any number of ranks can load it (resharding)
    DIR/step-00000200.<id>/dense.pt   dense optimizer state, step, last loss (rank 0)

A checkpoint is written into a fresh hidden directory, every file fsynced, then the
directory is renamed into place and LATEST is replaced (write, fsync, rename). A run
killed at any moment leaves the previous checkpoint intact and LATEST pointing at a
complete one. The two newest checkpoints are kept.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from ibp_embed.errors import FormatError
from ibp_embed.files import fsync_dir, open_regular

FORMAT = "dlrm_example.checkpoint"
VERSION = 2
KEEP = 2


class CheckpointError(Exception):
    """A checkpoint that cannot be used (missing, corrupt, other model or format)."""


def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(root))


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _read_regular(path: Path) -> bytes:
    with open_regular(path) as f:
        return f.read()


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def begin(root: Path, step: int) -> Path:
    """A fresh temporary directory for the checkpoint of `step` (rank 0 creates it)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{step_name(step)}-{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)
    return tmp


def commit(root: Path, tmp: Path, step: int, meta: Dict[str, Any]) -> Path:
    """Finish a checkpoint (rank 0, after every rank wrote its files): meta, fsync,
    rename into place, point LATEST at it, drop old checkpoints."""
    meta = dict(meta, format=FORMAT, version=VERSION, step=int(step))
    with open(tmp / "meta.json", "w") as f:
        json.dump(meta, f, indent=1)
    _fsync_tree(tmp)
    # A unique name: re-saving a step never replaces the directory LATEST still names.
    final = root / f"{step_name(step)}.{secrets.token_hex(4)}"
    os.rename(tmp, final)
    fsync_dir(root)
    tmp_latest = root / f".LATEST.{secrets.token_hex(4)}.tmp"
    with open(tmp_latest, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_latest, root / "LATEST")
    fsync_dir(root)
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
    for old in done[:-KEEP]:
        if old.name != final.name:
            shutil.rmtree(old, ignore_errors=True)
    for stale in root.iterdir():  # temporaries of interrupted writers
        if stale.name.startswith(".tmp-") and stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def latest(root: Path) -> Optional[Path]:
    """The newest complete checkpoint under root, or None when there is none."""
    try:
        name = _read_regular(root / "LATEST").decode().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, FormatError) as e:
        raise CheckpointError(f"{root}/LATEST: unreadable: {e}") from None
    path = root / name
    if not name.startswith("step-") or not (path / "meta.json").is_file():
        raise CheckpointError(f"{root}/LATEST names {name!r}, which is not a complete checkpoint")
    return path


def read_meta(path: Path) -> Dict[str, Any]:
    try:
        meta = json.loads(_read_regular(path / "meta.json"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no meta.json (not a checkpoint of this trainer)") from None
    except (OSError, ValueError, FormatError) as e:
        raise CheckpointError(f"{path}/meta.json: unreadable: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} checkpoint")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {meta.get('version')!r}; this trainer "
                              f"reads version {VERSION}")
    return meta


def check_compatible(meta: Dict[str, Any], path: Path, *, backend: str, model_config: Dict[str, Any],
                     optimizer: str, eval_only: bool) -> None:
    if meta.get("model_config") != model_config:
        saved = meta.get("model_config") or {}
        diff = sorted(k for k in set(saved) | set(model_config) if saved.get(k) != model_config.get(k))
        raise CheckpointError(f"{path}: checkpoint is from another model (differs in {', '.join(diff)}); "
                              f"use the same --model/--scale/--multi-hot/--embedding-dim/arch options "
                              f"or another --checkpoint directory")
    if meta.get("backend") != backend:
        raise CheckpointError(f"{path}: checkpoint was written by --backend {meta.get('backend')}; "
                              f"resume it with that backend")
    if not eval_only and meta.get("optimizer") != optimizer:
        raise CheckpointError(f"{path}: checkpoint holds {meta.get('optimizer')} optimizer state, "
                              f"not {optimizer}; use --optimizer {meta.get('optimizer')}")


def save_dense(path: Path, dense_opt_state: Dict[str, Any], extra: Dict[str, Any]) -> None:
    torch.save({"optimizer": dense_opt_state, **extra}, path / "dense.pt")


def load_dense(path: Path) -> Dict[str, Any]:
    try:
        with open_regular(path / "dense.pt") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: dense.pt is missing") from None
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a corrupt file
        raise CheckpointError(f"{path}/dense.pt: unreadable: {e}") from None
