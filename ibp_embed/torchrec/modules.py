"""IBPEmbeddingBagCollection: TorchRec's EmbeddingBagCollection over IBP-compressed tables.

The module has EmbeddingBagCollection's interface (configs, KeyedJaggedTensor in,
KeyedTensor out, same keys, order and layout) but holds every table as an immutable
:class:`ibp_embed.CompressedTable` in host memory. Pooled lookups run in the native
library and decode only the rows a batch touches; no table is ever decompressed
whole in ``forward``. It is an inference module: tables carry no gradient.

Checkpoints: ``state_dict()`` exposes each table as a plain decompressed tensor under
TorchRec's key ``embedding_bags.<table>.weight``; ``load_state_dict`` re-compresses.
``save_compressed(dir)`` / ``load_compressed(dir)`` keep the compressed form (one .ibp
file per table plus ``manifest.json``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingBagCollectionInterface,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from ..codec import compress
from ..io import load as load_table
from ..table import CompressedTable

__all__ = [
    "IBPEmbeddingBag",
    "IBPEmbeddingBagCollection",
    "FeatureKeyError",
    "MANIFEST_NAME",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "ibp_embed.torchrec.IBPEmbeddingBagCollection"
MANIFEST_VERSION = 1

# Codec options accepted by the modules and passed to ibp_embed.compress.
CODEC_OPTIONS = ("word_bits", "clusters", "threshold", "sample_rows", "seed", "progress")

_DATA_TYPES = {
    DataType.FP32.value: torch.float32,
    DataType.FP16.value: torch.float16,
    DataType.BF16.value: torch.bfloat16,
}
_POOLING_MODES = {PoolingType.SUM.value: "sum", PoolingType.MEAN.value: "mean"}

CUDA_MISSING = (
    "ibp_embed has no CUDA lookup path yet (the native library decodes on the CPU "
    "only); keep IBPEmbeddingBagCollection on device='cpu' (or 'meta'), and feed it CPU "
    "KeyedJaggedTensors"
)


class FeatureKeyError(KeyError):
    """A KeyedJaggedTensor lacks a feature the module needs, or carries one it does not know."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


def check_codec_options(options: Dict[str, Any]) -> Dict[str, Any]:
    unknown = sorted(set(options) - set(CODEC_OPTIONS))
    if unknown:
        raise TypeError(f"unknown codec option(s) {unknown}; expected some of {list(CODEC_OPTIONS)}")
    return dict(options)


def table_dtype(config: EmbeddingBagConfig) -> torch.dtype:
    dtype = _DATA_TYPES.get(config.data_type.value)
    if dtype is None:
        raise ValueError(f"table {config.name!r}: data_type {config.data_type.value} is not supported "
                         f"(use FP32, FP16 or BF16)")
    return dtype


def pooling_mode(config_or_pooling) -> str:
    pooling = getattr(config_or_pooling, "pooling", config_or_pooling)
    mode = _POOLING_MODES.get(pooling.value)
    if mode is None:
        raise ValueError(f"pooling {pooling.value} is not supported (use SUM or MEAN)")
    return mode


