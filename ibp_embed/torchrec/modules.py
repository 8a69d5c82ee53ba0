"""IBPEmbeddingBagCollection: TorchRec's EmbeddingBagCollection over IBP-compressed tables.

The module has EmbeddingBagCollection's interface (configs, KeyedJaggedTensor in,
KeyedTensor out, same keys, order and layout) but holds every table as an immutable
:class:`ibp_embed.CompressedTable` in host memory. Pooled lookups run in the native
library and decode only the rows a batch touches; no table is ever decompressed
whole in ``forward``. By default it is an inference module: tables carry no gradient.

Training (opt-in, ``optimizer=ibp_embed.optim.SGD(lr)``, ``Adagrad(lr, eps)`` or
``RowWiseAdagrad(lr, eps, ...)``): every table becomes an
:class:`ibp_embed.store.UpdatableTable`, forward returns pooled outputs that require
grad, and backward applies the sparse optimizer to the touched rows inside a
torch.autograd.Function (fused into backward as in FBGEMM's TBE: no dense table
gradient is ever built). Optimizer state is uncompressed fp32, in state_dict and in
save_compressed checkpoints, and counted by ``memory_stats()``.

Checkpoints: ``state_dict()`` exposes each table as a decompressed tensor under
TorchRec's key ``embedding_bags.<table>.weight`` (in-place changes of it re-compress
the table); ``load_state_dict`` re-compresses.
``save_compressed(dir)`` / ``load_compressed(dir)`` keep the compressed form (one .ibp
file per table plus ``manifest.json``).
"""
# No `from __future__ import annotations`: TorchRec's schema checks and TorchScript read
# this module's annotations as objects, as they read EmbeddingBagCollection's.
import dataclasses
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingBagCollectionInterface,
    get_embedding_names_by_table,
)
from torch.fx._symbolic_trace import is_fx_tracing
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
from torchrec.sparse.tensor_dict import maybe_td_to_kjt

from .. import cuda
from ..optim import SparseOptimizer
from ..store import UpdatableTable, memory_stats
from ..table import CompressedTable
from .device import check_cache_options
from .lookup import (
    FeatureKeyError,
    JobCache,
    Slot,
    apply_updates,
    check_codec_options,
    compress_weight,
    lookup_jobs,
    pooling_mode,
    resolve_device,
    table_dtype,
    training_lookup,
    warn_if_dedup,
    warn_if_weights_need_grad,
)
from .embedding_bag import DEFAULT_REPACK_DRIFT, IBPEmbeddingBag


@torch.fx.wrap
def key_positions(keys: List[str], features: List[str], distinct: bool) -> List[int]:
    """The position in `keys` of each of `features` (the last, where a key repeats, as
    KeyedJaggedTensor.to_dict reads it); `distinct`: no feature is listed twice. One node
    in an fx graph, computed from each call's keys."""
    if distinct and keys == features:  # the usual input: 8 us scripted, not 13 (26 features)
        return list(range(len(features)))
    last: Dict[str, int] = {}
    for i, k in enumerate(keys):
        last[k] = i
    positions: List[int] = []
    for f in features:
        if f not in last:
            raise KeyError("IBPEmbeddingBagCollection: input lacks feature '" + f + "'")
        positions.append(last[f])
    return positions


@torch.fx.wrap
def key_count(keys: List[str]) -> int:
    return len(keys)


__all__ = [
    "IBPEmbeddingBag",
    "IBPEmbeddingBagCollection",
    "FeatureKeyError",
]

# ---------------------------------------------------------------------------
# The collection
# ---------------------------------------------------------------------------

