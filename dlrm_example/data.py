"""Criteo-like data for the DLRM example: a generator, a TSV reader and an .npy reader.

Every source has the same interface (:class:`DataSource`): ``train_batch(i)`` and
``eval_batch(i)`` give global batch i (all ranks), ``Batch.rows(lo, hi)`` cuts a rank's
part out of it. The trainer consumes train batch i at step i, so a resumed run sees
exactly the batches it would have seen had it not stopped.

* :class:`GeneratedData`: Criteo Kaggle cardinalities scaled by ``scale``, Zipf ids
  (exponent ``alpha``) scattered over each table by a fixed permutation, optional
  multi-hot bags (DLRMv2 pooling sizes), 13 log-normal integer dense features
  (log1p-transformed, as DLRM does), and labels drawn from a hidden logistic model
  (per-row effects of every categorical feature, two pairwise interactions, a linear
  dense term): a trainer that works learns it and gets an AUC well above 0.5.
* :class:`CriteoTSV`: Criteo's text format (label, 13 integers, 26 hex ids, tab
  separated; empty fields allowed: 0 for integers, id 0 for categories). Malformed
  lines are skipped, counted and reported; over the limit the reader stops with
  :class:`DataError`. Dense values become log1p(max(x, 0)); ids are hashed into the
  tables with ``id % rows``.
* :class:`CriteoNpy`: TorchRec's preprocessed binary format (``day_<k>_dense.npy``
  float32 [N, 13] already log-transformed, ``day_<k>_sparse.npy`` int [N, 26],
  ``day_<k>_labels.npy`` int [N] or [N, 1]; see torchrec.datasets.criteo). Files are
  memory-mapped; ids are taken ``% rows``.

For both real-data readers the first ``eval_samples`` samples are held out for
evaluation and training cycles over the rest.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

import numpy as np
import torch

from ibp_embed.datasets import CRITEO_KAGGLE_CARDINALITIES, DLRMV2_MULTI_HOT

NUM_DENSE = 13
NUM_SPARSE = 26
FEATURE_NAMES = [f"cat_{i}" for i in range(NUM_SPARSE)]  # TorchRec's DEFAULT_CAT_NAMES
MIN_ROWS = 32  # scaled tables keep at least min(cardinality, MIN_ROWS) rows


class DataError(Exception):
    """Bad or unreadable input data (the trainer reports it and exits non-zero)."""


def scaled_cardinalities(scale: float, base: Sequence[int] = CRITEO_KAGGLE_CARDINALITIES) -> List[int]:
    """Criteo Kaggle's 26 cardinalities times `scale`; small features keep up to
    MIN_ROWS rows so scaling never erases a feature."""
    if not scale > 0:
        raise ValueError(f"scale must be positive, not {scale}")
    return [max(int(round(n * scale)), min(n, MIN_ROWS)) for n in base]


@dataclass
class Batch:
    """One batch: dense [B, 13] float32, ids key-major (feature 0's bags for the whole
    batch, then feature 1's, ...) with lengths [26 * B], labels [B] float32."""

    dense: torch.Tensor
    values: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.labels.numel())

    def kjt(self):
        from torchrec import KeyedJaggedTensor

        return KeyedJaggedTensor.from_lengths_sync(keys=FEATURE_NAMES, values=self.values, lengths=self.lengths)

    def rows(self, lo: int, hi: int) -> "Batch":
        """Samples lo..hi-1 (a rank's part of a global batch)."""
        b = self.size
        if lo == 0 and hi == b:
            return self
        offsets = torch.zeros(NUM_SPARSE * b + 1, dtype=torch.int64)
        torch.cumsum(self.lengths, 0, out=offsets[1:])
        parts = [self.values[int(offsets[f * b + lo]):int(offsets[f * b + hi])] for f in range(NUM_SPARSE)]
        return Batch(self.dense[lo:hi], torch.cat(parts),
                     self.lengths.view(NUM_SPARSE, b)[:, lo:hi].reshape(-1).clone(), self.labels[lo:hi])


def rank_slice(batch_size: int, rank: int, world: int) -> tuple:
    """The samples of a global batch that `rank` trains on."""
    per = batch_size // world
    return rank * per, (rank + 1) * per


def _seed(*parts) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(*parts))