def resolve_device(device) -> torch.device:
    """cpu (default) or meta; cuda raises NotImplementedError naming the missing path."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cuda":
        raise NotImplementedError(CUDA_MISSING)
    if device.type not in ("cpu", "meta"):
        raise ValueError(f"device {device} is not supported (use 'cpu' or 'meta')")
    return device


# ---------------------------------------------------------------------------
# Pooled lookups over a KeyedJaggedTensor
# ---------------------------------------------------------------------------

class _Slot:
    """What the key at one position of an input KJT is looked up in."""

    __slots__ = ("table", "mode", "dim", "n_rows", "feature", "table_name")

    def __init__(self, table: Optional[CompressedTable], mode: str, dim: int, n_rows: int,
                 feature: str, table_name: str):
        self.table, self.mode, self.dim, self.n_rows = table, mode, dim, n_rows
        self.feature, self.table_name = feature, table_name


def _kjt_parts(kjt: KeyedJaggedTensor, n_keys: int, weighted: bool, who: str):
    """(values int64 np, offsets np [F*B+1], weights float32 np or None, B), validated."""
    if kjt.variable_stride_per_key():
        raise NotImplementedError(f"{who}: variable batch size per feature (VBE) is not supported")
    inv = kjt.inverse_indices_or_none()
    if inv is not None:
        raise NotImplementedError(f"{who}: KeyedJaggedTensor inverse indices (VBE) are not supported")
    values = kjt.values()
    if values.device.type == "cuda":
        raise NotImplementedError(CUDA_MISSING)
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise TypeError(f"{who}: ids must be integers, got {values.dtype}")
    weights = kjt.weights_or_none()
    if weighted and weights is None:
        raise ValueError(f"{who} is weighted (is_weighted=True) but the KeyedJaggedTensor has no weights")
    if not weighted and weights is not None:
        raise ValueError(f"{who} is unweighted (is_weighted=False) but the KeyedJaggedTensor carries "
                         f"weights; build the module with is_weighted=True or drop the weights")
    b = kjt.stride()
    n_values = values.numel()
    off = kjt.offsets()
    off_np = np.ascontiguousarray(off.detach().to("cpu", torch.int64).numpy())
    if off_np.shape != (n_keys * b + 1,):
        raise ValueError(f"{who}: offsets have {off_np.size} entries, expected "
                         f"{n_keys} keys x batch {b} + 1 = {n_keys * b + 1}")
    if off_np[0] != 0 or off_np[-1] != n_values or (off_np.size > 1 and np.any(np.diff(off_np) < 0)):
        raise ValueError(f"{who}: offsets must run from 0 to len(values) = {n_values} without "
                         f"decreasing (got {int(off_np[0])} .. {int(off_np[-1])})")
    vals = np.ascontiguousarray(values.detach().reshape(-1).to("cpu", torch.int64).numpy())
    w = None
    if weights is not None:
        if weights.numel() != n_values:
            raise ValueError(f"{who}: {weights.numel()} weights for {n_values} ids")
        w = np.ascontiguousarray(weights.detach().reshape(-1).to("cpu", torch.float32).numpy())
    return vals, off_np, w, b


DEDUP_MODES = ("auto", "always", "never")
DEDUP_MIN_IDS = 256        # auto: fewer ids than this always take the fused native lookup
DEDUP_MAX_UNIQUE = 0.5     # auto: deduplicate when at most this fraction of the ids is distinct


def check_dedup(dedup: str) -> str:
    if dedup not in DEDUP_MODES:
        raise ValueError(f"dedup must be one of {DEDUP_MODES}, not {dedup!r}")
    return dedup


def _lookup_one(s: _Slot, ids: np.ndarray, bag_off: np.ndarray, w: Optional[np.ndarray],
                dedup: str) -> torch.Tensor:
    """Pool one feature. dedup: decode each distinct id once (CompressedTable.gather) and pool
    the decoded rows with torch's embedding_bag, ids in their original order (the same
    summation order as the native lookup); otherwise the native fused decode-and-pool."""
    if dedup != "never" and ids.size >= (1 if dedup == "always" else DEDUP_MIN_IDS):
        ids_t = torch.from_numpy(ids)
        uniq, inv = torch.unique(ids_t, sorted=True, return_inverse=True)
        if dedup == "always" or uniq.numel() <= DEDUP_MAX_UNIQUE * ids.size:
            rows = s.table.gather(uniq)
            if rows.dtype != torch.float32:
                rows = rows.float()
            off_t = torch.from_numpy(bag_off)
            if w is None:
                return torch.nn.functional.embedding_bag(inv, rows, off_t, mode=s.mode, include_last_offset=True)
            out = torch.nn.functional.embedding_bag(inv, rows, off_t, mode="sum", include_last_offset=True,
                                                    per_sample_weights=torch.from_numpy(w))
            if s.mode == "mean":
                lengths = torch.from_numpy(np.diff(bag_off)).clamp_(min=1).to(torch.float32)
                out *= (1.0 / lengths)[:, None]
            return out
    return s.table.lookup(ids, bag_off, w, mode=s.mode)


def pooled_lookup(kjt: KeyedJaggedTensor, slots: Sequence[_Slot], weighted: bool, who: str,
                  key_index: Optional[Sequence[int]] = None, dedup: str = "never") -> torch.Tensor:
    """[B, sum(slot dims)] float32: slot i pools key key_index[i] of kjt (default: key i).

    Every check (keys, offsets, weights, id ranges) runs before any native call.
    """
    n_keys = len(kjt.keys())
    if key_index is None:
        key_index = range(len(slots))
    total_dim = sum(s.dim for s in slots)
    values = kjt.values()
    if values.device.type == "meta" or any(s.table is None for s in slots):
        if values.device.type != "meta":
            raise RuntimeError(f"{who} is on the meta device: load weights (load_state_dict or "
                               f"load_compressed) before running it on real inputs")
        return torch.empty((kjt.stride(), total_dim), dtype=torch.float32, device="meta")
    vals, off, w, b = _kjt_parts(kjt, n_keys, weighted, who)
    jobs = []
    for s, k in zip(slots, key_index):
        lo, hi = int(off[k * b]), int(off[(k + 1) * b])
        ids = vals[lo:hi]
        if ids.size:
            mn, mx = ids.min(), ids.max()
            if mn < 0 or mx >= s.n_rows:
                bad = int(mn if mn < 0 else mx)
                raise IndexError(f"{who}: feature {s.feature!r} has id {bad}, out of range for table "
                                 f"{s.table_name!r} of {s.n_rows} rows")
        jobs.append((s, ids, off[k * b:(k + 1) * b + 1] - lo, None if w is None else w[lo:hi]))
    outs = [_lookup_one(s, ids, bag_off, ws, dedup) for s, ids, bag_off, ws in jobs]
    if not outs:
        return torch.empty((b, 0), dtype=torch.float32)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def compress_weight(weight: torch.Tensor, dtype: torch.dtype, codec_options: Dict[str, Any]) -> CompressedTable:
    w = weight.detach()
    if w.device.type == "meta":
        raise ValueError("cannot compress a meta tensor: it holds no values")
    w = w.to("cpu", dtype).contiguous()
    return compress(w, **codec_options)


# ---------------------------------------------------------------------------
# One table
# ---------------------------------------------------------------------------

class IBPEmbeddingBag(nn.Module):
    """One compressed table; its state_dict entry ``weight`` is the decompressed tensor."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, mode: str,
                 table: Optional[CompressedTable], codec_options: Dict[str, Any], name: str = ""):
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.dtype, self.mode, self.name = dtype, mode, name
        self._codec_options = codec_options
        self.table: Optional[CompressedTable] = None
        if table is not None:
            self.set_table(table)

    def set_table(self, table: CompressedTable) -> None:
        if tuple(table.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"table {self.name!r}: compressed table has shape {tuple(table.shape)}, "
                             f"the config says ({self.num_embeddings}, {self.embedding_dim})")
        if table.dtype != self.dtype:
            raise ValueError(f"table {self.name!r}: compressed table holds {table.dtype}, "
                             f"the config says {self.dtype}")
        self.table = table

    def load_weight(self, weight: torch.Tensor) -> None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"table {self.name!r}: weight must be a tensor, got {type(weight).__name__}")
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"table {self.name!r}: weight has shape {tuple(weight.shape)}, expected "
                             f"({self.num_embeddings}, {self.embedding_dim})")
        self.set_table(compress_weight(weight, self.dtype, self._codec_options))

    def weight(self) -> torch.Tensor:
        """The whole table decompressed (a new tensor; for checkpoints, not for lookups)."""
        if self.table is None:
            return torch.empty((self.num_embeddings, self.embedding_dim), dtype=self.dtype, device="meta")
        return self.table.decompress()

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}, mode={self.mode!r}, "
                f"table={self.table!r}")

    # state_dict integration: a virtual "weight" entry.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight"
        for k in state_dict:
            if k.startswith(prefix) and k != key and strict:
                unexpected_keys.append(k)
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value = state_dict[key]
        self.check_weight(key, value)
        self.set_table(compress_weight(value, self.dtype, self._codec_options))

    def check_weight(self, key: str, value) -> None:
        # Errors raise at once rather than going to error_msgs: DistributedModelParallel's
        # load_state_dict drops error_msgs, and a bad table must not load silently.
        if not isinstance(value, torch.Tensor) or type(value).__name__ in ("ShardedTensor", "DTensor"):
            raise RuntimeError(f"{key}: expected a plain tensor, got {type(value).__name__}")
        if tuple(value.shape) != (self.num_embeddings, self.embedding_dim):
            raise RuntimeError(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} "
                               f"from checkpoint, the shape in current model is "
                               f"{(self.num_embeddings, self.embedding_dim)}.")
        if value.device.type == "meta":
            raise RuntimeError(f"{key}: the checkpoint holds a meta tensor (no values)")


