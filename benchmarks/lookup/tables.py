"""Table sets: Criteo-like generated tables and trained tables loaded from a directory."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

import ibp_embed
from ibp_embed import datasets

from .names import DTYPE_SHORT, INIT_LABEL

TRAINED_ALPHA = 1.05  # popularity skew of the trained-like tables
SMALL_TABLE_ROWS = 1000  # tables up to this size keep their cardinality when scaled


def criteo_rows(scale: float) -> list[int]:
    """Criteo Kaggle cardinalities scaled: small tables keep their size (see module doc)."""
    return [max(int(round(n * scale)), min(n, SMALL_TABLE_ROWS)) for n in datasets.CRITEO_KAGGLE_CARDINALITIES]


@dataclasses.dataclass
class TableSet:
    name: str
    init: str  # torchrec / trained / dir
    dtype: torch.dtype
    dims: list[int]
    rows: list[int]
    source: str = "generated"
    tensors: list | None = None  # preloaded weights (--trained-tables)

    @property
    def label(self) -> str:
        d = self.dims[0] if len(set(self.dims)) == 1 else "mixed"
        return f"{DTYPE_SHORT[self.dtype]} d{d} {INIT_LABEL[self.init]}"

    @property
    def raw_bytes(self) -> int:
        return sum(n * d * self.dtype.itemsize for n, d in zip(self.rows, self.dims))

    def perm_seeds(self) -> list[int]:
        return list(range(len(self.rows)))

    def weights(self, t: int) -> torch.Tensor:
        if self.tensors is not None:
            return self.tensors[t]
        n, d = self.rows[t], self.dims[t]
        if self.init == "trained":
            return datasets.make_trained_like_table(n, d, self.dtype, alpha=TRAINED_ALPHA, seed=t, perm_seed=t)
        return datasets.make_table(n, d, self.dtype, init="torchrec", seed=t)


def _state_dict_tables(obj, prefix=""):
    """(key, tensor) of 2-D floating tensors with 'embedding' in the key, in nested dicts."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 2 and obj.is_floating_point() and "embedding" in prefix.lower():
            yield prefix, obj
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _state_dict_tables(v, f"{prefix}.{k}" if prefix else str(k))


def load_trained_tables(path) -> list[tuple[str, torch.Tensor]]:
    """Tables under `path` (a directory or one file): *.ibp files and *.pt/*.pth state_dicts."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    out = []
    for f in files:
        if f.suffix == ".ibp":
            out.append((str(f.relative_to(path) if path.is_dir() else f.name),
                        ibp_embed.load(f, mmap=False).decompress()))
        elif f.suffix in (".pt", ".pth"):
            obj = torch.load(f, map_location="cpu", weights_only=True)
            if isinstance(obj, torch.Tensor) and obj.dim() == 2 and obj.is_floating_point():
                out.append((f.name, obj))
                continue
            found = list(_state_dict_tables(obj))
            for k, v in found:
                out.append((f"{f.name}:{k}", v.detach().contiguous()))
    if not out:
        raise SystemExit(f"--trained-tables {path}: no .ibp file and no state_dict tensor with "
                         f"'embedding' in its key found")
    return out


def trained_table_sets(path) -> list[TableSet]:
    tables = load_trained_tables(path)
    sets = []
    for dtype in sorted({t.dtype for _, t in tables}, key=str):
        if dtype not in DTYPE_SHORT:
            print(f"# --trained-tables: skipping {dtype} tables (fp32/fp16/bf16 only)", file=sys.stderr)
            continue
        ts = [(k, t) for k, t in tables if t.dtype == dtype]
        sets.append(TableSet(name=f"dir-{DTYPE_SHORT[dtype]}", init="dir", dtype=dtype,
                             dims=[int(t.shape[1]) for _, t in ts], rows=[int(t.shape[0]) for _, t in ts],
                             source=f"{path}: " + ", ".join(k for k, _ in ts), tensors=[t for _, t in ts]))
    return sets