class DataSource:
    cardinalities: List[int]
    multi_hot: Optional[List[int]] = None
    description: str = ""

    def train_batch(self, index: int, batch_size: int) -> Batch:
        raise NotImplementedError

    def eval_batch(self, index: int, batch_size: int) -> Batch:
        raise NotImplementedError

    def report(self) -> Optional[str]:
        """A line about skipped input (malformed lines), or None."""
        return None


# ---------------------------------------------------------------------------
# Generated data
# ---------------------------------------------------------------------------

class GeneratedData(DataSource):
    """Criteo-like generated batches; batch i of a split is a pure function of
    (seed, split, i, batch size), so any batch can be regenerated on its own."""

    EFFECT_STD = 0.35    # per-row effect of each categorical feature on the logit
    DENSE_STD = 0.25     # weights of the standardised dense features
    PAIR_STD = 0.6       # weight of the two pairwise interactions
    BIAS = -1.75         # about 25% positives, like Criteo

    def __init__(self, cardinalities: Sequence[int], *, seed: int = 0, alpha: float = 1.05,
                 multi_hot: Optional[Sequence[int]] = None):
        if not alpha > 0:
            raise ValueError(f"the Zipf exponent must be positive, not {alpha}")
        self.cardinalities = [int(n) for n in cardinalities]
        if len(self.cardinalities) != NUM_SPARSE or min(self.cardinalities) < 1:
            raise ValueError("26 positive cardinalities expected")
        self.multi_hot = None if multi_hot is None else [int(m) for m in multi_hot]
        if self.multi_hot is not None and (len(self.multi_hot) != NUM_SPARSE or min(self.multi_hot) < 1):
            raise ValueError("26 positive multi-hot sizes expected")
        self.seed, self.alpha = int(seed), float(alpha)
        self._cdf, self._perm, self._effect = {}, {}, {}
        g = _gen(self.seed, "hidden-dense")
        self._dense_mu = torch.rand(NUM_DENSE, generator=g, dtype=torch.float64) * 4.0
        self._dense_sigma = 0.5 + torch.rand(NUM_DENSE, generator=g, dtype=torch.float64) * 1.5
        self._dense_w = torch.randn(NUM_DENSE, generator=g, dtype=torch.float64) * self.DENSE_STD
        self._pairs = [(0, 1), (5, 13)]
        mh = "one-hot" if self.multi_hot is None else "multi-hot (DLRMv2 sizes)"
        self.description = (f"generated Criteo-like data: {sum(self.cardinalities):,} rows in 26 tables, "
                            f"Zipf {self.alpha}, {mh}, seed {self.seed}")

    def _feature(self, f: int):
        if f not in self._cdf:
            n = self.cardinalities[f]
            self._cdf[f] = torch.cumsum(torch.arange(1, n + 1, dtype=torch.float64).pow_(-self.alpha), 0)
            self._perm[f] = torch.randperm(n, generator=_gen(self.seed, "perm", f))
            self._effect[f] = torch.randn(n, generator=_gen(self.seed, "effect", f), dtype=torch.float64) \
                * self.EFFECT_STD
        return self._cdf[f], self._perm[f], self._effect[f]

    def _batch(self, split: str, index: int, batch_size: int) -> Batch:
        g = _gen(self.seed, split, int(index), int(batch_size))
        b = int(batch_size)
        z = torch.randn(b, NUM_DENSE, generator=g, dtype=torch.float64)
        raw = torch.floor(torch.exp(self._dense_mu + self._dense_sigma * z)) - 1.0
        dense = torch.log1p(raw.clamp(min=0.0))
        logit = torch.full((b,), self.BIAS, dtype=torch.float64)
        logit += ((dense - 2.0) / 1.5) @ self._dense_w
        values, lengths, per_feature = [], [], []
        for f in range(NUM_SPARSE):
            cdf, perm, effect = self._feature(f)
            m = 1 if self.multi_hot is None else self.multi_hot[f]
            u = torch.rand(b * m, generator=g, dtype=torch.float64).mul_(cdf[-1])
            ranks = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.numel() - 1)
            ids = perm[ranks]
            values.append(ids)
            lengths.append(torch.full((b,), m, dtype=torch.int64))
            e = effect[ids].view(b, m).mean(1)
            per_feature.append(e)
            logit += e
        for a, c in self._pairs:
            logit += self.PAIR_STD * per_feature[a] * per_feature[c] / (self.EFFECT_STD ** 2) * 0.25
        p = torch.sigmoid(logit)
        labels = (torch.rand(b, generator=g, dtype=torch.float64) < p).float()
        return Batch(dense.float(), torch.cat(values), torch.cat(lengths), labels)

    def train_batch(self, index: int, batch_size: int) -> Batch:
        return self._batch("train", index, batch_size)

    def eval_batch(self, index: int, batch_size: int) -> Batch:
        return self._batch("eval", index, batch_size)