# ---------------------------------------------------------------------------
# The collection
# ---------------------------------------------------------------------------

class IBPEmbeddingBagCollection(EmbeddingBagCollectionInterface):
    """EmbeddingBagCollection with IBP-compressed, host-resident tables.

    Args:
        tables: the EmbeddingBagConfigs (FP32, FP16 or BF16; SUM or MEAN pooling).
        is_weighted: whether inputs carry per-id weights (as in TorchRec). With MEAN
            pooling a weighted bag is its weighted sum divided by the bag length
            (FBGEMM's semantics).
        device: None or "cpu" (tables are initialised with each config's init_fn,
            TorchRec's default uniform(-sqrt(1/N), sqrt(1/N)), then compressed), or
            "meta" (no storage: load weights with load_state_dict or load_compressed).
            "cuda" raises NotImplementedError: there is no CUDA lookup path yet.
        ignore_extra_features: accept input keys no table reads (TorchRec's EBC does);
            by default they raise FeatureKeyError.
        dedup: "never" (default: the native fused decode-and-pool on every id),
            "always" or "auto". Deduplicated lookups decode each distinct id of a
            feature's batch once (CompressedTable.gather), then pool the decoded rows
            with torch's embedding_bag (same result, same summation order); "auto" does
            so when at most half the ids of a feature's batch are distinct. On the
            development machine it did not pay off (benchmarks/lookup.py); try it on
            very skewed traffic.
        word_bits, clusters, threshold, sample_rows, seed, progress: codec options
            passed to :func:`ibp_embed.compress` whenever a table is (re)compressed.
    """

    def __init__(self, tables: List[EmbeddingBagConfig], is_weighted: bool = False,
                 device: Optional[torch.device] = None, *, ignore_extra_features: bool = False,
                 dedup: str = "never", _tables: Optional[Dict[str, CompressedTable]] = None,
                 **codec_options: Any) -> None:
        super().__init__()
        self._codec_options = check_codec_options(codec_options)
        self._device = resolve_device(device)
        self._is_weighted = bool(is_weighted)
        self._ignore_extra = bool(ignore_extra_features)
        self.dedup = check_dedup(dedup)
        self._embedding_bag_configs = tables
        self.embedding_bags: nn.ModuleDict = nn.ModuleDict()
        names = set()
        for config in tables:
            if config.name in names:
                raise ValueError(f"Duplicate table name {config.name}")
            names.add(config.name)
            if not config.feature_names:
                config.feature_names = [config.name]
            if config.num_embeddings <= 0 or config.embedding_dim <= 0:
                raise ValueError(f"table {config.name!r}: num_embeddings and embedding_dim must be positive")
            bag = IBPEmbeddingBag(config.num_embeddings, config.embedding_dim, table_dtype(config),
                                  pooling_mode(config), None, self._codec_options, config.name)
            if _tables is not None:
                bag.set_table(_tables[config.name])
            self.embedding_bags[config.name] = bag
        self._feature_names: List[List[str]] = [list(c.feature_names) for c in tables]
        self._embedding_names: List[str] = [
            e for names_ in get_embedding_names_by_table(tables) for e in names_]
        self._lengths_per_embedding: List[int] = [
            c.embedding_dim for c in tables for _ in c.feature_names]
        self._needed = {f for names_ in self._feature_names for f in names_}
        if _tables is None and self._device.type == "cpu":
            self.reset_parameters()
        elif _tables is not None:
            self._device = torch.device("cpu")

    # ---- construction from other forms ----
    @classmethod
    def from_embedding_bag_collection(cls, ebc: EmbeddingBagCollection, *,
                                      ignore_extra_features: bool = False, dedup: str = "never",
                                      **codec_options: Any) -> "IBPEmbeddingBagCollection":
        """Compress the tables of an existing (e.g. trained) EmbeddingBagCollection."""
        if not isinstance(ebc, EmbeddingBagCollectionInterface) or not hasattr(ebc, "embedding_bags"):
            raise TypeError(f"expected a torchrec EmbeddingBagCollection, got {type(ebc).__name__}")
        codec_options = check_codec_options(codec_options)
        configs = [dataclasses.replace(c, feature_names=list(c.feature_names))
                   for c in ebc.embedding_bag_configs()]
        tables = {}
        for c in configs:
            weight = ebc.embedding_bags[c.name].weight
            if weight.device.type == "meta":
                raise ValueError(f"table {c.name!r} of the EmbeddingBagCollection is on the meta device "
                                 f"(no values to compress); materialise or load it first")
            if tuple(weight.shape) != (c.num_embeddings, c.embedding_dim):
                raise ValueError(f"table {c.name!r}: weight has shape {tuple(weight.shape)}, the config "
                                 f"says ({c.num_embeddings}, {c.embedding_dim})")
            # Keep the EBC's own element type (it stores non-FP32 configs as fp16).
            if weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"table {c.name!r}: weight dtype {weight.dtype} is not supported")
            c.data_type = {torch.float32: DataType.FP32, torch.float16: DataType.FP16,
                           torch.bfloat16: DataType.BF16}[weight.dtype]
            tables[c.name] = compress_weight(weight, weight.dtype, codec_options)
        return cls(configs, is_weighted=ebc.is_weighted(), ignore_extra_features=ignore_extra_features,
                   dedup=dedup, _tables=tables, **codec_options)

    def to_embedding_bag_collection(self, device=None) -> EmbeddingBagCollection:
        """A plain TorchRec EmbeddingBagCollection holding the decompressed tables."""
        configs = [dataclasses.replace(c, feature_names=list(c.feature_names))
                   for c in self._embedding_bag_configs]
        ebc = EmbeddingBagCollection(configs, is_weighted=self._is_weighted, device=device)
        ebc.load_state_dict(self.state_dict())
        return ebc

    # ---- EmbeddingBagCollectionInterface ----
    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        return self._device

    def tables(self) -> Dict[str, Optional[CompressedTable]]:
        """Table name -> CompressedTable (None while on the meta device)."""
        return {name: bag.table for name, bag in self.embedding_bags.items()}

    @property
    def compressed_nbytes(self) -> int:
        return sum(b.table.nbytes for b in self.embedding_bags.values() if b.table is not None)

    @property
    def raw_nbytes(self) -> int:
        return sum(b.num_embeddings * b.embedding_dim * b.dtype.itemsize for b in self.embedding_bags.values())

    def reset_parameters(self) -> None:
        """Re-initialise every table with its config's init_fn, then compress it."""
        if self._device.type == "meta":
            return
        for config in self._embedding_bag_configs:
            bag = self.embedding_bags[config.name]
            w = torch.empty((config.num_embeddings, config.embedding_dim), dtype=bag.dtype)
            assert config.init_fn is not None
            with torch.no_grad():
                out = config.init_fn(w)
            if isinstance(out, torch.Tensor) and out.shape == w.shape:
                w = out
            bag.set_table(compress_weight(w, bag.dtype, self._codec_options))
            del w

    def _slots(self) -> List[_Slot]:
        slots = []
        for config, feats in zip(self._embedding_bag_configs, self._feature_names):
            bag = self.embedding_bags[config.name]
            for f in feats:
                slots.append(_Slot(bag.table, bag.mode, bag.embedding_dim, bag.num_embeddings, f, config.name))
        return slots

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if not isinstance(features, KeyedJaggedTensor):
            from torchrec.sparse.tensor_dict import maybe_td_to_kjt

            features = maybe_td_to_kjt(features, None)
            if not isinstance(features, KeyedJaggedTensor):
                raise TypeError(f"expected a KeyedJaggedTensor, got {type(features).__name__}")
        keys = features.keys()
        if len(set(keys)) != len(keys):
            raise FeatureKeyError(f"IBPEmbeddingBagCollection: duplicate keys in input {list(keys)}")
        pos = {k: i for i, k in enumerate(keys)}
        missing = [f for f in dict.fromkeys(f for fs in self._feature_names for f in fs) if f not in pos]
        if missing:
            raise FeatureKeyError(f"IBPEmbeddingBagCollection: input lacks feature(s) {missing}; it has "
                                  f"{list(keys)}")
        extra = [k for k in keys if k not in self._needed]
        if extra and not self._ignore_extra:
            raise FeatureKeyError(f"IBPEmbeddingBagCollection: unknown feature(s) {extra} (the tables "
                                  f"read {sorted(self._needed)}); pass ignore_extra_features=True to "
                                  f"ignore them")
        slots = self._slots()
        key_index = [pos[s.feature] for s in slots]
        values = pooled_lookup(features, slots, self._is_weighted, "IBPEmbeddingBagCollection", key_index,
                               self.dedup)
        return KeyedTensor(keys=self._embedding_names, values=values,
                           length_per_key=self._lengths_per_embedding)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Check every table's entry before any is re-compressed, so a bad checkpoint
        # leaves the module as it was.
        for name, bag in self.embedding_bags.items():
            key = f"{prefix}embedding_bags.{name}.weight"
            if key in state_dict:
                bag.check_weight(key, state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    # ---- compressed checkpoints ----
    def save_compressed(self, path) -> None:
        """Write one .ibp per table and manifest.json into directory `path`, atomically.

        Table files get fresh names; the manifest is replaced last (write, fsync,
        rename), so a reader sees either the old checkpoint or the new one. Files of
        the previous checkpoint are removed afterwards.
        """
        if any(b.table is None for b in self.embedding_bags.values()):
            raise RuntimeError("cannot save a meta-device module: it holds no tables")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        old = _manifest_files(path)
        token = secrets.token_hex(4)
        entries = []
        for i, config in enumerate(self._embedding_bag_configs):
            bag = self.embedding_bags[config.name]
            fname = f"{i:04d}-{_safe(config.name)}.{token}.ibp"
            bag.table.save(path / fname)
            entries.append({
                "name": config.name, "file": fname,
                "num_embeddings": config.num_embeddings, "embedding_dim": config.embedding_dim,
                "feature_names": list(config.feature_names), "pooling": config.pooling.value,
                "data_type": config.data_type.value,
                "weight_init_min": config.weight_init_min, "weight_init_max": config.weight_init_max,
                "file_size": (path / fname).stat().st_size,
            })
        manifest = {
            "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION,
            "is_weighted": self._is_weighted, "tables": entries,
            "codec_options": {k: v for k, v in self._codec_options.items() if k != "progress"},
        }
        _atomic_write(path / MANIFEST_NAME, json.dumps(manifest, indent=1).encode())
        keep = {e["file"] for e in entries}
        for f in old - keep:
            try:
                (path / f).unlink()
            except OSError:
                pass

    @classmethod
    def load_compressed(cls, path, *, mmap: bool = False, verify: bool = True,
                        ignore_extra_features: bool = False, dedup: str = "never",
                        **codec_options: Any) -> "IBPEmbeddingBagCollection":
        """Open a directory written by save_compressed. mmap=True maps the .ibp files."""
        path = Path(path)
        manifest = _read_manifest(path)
        configs, tables = [], {}
        for e in manifest["tables"]:
            config = EmbeddingBagConfig(
                num_embeddings=int(e["num_embeddings"]), embedding_dim=int(e["embedding_dim"]),
                name=e["name"], feature_names=list(e["feature_names"]),
                pooling=PoolingType(e["pooling"]), data_type=DataType(e["data_type"]),
                weight_init_min=e.get("weight_init_min"), weight_init_max=e.get("weight_init_max"))
            t = load_table(path / e["file"], mmap=mmap, verify=verify)
            if tuple(t.shape) != (config.num_embeddings, config.embedding_dim):
                raise ValueError(f"{path / e['file']}: table has shape {tuple(t.shape)}, the manifest "
                                 f"says ({config.num_embeddings}, {config.embedding_dim})")
            configs.append(config)
            tables[config.name] = t
        opts = dict(manifest.get("codec_options") or {})
        opts.update(codec_options)
        return cls(configs, is_weighted=bool(manifest["is_weighted"]),
                   ignore_extra_features=ignore_extra_features, dedup=dedup, _tables=tables,
                   **check_codec_options(opts))

    def extra_repr(self) -> str:
        return f"is_weighted={self._is_weighted}, device={self._device}, dedup={self.dedup!r}"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64] or "table"


def _read_manifest(path: Path) -> Dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no {MANIFEST_NAME} (not a save_compressed directory)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path / MANIFEST_NAME}: unreadable manifest: {e}") from None
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path / MANIFEST_NAME}: not an IBPEmbeddingBagCollection manifest")
    if manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{path / MANIFEST_NAME}: manifest version {manifest.get('version')} "
                         f"(this build reads {MANIFEST_VERSION})")
    return manifest


def _manifest_files(path: Path) -> set:
    try:
        return {e["file"] for e in _read_manifest(path)["tables"]}
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return set()


def _atomic_write(target: Path, data: bytes) -> None:
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    try:
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
