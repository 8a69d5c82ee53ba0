"""Compressed checkpoints of IBPEmbeddingBagCollection: one .ibp per table + manifest.json.

    DIR/manifest.json                      tables, configs, codec options, optimizer
    DIR/0000-<table>.<token>.ibp           one per table (fresh token per save)
    DIR/0000-<table>.<token>.<state>.npy   optimizer state of trainable modules

A save writes the new files under fresh names, then replaces the manifest atomically
(write, fsync, rename), so a reader sees the old checkpoint or the new one, never a
mix; only then are the previous checkpoint's files removed. Guarantees:

* A save that fails part-way removes what it wrote; the old checkpoint stays whole.
* A save deletes only files it could have generated: names of the pattern above,
  directly inside DIR. A foreign or tampered manifest naming ``manifest.json`` or a
  user's file cannot make it delete them.
* Files take the mode of the checkpoint they replace (its manifest's), else the one
  the umask gives a new file.
* Loading reads regular files only (a FIFO or a device raises FormatError instead of
  blocking), and refuses a file that resolves outside DIR (a symlink leading out).
"""
from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Dict

import numpy as np
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType

from ..files import atomic_file, new_file_mode, open_regular
from ..table import load as load_table
from ..optim import SparseOptimizer, make_optimizer

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "ibp_embed.torchrec.IBPEmbeddingBagCollection"
MANIFEST_VERSION = 1
_NAME = r"[A-Za-z0-9_.-]{1,64}"
GENERATED = re.compile(rf"\d{{4}}-{_NAME}\.[0-9a-f]{{8}}\.(ibp|{_NAME}\.npy)")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64] or "table"


def save_compressed(module, path) -> None:
    """module.save_compressed(path): see the module docstring for the guarantees."""
    if any(b.table is None for b in module.embedding_bags.values()):
        raise RuntimeError("cannot save a meta-device module: it holds no tables")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    old = _manifest_files(path)
    mode = new_file_mode(path / MANIFEST_NAME)
    token = secrets.token_hex(4)
    written = []

    def finish(name: str) -> None:
        written.append(name)
        os.chmod(path / name, mode)

    try:
        entries = []
        for i, config in enumerate(module.embedding_bag_configs()):
            bag = module.embedding_bags[config.name]
            fname = f"{i:04d}-{_safe(config.name)}.{token}.ibp"
            bag.table.save(path / fname)
            finish(fname)
            entry = {
                "name": config.name, "file": fname,
                "num_embeddings": config.num_embeddings, "embedding_dim": config.embedding_dim,
                "feature_names": list(config.feature_names), "pooling": config.pooling.value,
                "data_type": config.data_type.value,
                "weight_init_min": config.weight_init_min, "weight_init_max": config.weight_init_max,
                "file_size": (path / fname).stat().st_size,
            }
            if bag.optimizer_state:
                files = {}
                for k, v in bag.optimizer_state.items():
                    sname = f"{i:04d}-{_safe(config.name)}.{token}.{_safe(k)}.npy"
                    written.append(sname)  # before writing: a failed write is removed too
                    _write_npy(path / sname, v.detach().cpu().numpy())
                    os.chmod(path / sname, mode)
                    files[k] = sname
                entry["optimizer_state"] = files
            entries.append(entry)
        manifest = {
            "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
            "is_weighted": module.is_weighted(), "tables": entries,
            "codec_options": {k: v for k, v in module._codec_options.items() if k != "progress"},
        }
        if module.trainable:
            manifest["optimizer"] = {"name": module.optimizer.name, "params": module.optimizer.params()}
        with atomic_file(path / MANIFEST_NAME) as f:
            f.write(json.dumps(manifest, indent=1).encode())
    except BaseException:
        for name in written:
            (path / name).unlink(missing_ok=True)
        raise
    for name in old - set(written):
        if GENERATED.fullmatch(name):
            (path / name).unlink(missing_ok=True)