class IBPEmbeddingBagCollection(EmbeddingBagCollectionInterface):
    """EmbeddingBagCollection with IBP-compressed, host-resident tables.

    Inference modules look tables up with ``torch.ops.ibp.pooled_lookup``: forward can
    be traced by torch.fx / torchrec.fx, compiled with ``torch.compile(fullgraph=True)``,
    exported with ``torch.export`` and scripted with ``torch.jit.script``, as TorchRec's
    EBC. Trainable modules run eagerly (backward updates the tables in place).

    Args:
        tables: the EmbeddingBagConfigs (FP32, FP16 or BF16; SUM or MEAN pooling).
        is_weighted: whether inputs carry per-id weights (as in TorchRec). With MEAN
            pooling a weighted bag is its weighted sum divided by the bag length
            (FBGEMM's semantics).
        device: None or "cpu" (tables are initialised with each config's init_fn,
            TorchRec's default uniform(-sqrt(1/N), sqrt(1/N)), then compressed), "cuda"
            (the same tables, compressed in host memory and placed on the GPU: the CUDA
            library decodes and pools the rows a batch touches; KJT in and KeyedTensor
            out on the device; see ibp_embed.torchrec.device), or "meta" (no storage:
            load weights with load_state_dict or load_compressed). Without a usable
            GPU, "cuda" raises ibp_embed.cuda.NoCudaDeviceError ("no CUDA device: ..."),
            unless ibp_embed.cuda emulates one (``IBP_CUDA_EMULATE=1``).
        cache_load_factor, cache_policy: on "cuda", an HBM cache of hot decoded rows in
            front of each table, holding this fraction of its rows (None or 0: none;
            TorchRec's name, as for fused_uvm_caching), evicting by "lru" or "lfu"
            (ibp_embed.cache.RowCache). Inference only: trainable tables are not cached.
        strict_features: raise FeatureKeyError for input keys no table reads (and for
            repeated keys); by default they are ignored, as TorchRec's EBC ignores them.
        dedup: deprecated and ignored (FutureWarning): libibp's lookup deduplicates a
            batch's ids by itself, choosing how from the batch.
        optimizer: None (default: inference, immutable CompressedTables) or an
            :class:`ibp_embed.optim.SparseOptimizer` (``SGD(lr)``, ``Adagrad(lr, eps)``,
            ``RowWiseAdagrad(lr, eps, weight_decay, weight_decay_mode)``): training mode. Every table is then an
            :class:`ibp_embed.store.UpdatableTable`, forward returns pooled
            outputs that require grad whenever grad mode is on, and backward applies the
            optimizer to the rows the batch touched, fused into backward like FBGEMM's
            TBE (EXACT_SGD / EXACT_ADAGRAD / EXACT_ROWWISE_ADAGRAD arithmetic, see
            ibp_embed.optim). The optimizer state (``momentum1``) is uncompressed,
            appears in state_dict as ``embedding_bags.<table>.<name>``, is written by
            save_compressed and is counted by :meth:`memory_stats`.
        repack_drift: trainable tables rebuild their masks once their stored rows grew
            by this fraction since the last (re)pack (None: never automatically).
        word_bits, clusters, threshold, sample_rows, seed, progress: codec options
            passed to :func:`ibp_embed.compress` whenever a table is (re)compressed.
    """

    # Python-side properties TorchScript must not compile (forward is scriptable).
    __jit_unused_properties__ = ["optimizer", "trainable", "compressed_nbytes", "raw_nbytes",
                                 "optimizer_state_nbytes"]

    def __init__(self, tables: List[EmbeddingBagConfig], is_weighted: bool = False,
                 device: Optional[torch.device] = None, *, strict_features: bool = False,
                 dedup: Optional[str] = None, optimizer: Optional[SparseOptimizer] = None,
                 repack_drift: Optional[float] = DEFAULT_REPACK_DRIFT,
                 cache_load_factor: Optional[float] = None, cache_policy: str = "lru",
                 _tables: Optional[Dict[str, CompressedTable]] = None,
                 **codec_options: Any) -> None:
        super().__init__()
        self._codec_options = check_codec_options(codec_options)
        check_cache_options(cache_load_factor, cache_policy)
        self._cache_options = {"cache_load_factor": cache_load_factor, "cache_policy": cache_policy}
        self._device = resolve_device(device)
        host = torch.device("cpu") if self._device.type == "cuda" else self._device
        self._trainable = False
        self._job_cache = JobCache()  # inference lookups' native jobs
        self._is_weighted = bool(is_weighted)
        self._strict_features = bool(strict_features)
        warn_if_dedup(dedup)
        self._embedding_bag_configs = tables
        self.embedding_bags: nn.ModuleDict = nn.ModuleDict()
        self._optimizer: Optional[SparseOptimizer] = None
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
                                  pooling_mode(config), None, self._codec_options, config.name, device=host)
            if self._device.type == "cuda":
                bag.place(self._device, **self._cache_options)
            self.embedding_bags[config.name] = bag
        if optimizer is not None:
            self.set_optimizer(optimizer, repack_drift)
        if _tables is not None:
            for config in tables:
                self.embedding_bags[config.name].set_table(_tables[config.name])
        self._feature_names: List[List[str]] = [list(c.feature_names) for c in tables]
        self._embedding_names: List[str] = [
            e for names_ in get_embedding_names_by_table(tables) for e in names_]
        self._lengths_per_embedding: List[int] = [
            c.embedding_dim for c in tables for _ in c.feature_names]
        self._init_slots()
        self._needed_list = list(dict.fromkeys(f for names_ in self._feature_names for f in names_))
        self._needed = set(self._needed_list)
        if _tables is None and self._device.type != "meta":
            self.reset_parameters()
        elif _tables is not None and self._device.type == "meta":
            self._device = torch.device("cpu")

    def _init_slots(self) -> None:
        """What the captured forward passes pooled_lookup_many for its slots (one a
        feature of a table)."""
        self._slot_features: List[str] = [f for names_ in self._feature_names for f in names_]
        self._distinct_slot_features = len(set(self._slot_features)) == len(self._slot_features)
        self._slot_what: List[str] = [f"IBPEmbeddingBagCollection: feature {f!r} of table {c.name!r}"
                                      for c, names_ in zip(self._embedding_bag_configs, self._feature_names)
                                      for f in names_]

    def __setstate__(self, state):
        super().__setstate__(state)
        if "_distinct_slot_features" not in self.__dict__:  # pickled by an earlier version
            self._init_slots()

    # ---- construction from other forms ----
    @classmethod
    def from_embedding_bag_collection(cls, ebc: EmbeddingBagCollection, *,
                                      strict_features: bool = False, dedup: Optional[str] = None,
                                      optimizer: Optional[SparseOptimizer] = None,
                                      repack_drift: Optional[float] = DEFAULT_REPACK_DRIFT,
                                      device: Optional[torch.device] = None,
                                      cache_load_factor: Optional[float] = None, cache_policy: str = "lru",
                                      **codec_options: Any) -> "IBPEmbeddingBagCollection":
        """Compress the tables of an existing (e.g. trained) EmbeddingBagCollection.
        With `optimizer`, the result is trainable (see the class docstring). device:
        where the module runs (default: "cuda" when the EBC's tables are on a GPU, else
        "cpu"); the compressed tables are in host memory either way."""
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
            if device is None and weight.device.type == "cuda":
                device = weight.device
        return cls(configs, is_weighted=ebc.is_weighted(), device=device or "cpu",
                   strict_features=strict_features, dedup=dedup, optimizer=optimizer,
                   repack_drift=repack_drift, cache_load_factor=cache_load_factor, cache_policy=cache_policy,
                   _tables=tables, **codec_options)

    def to_embedding_bag_collection(self, device=None) -> EmbeddingBagCollection:
        """A plain TorchRec EmbeddingBagCollection holding the decompressed tables
        (without optimizer state)."""
        configs = [dataclasses.replace(c, feature_names=list(c.feature_names))
                   for c in self._embedding_bag_configs]
        ebc = EmbeddingBagCollection(configs, is_weighted=self._is_weighted, device=device)
        ebc.load_state_dict({f"embedding_bags.{n}.weight": b.weight for n, b in self.embedding_bags.items()})
        return ebc

    # ---- training ----
    @property
    def optimizer(self) -> Optional[SparseOptimizer]:
        """The sparse optimizer applied in backward (None: inference module)."""
        return self._optimizer

    @property
    def trainable(self) -> bool:
        return self._optimizer is not None

    def set_optimizer(self, optimizer: SparseOptimizer,
                      repack_drift: Optional[float] = DEFAULT_REPACK_DRIFT) -> None:
        """Switch to training mode with `optimizer` (fresh optimizer state; the tables
        become UpdatableTables)."""
        if not isinstance(optimizer, SparseOptimizer):
            raise TypeError(f"optimizer must be an ibp_embed.optim.SparseOptimizer (SGD, RowWiseAdagrad), "
                            f"got {type(optimizer).__name__}")
        for bag in self.embedding_bags.values():
            bag.make_trainable(optimizer, repack_drift)
        self._optimizer = optimizer
        self._trainable = True

    def optimizer_state(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """table name -> {state name: tensor} (the live tensors, not copies)."""
        return {name: bag.optimizer_state for name, bag in self.embedding_bags.items()}

    def apply_sparse_update(self, jobs, b: int, grad_out: torch.Tensor) -> None:
        """Backward of a trainable forward: per table, the rows its features touched
        get their summed gradients (reduced on the GPU for a module on cuda) and one
        optimizer step (in libibp, on the host)."""
        def target(name):
            bag = self.embedding_bags[name]
            return bag.table, bag.optimizer_state, bag.mode

        apply_updates(jobs, b, grad_out, self._optimizer, lambda s: s.table_name, target,
                      on_device=self._device.type == "cuda")

    # ---- EmbeddingBagCollectionInterface ----
    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def device(self) -> torch.device:
        """Where lookups run and outputs live (tables are in host memory on "cuda" too)."""
        return self._device

    def _apply(self, fn, recurse=True):
        # .to("cuda") / .cuda() / .cpu(): the bags place or unplace their tables.
        here = self._device if self._device.type != "cuda" else cuda.storage_device(self._device)
        there = fn(torch.empty(0, device=here)).device
        if there != here and there.type == "cuda":
            for bag in self.embedding_bags.values():
                bag._cache_options = dict(self._cache_options)  # used when it places its table
        super()._apply(fn, recurse)
        if there != here:
            self._device = resolve_device(there)
        return self

    def cache_stats(self) -> Dict[str, dict]:
        """Table name -> its HBM RowCache's counters (hits, misses, hit_rate, ...), for
        the tables that have one (a module on cuda with cache_load_factor)."""
        return {name: bag.device_table.cache_stats() for name, bag in self.embedding_bags.items()
                if bag.device_table is not None and bag.device_table.cache is not None}

    def tables(self) -> Dict[str, Optional[Union[CompressedTable, UpdatableTable]]]:
        """Table name -> CompressedTable, or UpdatableTable when trainable (None while on
        the meta device)."""
        return {name: bag.table for name, bag in self.embedding_bags.items()}

    @property
    def compressed_nbytes(self) -> int:
        """Host bytes of the compressed tables (for UpdatableTables: the whole store,
        headroom, dead and free space included, plus the index and masks)."""
        return sum(b.table.nbytes for b in self.embedding_bags.values() if b.table is not None)

    @property
    def raw_nbytes(self) -> int:
        return sum(b.num_embeddings * b.embedding_dim * b.dtype.itemsize for b in self.embedding_bags.values())

    @property
    def optimizer_state_nbytes(self) -> int:
        """Bytes of the (uncompressed) optimizer state, 0 for an inference module."""
        return sum(b.optimizer_state_nbytes for b in self.embedding_bags.values())

    def memory_stats(self) -> Dict[str, int]:
        """Memory figures in bytes (see ibp_embed.store.memory_stats for the table
        figures: raw_bytes, compressed_bytes held now, packed_bytes, and for trainable
        tables live / slack / dead / free / index bytes), plus
        optimizer_state_bytes: the optimizer state (uncompressed);
        lookup_copy_bytes: decoded copies of small tables that lookups of few ids a
            row read (ibp_embed.packed_jobs), made by the first such lookup;
        cache_bytes, device_bytes (on cuda): device memory of the HBM row caches, and
            all the device memory the tables hold (caches, codebooks, offsets indexes);
        total_bytes: compressed_bytes + optimizer_state_bytes + lookup_copy_bytes;
        raw_total_bytes: raw_bytes + optimizer_state_bytes (the uncompressed model with
            the same optimizer state, for comparison)."""
        stats = memory_stats(b.table for b in self.embedding_bags.values() if b.table is not None)
        opt = self.optimizer_state_nbytes
        copies = sum(b.table.lookup_copy_nbytes for b in self.embedding_bags.values()
                     if isinstance(b.table, CompressedTable))
        stats.update(raw_bytes=self.raw_nbytes, optimizer_state_bytes=opt, lookup_copy_bytes=copies,
                     total_bytes=stats["compressed_bytes"] + opt + copies, raw_total_bytes=self.raw_nbytes + opt)
        if self._device.type == "cuda":
            placed = [b.device_table for b in self.embedding_bags.values() if b.device_table is not None]
            stats["cache_bytes"] = sum(d.cache_nbytes for d in placed)
            stats["device_bytes"] = sum(d.device_nbytes for d in placed)
        return stats

    def reset_parameters(self) -> None:
        """Re-initialise every table with its config's init_fn, then compress it (and
        reset the optimizer state when trainable)."""
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
            bag.reset_state()
            del w

    def _slots_for(self, keys) -> Tuple[List[Slot], List[int]]:
        """The slots and, for each, the position of its feature in `keys`."""
        pos = {k: i for i, k in enumerate(keys)}
        slots = self._slots()
        return slots, [pos[s.feature] for s in slots]

    def _slots(self) -> List[Slot]:
        slots = []
        for config, feats in zip(self._embedding_bag_configs, self._feature_names):
            bag = self.embedding_bags[config.name]
            for f in feats:
                slots.append(Slot(bag.table, bag.mode, bag.embedding_dim, bag.num_embeddings, f, config.name))
        return slots

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pool every feature of every table (EmbeddingBagCollection.forward's contract:
        input keys no table reads are ignored unless strict_features=True)."""
        features = maybe_td_to_kjt(features, None)
        if not torch.jit.is_scripting():
            if is_fx_tracing() and self._device.type == "cuda":
                raise RuntimeError("IBPEmbeddingBagCollection on cuda looks its tables up eagerly and cannot be "
                                   "traced: trace (or script, export) the module on the CPU")
            if not is_fx_tracing():
                self._check_features(features)
            if self._trainable or (self._device.type == "cpu" and not is_fx_tracing()
                                   and not torch.compiler.is_compiling() and not self._weights_need_grad(features)):
                return self._forward_eager(features)
        if not torch.jit.is_scripting() and self._device.type == "cuda":
            return self._forward_on_cuda(features)
        # Traced, compiled or scripted on the CPU: the whole collection in one operator (as
        # TorchRec's fused and inference EBCs run one TBE op), which fx, torch.compile,
        # export and TorchScript see as a node.
        masks: List[torch.Tensor] = []
        bitvals: List[torch.Tensor] = []
        block_base: List[torch.Tensor] = []
        rel: List[torch.Tensor] = []
        payload: List[torch.Tensor] = []
        metas: List[int] = []
        dtypes: List[int] = []
        modes: List[int] = []
        values = features.values()
        j = 0
        for i, bag in enumerate(self.embedding_bags.values()):
            for _ in self._feature_names[i]:
                bag.require_host_table(self._slot_what[j], values)
                masks.append(bag.masks)
                bitvals.append(bag.bitvals)
                block_base.append(bag.block_base)
                rel.append(bag.rel)
                payload.append(bag.payload)
                metas.extend(bag.meta)
                dtypes.append(bag.dtype_code)
                modes.append(bag.mode_code)
                j += 1
        weights: Optional[torch.Tensor] = None
        if self._is_weighted:
            weights = features.weights()
        pooled = torch.ops.ibp.pooled_lookup_many(
            masks, bitvals, block_base, rel, payload, metas, dtypes, values, features.offsets(), weights,
            features.stride(), key_count(features.keys()),
            key_positions(features.keys(), self._slot_features, self._distinct_slot_features), modes, self._slot_what)
        return KeyedTensor(keys=self._embedding_names, values=pooled, length_per_key=self._lengths_per_embedding)

    @torch.jit.unused
    def _weights_need_grad(self, features: KeyedJaggedTensor) -> bool:
        """Per-sample weights that autograd follows (e.g. learned position weights): the
        operator gives them their gradient, the eager jobs would drop it."""
        weights = features.weights_or_none() if self._is_weighted else None
        return weights is not None and weights.requires_grad and torch.is_grad_enabled()

    @torch.jit.unused
    def _forward_on_cuda(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Inference on cuda: each feature's DeviceTable (the CUDA library), eagerly."""
        warn_if_weights_need_grad(features.weights_or_none() if self._is_weighted else None,
                                  "IBPEmbeddingBagCollection")
        feature_dict = features.to_dict()
        pooled: List[torch.Tensor] = []
        for i, bag in enumerate(self.embedding_bags.values()):
            for f in self._feature_names[i]:
                jt = feature_dict[f]
                pooled.append(bag(jt.values(), jt.offsets(), jt.weights() if self._is_weighted else None, f))
        return KeyedTensor(keys=self._embedding_names, values=torch.cat(pooled, dim=1),
                           length_per_key=self._lengths_per_embedding)

    @torch.jit.unused
    def _check_features(self, features: KeyedJaggedTensor) -> None:
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"expected a KeyedJaggedTensor, got {type(features).__name__}")
        if features.variable_stride_per_key():
            raise NotImplementedError("IBPEmbeddingBagCollection: variable batch size per feature (VBE) is "
                                      "not supported")
        keys = tuple(features.keys())
        if keys != self.__dict__.get("_checked_keys"):  # the last keys that passed (4 us for 26 features)
            missing = [f for f in self._needed_list if f not in keys]
            if missing:
                raise FeatureKeyError(f"IBPEmbeddingBagCollection: input lacks feature(s) {missing}; it has "
                                      f"{list(keys)}")
            if self._strict_features:
                extra = [k for k in keys if k not in self._needed]
                if extra or len(set(keys)) != len(keys):
                    raise FeatureKeyError(f"IBPEmbeddingBagCollection (strict_features): input keys {list(keys)}; "
                                          f"the tables read exactly {self._needed_list}")
            self.__dict__["_checked_keys"] = keys
        if self._is_weighted and features.weights_or_none() is None:
            raise ValueError("IBPEmbeddingBagCollection is weighted (is_weighted=True) but the "
                             "KeyedJaggedTensor has no weights")

    @torch.jit.unused
    def _forward_eager(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Eager lookups on the host, outputs moved to the module's device: the batch's
        packed tables in one native call that writes every table's columns of the output
        in place (no per-feature outputs to concatenate); a trainable module's stores
        under grad mode, whose outputs take part in autograd and whose backward applies
        the sparse optimizer (not traceable)."""
        if not self._is_weighted and features.weights_or_none() is not None:  # ignored, as TorchRec's EBC does
            features = KeyedJaggedTensor(keys=features.keys(), values=features.values(), offsets=features.offsets(),
                                         stride=features.stride())
        who = "IBPEmbeddingBagCollection"
        # On cuda the host's outputs move to the device (meta inputs give meta outputs).
        out = cuda.storage_device(self._device) if self._device.type == "cuda" else torch.device("cpu")
        if self._trainable and torch.is_grad_enabled() and features.values().device.type != "meta":
            slots, key_index = self._slots_for(features.keys())
            jobs, b = lookup_jobs(features, slots, self._is_weighted, who, key_index)
            values = training_lookup(self, jobs, b, who, out)
        else:
            tables = tuple(bag.table for bag in self.embedding_bags.values())
            values = self._job_cache.lookup(features, tables, self._slots_for, self._is_weighted, who)
            if self._device.type == "cuda":
                values = values.to(out)
        return KeyedTensor(keys=self._embedding_names, values=values, length_per_key=self._lengths_per_embedding)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Check every table's entries before any is re-compressed, so a bad checkpoint
        # leaves the module as it was.
        for name, bag in self.embedding_bags.items():
            key = f"{prefix}embedding_bags.{name}.weight"
            if key in state_dict:
                bag.check_weight(key, state_dict[key])
            for k in bag.optimizer_state:
                skey = f"{prefix}embedding_bags.{name}.{k}"
                if skey in state_dict:
                    bag.check_state_tensor(k, state_dict[skey])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    # ---- compressed checkpoints ----
    def save_compressed(self, path) -> None:
        """Write one .ibp per table and manifest.json into directory `path`, atomically
        (see ibp_embed.torchrec.checkpoint)."""
        from .checkpoint import save_compressed

        save_compressed(self, path)

    @classmethod
    def load_compressed(cls, path, *, mmap: bool = False, verify: bool = True,
                        strict_features: bool = False, dedup: Optional[str] = None,
                        optimizer: Optional[SparseOptimizer] = None,
                        repack_drift: Optional[float] = DEFAULT_REPACK_DRIFT,
                        device: Optional[torch.device] = None, cache_load_factor: Optional[float] = None,
                        cache_policy: str = "lru", **codec_options: Any) -> "IBPEmbeddingBagCollection":
        """Open a directory written by save_compressed. mmap=True maps the .ibp files
        (inference only: a trainable module copies its tables into updatable stores); on
        device="cuda" the GPU then reads the mapped rows in place where the driver can
        register them (else from a pinned copy).

        optimizer: None gives an inference module. optimizer="saved" (or an optimizer
        of the same kind as the one the checkpoint names) gives a trainable module whose
        optimizer state is restored from the checkpoint; "saved" also restores the saved
        hyper-parameters. A checkpoint without optimizer state starts from fresh state.
        Asking for another kind of optimizer than the checkpoint's raises ValueError.
        """
        from .checkpoint import read_compressed

        configs, tables, states, manifest, optimizer = read_compressed(path, optimizer, mmap=mmap, verify=verify)
        opts = dict(manifest.get("codec_options") or {})
        opts.update(codec_options)
        module = cls(configs, is_weighted=bool(manifest["is_weighted"]),
                     device=device or "cpu", strict_features=strict_features, dedup=dedup,
                     optimizer=optimizer, repack_drift=repack_drift, cache_load_factor=cache_load_factor,
                     cache_policy=cache_policy, _tables=tables, **check_codec_options(opts))
        for name, st in states.items():
            bag = module.embedding_bags[name]
            for k, v in st.items():
                try:
                    bag.load_state_tensor(k, torch.from_numpy(v))
                except RuntimeError as err:
                    raise ValueError(f"{path}: {err}") from None
        return module

    def extra_repr(self) -> str:
        opt = f", optimizer={self._optimizer!r}" if self.trainable else ""
        return f"is_weighted={self._is_weighted}, device={self._device}{opt}"