# ---------------------------------------------------------------------------
# Real Criteo data
# ---------------------------------------------------------------------------

class _SampleStore(DataSource):
    """Shared logic for readers that produce arrays of samples in file order: the first
    eval_samples samples are the eval split, training cycles over the others."""

    def __init__(self, cardinalities: Sequence[int], eval_samples: int):
        self.cardinalities = [int(n) for n in cardinalities]
        self.eval_samples = int(eval_samples)
        self._mod = np.asarray(self.cardinalities, dtype=np.int64)

    def _n_samples(self) -> int:
        raise NotImplementedError

    def _take(self, idx: np.ndarray):
        """(dense float32 [n, 13], sparse int64 [n, 26] already % rows, labels float32 [n])."""
        raise NotImplementedError

    def _make(self, idx: np.ndarray) -> Batch:
        dense, sparse, labels = self._take(idx)
        return Batch(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
                     torch.from_numpy(np.ascontiguousarray(sparse.T.reshape(-1), dtype=np.int64)),
                     torch.ones(NUM_SPARSE * len(idx), dtype=torch.int64),
                     torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32)))

    def _split_sizes(self):
        n = self._n_samples()
        n_eval = min(self.eval_samples, n // 2)
        return n_eval, n - n_eval

    def train_batch(self, index: int, batch_size: int) -> Batch:
        n_eval, n_train = self._split_sizes()
        if n_train <= 0:
            raise DataError("no training samples")
        idx = n_eval + (np.arange(index * batch_size, (index + 1) * batch_size, dtype=np.int64) % n_train)
        return self._make(idx)

    def eval_batch(self, index: int, batch_size: int) -> Batch:
        n_eval, _ = self._split_sizes()
        if n_eval <= 0:
            raise DataError("no samples left for evaluation")
        idx = np.arange(index * batch_size, (index + 1) * batch_size, dtype=np.int64) % n_eval
        return self._make(idx)


_HEX = re.compile(r"[0-9a-fA-F]{1,16}\Z")


class CriteoTSV(_SampleStore):
    """Criteo TSV file(s) (optionally .gz), parsed once into memory-resident arrays.

    Reads at most `max_samples` valid lines (None: all). Malformed lines (wrong field
    count, a label other than 0/1, a non-integer dense value, a non-hex id) are
    skipped and counted; when more than max_bad_lines of them are found *and* they
    are more than max_bad_fraction of the lines read, reading stops with DataError.
    """

    def __init__(self, paths, cardinalities: Sequence[int], *, eval_samples: int = 4096,
                 max_samples: Optional[int] = None, max_bad_lines: int = 100,
                 max_bad_fraction: float = 0.01):
        super().__init__(cardinalities, eval_samples)
        self.paths = [Path(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
        self.bad_lines = 0
        self.lines_read = 0
        self.examples: List[str] = []
        labels, dense, sparse = [], [], []
        for path in self.paths:
            for lineno, line in _read_lines(path):
                if max_samples is not None and len(labels) >= max_samples:
                    break
                self.lines_read += 1
                parsed = _parse_line(line)
                if isinstance(parsed, str):
                    self.bad_lines += 1
                    if len(self.examples) < 5:
                        self.examples.append(f"{path}:{lineno}: {parsed}")
                    if self.bad_lines > max_bad_lines and self.bad_lines > max_bad_fraction * self.lines_read:
                        raise DataError(
                            f"{path}: {self.bad_lines} malformed lines out of {self.lines_read} read (limit: "
                            f"{max_bad_lines} lines and {max_bad_fraction:.1%}); first: "
                            + "; ".join(self.examples))
                    continue
                label, d, s = parsed
                labels.append(label)
                dense.append(d)
                sparse.append(s)
        if not labels:
            raise DataError(f"{', '.join(map(str, self.paths))}: no valid Criteo lines"
                            + (f" ({self.bad_lines} malformed; first: {'; '.join(self.examples)})"
                               if self.bad_lines else ""))
        self._labels = np.asarray(labels, dtype=np.float32)
        d = np.asarray(dense, dtype=np.float64)
        self._dense = np.log1p(np.maximum(d, 0.0)).astype(np.float32)
        self._sparse = np.asarray(sparse, dtype=np.uint64)
        self._sparse = (self._sparse % self._mod.astype(np.uint64)).astype(np.int64)
        self.description = (f"Criteo TSV {', '.join(map(str, self.paths))}: {len(labels):,} samples"
                            + (f", {self.bad_lines} malformed lines skipped" if self.bad_lines else ""))

    def _n_samples(self) -> int:
        return int(self._labels.size)

    def _take(self, idx):
        return self._dense[idx], self._sparse[idx], self._labels[idx]

    def report(self) -> Optional[str]:
        if not self.bad_lines:
            return None
        return (f"skipped {self.bad_lines} malformed line(s) of {self.lines_read}; first: "
                + "; ".join(self.examples))


def _read_lines(path: Path) -> Iterator[tuple]:
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8", errors="replace", newline="\n") as f:
            for lineno, line in enumerate(f, 1):
                yield lineno, line
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, expected a Criteo TSV file") from None
    except PermissionError:
        raise DataError(f"{path}: permission denied") from None
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: unreadable: {e}") from None


def _parse_line(line: str):
    """(label, 13 ints, 26 ids) or a string saying what is wrong."""
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != 1 + NUM_DENSE + NUM_SPARSE:
        return f"{len(fields)} fields, expected {1 + NUM_DENSE + NUM_SPARSE}"
    if fields[0] not in ("0", "1"):
        return f"label {fields[0]!r} is not 0 or 1"
    dense = []
    for j, v in enumerate(fields[1:1 + NUM_DENSE]):
        if not v:
            dense.append(0)
            continue
        try:
            dense.append(int(v))
        except ValueError:
            return f"integer feature {j + 1} is {v!r}"
    sparse = []
    for j, v in enumerate(fields[1 + NUM_DENSE:]):
        if not v:
            sparse.append(0)
        elif _HEX.match(v):
            sparse.append(int(v, 16))
        else:
            return f"categorical feature {j + 1} is {v!r}, not hex"
    return int(fields[0]), dense, sparse


class CriteoNpy(_SampleStore):
    """TorchRec's preprocessed Criteo: day_<k>_{dense,sparse,labels}.npy in a directory."""

    def __init__(self, directory, cardinalities: Sequence[int], *, eval_samples: int = 4096):
        super().__init__(cardinalities, eval_samples)
        d = Path(directory)
        if not d.exists():
            raise DataError(f"{d}: no such directory")
        if not d.is_dir():
            raise DataError(f"{d}: not a directory (expected TorchRec's day_<k>_dense/sparse/labels.npy files)")
        days = sorted({int(m.group(1)) for p in d.iterdir()
                       for m in [re.fullmatch(r"day_(\d+)_(dense|sparse|labels)\.npy", p.name)] if m})
        if not days:
            raise DataError(f"{d}: no day_<k>_dense.npy / day_<k>_sparse.npy / day_<k>_labels.npy files")
        self._dense, self._sparse, self._labels, self._starts = [], [], [], [0]
        for k in days:
            arrs = {}
            for part in ("dense", "sparse", "labels"):
                p = d / f"day_{k}_{part}.npy"
                if not p.exists():
                    raise DataError(f"{p}: missing (day {k} needs dense, sparse and labels files)")
                try:
                    arrs[part] = np.load(p, mmap_mode="r", allow_pickle=False)
                except PermissionError:
                    raise DataError(f"{p}: permission denied") from None
                except (OSError, ValueError, EOFError) as e:
                    raise DataError(f"{p}: not a readable .npy file: {e}") from None
            dense, sparse, labels = arrs["dense"], arrs["sparse"], arrs["labels"]
            n = dense.shape[0] if dense.ndim else -1
            if dense.ndim != 2 or dense.shape[1] != NUM_DENSE:
                raise DataError(f"{d}/day_{k}_dense.npy: shape {dense.shape}, expected [N, {NUM_DENSE}]")
            if sparse.shape != (n, NUM_SPARSE) or sparse.dtype.kind not in "iu":
                raise DataError(f"{d}/day_{k}_sparse.npy: {sparse.dtype} {sparse.shape}, expected integers "
                                f"[{n}, {NUM_SPARSE}]")
            if labels.shape not in ((n,), (n, 1)):
                raise DataError(f"{d}/day_{k}_labels.npy: shape {labels.shape}, expected [{n}] or [{n}, 1]")
            self._dense.append(dense)
            self._sparse.append(sparse)
            self._labels.append(labels.reshape(-1))
            self._starts.append(self._starts[-1] + n)
        self.description = f"TorchRec Criteo .npy in {d}: days {days}, {self._starts[-1]:,} samples"

    def _n_samples(self) -> int:
        return self._starts[-1]

    def _take(self, idx):
        day = np.searchsorted(self._starts, idx, side="right") - 1
        dense = np.empty((idx.size, NUM_DENSE), dtype=np.float32)
        sparse = np.empty((idx.size, NUM_SPARSE), dtype=np.int64)
        labels = np.empty(idx.size, dtype=np.float32)
        for k in np.unique(day):
            sel = np.flatnonzero(day == k)
            local = idx[sel] - self._starts[k]
            order = np.argsort(local, kind="stable")  # ascending reads from the mmap
            rows = local[order]
            dense[sel[order]] = self._dense[k][rows]
            s = np.asarray(self._sparse[k][rows])
            if s.dtype.kind == "i" and s.size and s.min() < 0:
                raise DataError(f"day_{k}_sparse.npy holds negative ids")
            sparse[sel[order]] = (s.astype(np.uint64) % self._mod.astype(np.uint64)).astype(np.int64)
            labels[sel[order]] = self._labels[k][rows]
        return dense, sparse, labels


def make_source(kind: str, path: Optional[str], *, scale: float, seed: int, alpha: float,
                multi_hot: bool, eval_samples: int = 4096, max_samples: Optional[int] = None,
                max_bad_lines: int = 100, max_bad_fraction: float = 0.01) -> DataSource:
    cards = scaled_cardinalities(scale)
    if kind == "generated":
        return GeneratedData(cards, seed=seed, alpha=alpha, multi_hot=DLRMV2_MULTI_HOT if multi_hot else None)
    if multi_hot:
        raise DataError("--multi-hot applies to generated data only (Criteo files are one-hot)")
    if kind == "criteo-tsv":
        return CriteoTSV(path, cards, eval_samples=eval_samples, max_samples=max_samples,
                         max_bad_lines=max_bad_lines, max_bad_fraction=max_bad_fraction)
    if kind == "criteo-npy":
        return CriteoNpy(path, cards, eval_samples=eval_samples)
    raise ValueError(f"unknown data kind {kind!r}")


def write_tsv(path, batch: Batch, rng: Optional[np.random.Generator] = None) -> None:
    """Write a Batch as Criteo TSV lines (dense values back to integers, ids as hex);
    for tests and examples."""
    b = batch.size
    dense = np.rint(np.expm1(batch.dense.numpy().astype(np.float64))).astype(np.int64)
    ids = batch.values.view(NUM_SPARSE, b).numpy() if batch.values.numel() == NUM_SPARSE * b else None
    if ids is None:
        raise ValueError("write_tsv needs one-hot batches")
    with open(path, "w") as f:
        for i in range(b):
            fields = [str(int(batch.labels[i]))] + [str(v) for v in dense[i]] + \
                     [format(int(v), "08x") for v in ids[:, i]]
            f.write("\t".join(fields) + "\n")


__all__ = ["Batch", "DataError", "DataSource", "GeneratedData", "CriteoTSV", "CriteoNpy", "FEATURE_NAMES",
           "NUM_DENSE", "NUM_SPARSE", "make_source", "rank_slice", "scaled_cardinalities", "write_tsv"]