def read_compressed(path, optimizer, *, mmap: bool, verify: bool):
    """(configs, tables by name, optimizer state by table name, manifest, optimizer) of
    a save_compressed directory; optimizer as load_compressed takes it."""
    path = Path(path)
    manifest = _read_manifest(path)
    saved_opt = manifest.get("optimizer")
    if isinstance(optimizer, str):
        if optimizer != "saved":
            raise ValueError(f"optimizer must be a SparseOptimizer, None or 'saved', not {optimizer!r}")
        if not saved_opt:
            raise ValueError(f"{path / MANIFEST_NAME}: the checkpoint holds no optimizer (an inference "
                             f"checkpoint); pass an optimizer to start training from it")
        try:
            optimizer = make_optimizer(saved_opt["name"], **saved_opt.get("params", {}))
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"{path / MANIFEST_NAME}: bad optimizer entry {saved_opt!r}: {e}") from None
    if optimizer is not None and not isinstance(optimizer, SparseOptimizer):
        raise TypeError(f"optimizer must be a SparseOptimizer, None or 'saved', not {type(optimizer).__name__}")
    if optimizer is not None and saved_opt and saved_opt.get("name") != optimizer.name:
        raise ValueError(f"{path / MANIFEST_NAME}: the checkpoint's optimizer state is for "
                         f"{saved_opt.get('name')!r}, not {optimizer.name!r}")
    configs, tables, states = [], {}, {}
    for e in manifest["tables"]:
        config = EmbeddingBagConfig(
            num_embeddings=int(e["num_embeddings"]), embedding_dim=int(e["embedding_dim"]),
            name=e["name"], feature_names=list(e["feature_names"]),
            pooling=PoolingType(e["pooling"]), data_type=DataType(e["data_type"]),
            weight_init_min=e.get("weight_init_min"), weight_init_max=e.get("weight_init_max"))
        t = load_table(_inside(path, e["file"]), mmap=mmap and optimizer is None, verify=verify)
        if tuple(t.shape) != (config.num_embeddings, config.embedding_dim):
            raise ValueError(f"{path / e['file']}: table has shape {tuple(t.shape)}, the manifest "
                             f"says ({config.num_embeddings}, {config.embedding_dim})")
        configs.append(config)
        tables[config.name] = t
        if optimizer is not None and e.get("optimizer_state"):
            states[config.name] = {k: _read_npy(_inside(path, f)) for k, f in e["optimizer_state"].items()}
    return configs, tables, states, manifest, optimizer


def _inside(path: Path, name: str) -> Path:
    """path / name, refusing one that resolves outside path (a symlink leading out)."""
    target = path / name
    real = target.resolve()
    if real.parent != path.resolve():
        raise ValueError(f"{target}: a symlink to {real}, outside the checkpoint directory (refused)")
    return target


def _write_npy(target: Path, array: np.ndarray) -> None:
    with open(target, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def _read_npy(path: Path) -> np.ndarray:
    try:
        with open_regular(path) as f:
            return np.load(f, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable optimizer state: {e}") from None


def _read_manifest(path: Path) -> Dict[str, Any]:
    try:
        with open_regular(_inside(path, MANIFEST_NAME)) as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no {MANIFEST_NAME} (not a save_compressed directory)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path / MANIFEST_NAME}: unreadable manifest: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path / MANIFEST_NAME}: not an IBPEmbeddingBagCollection manifest")
    if manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{path / MANIFEST_NAME}: manifest version {manifest.get('version')} "
                         f"(this build reads {MANIFEST_VERSION})")
    # Files are read by name: only plain names inside the directory, never a path.
    try:
        names = [e["file"] for e in manifest["tables"]] + [
            f for e in manifest["tables"] for f in (e.get("optimizer_state") or {}).values()]
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path / MANIFEST_NAME}: malformed table list: {e}") from None
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"{path / MANIFEST_NAME}: file entry {name!r} is not a plain file name")
    return manifest


def _manifest_files(path: Path) -> set:
    """Names the existing manifest lists (empty when there is none or it is unreadable)."""
    try:
        tables = _read_manifest(path)["tables"]
        return {e["file"] for e in tables} | {f for e in tables for f in (e.get("optimizer_state") or {}).values()}
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
        return set()
