"""Planner support for the IBP kernel: constraints, estimators and a stock planner.

The stock perf estimator has no bandwidth for ``customized_kernel`` and the stock
storage estimator counts raw bytes. :func:`ibp_estimators` returns the stock
estimators configured for it (IBPPerfEstimatorConfig: a bandwidth for the kernel;
IBPStorageEstimator: the shard's *compressed* size in host memory), and
:func:`ibp_planner` builds a stock ``EmbeddingShardingPlanner`` whose enumerator uses
them. DMP's own default planner (built when no ``plan=`` is given) uses the stock
estimators and so cannot cost the kernel: pass the plan.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torchrec.distributed.embedding_types import ShardingType
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator.config import EmbeddingPerfEstimatorConfig
from torchrec.distributed.planner.estimator.estimator import EmbeddingPerfEstimator
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import ParameterConstraints, ShardingOption, Storage
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from .distributed import IBP_COMPUTE_KERNEL, IBP_SHARDING_TYPES, is_ibp
from .._native import lib
from .device import cache_options
from .lookup import check_codec_options

__all__ = [
    "IBPPerfEstimatorConfig",
    "IBPStorageEstimator",
    "ibp_constraints",
    "ibp_estimators",
    "ibp_planner",
]

# Planner bandwidth of the IBP CPU kernel relative to DDR bandwidth (FBGEMM's fused CPU
# kernel is 1.0): benchmarks/lookup.py measured 0.27-0.66x FBGEMM HOST TBE lookup
# throughput (lookup-20261130T051943Z.json); the middle of that range.
DEFAULT_CPU_BANDWIDTH_FACTOR = 0.4
# On CUDA the uncached rows cross PCIe compressed: their effective bandwidth is the
# link's times the compression ratio (1.12-1.31 in benchmarks/codec.py; the low end),
# with the GPU's decode assumed to keep up (not yet measured on a GPU).
DEFAULT_CUDA_BANDWIDTH_FACTOR = 1.1


def ibp_constraints(tables: Iterable[Union[str, EmbeddingBagConfig]],
                    sharding_types: Sequence[str] = (ShardingType.TABLE_WISE.value,
                                                     ShardingType.COLUMN_WISE.value,
                                                     ShardingType.ROW_WISE.value),
                    **constraint_kwargs: Any) -> Dict[str, ParameterConstraints]:
    """ParameterConstraints that put `tables` (names or configs) on IBP storage.

    Each gets ``compute_kernels=["customized_kernel"]`` and the allowed sharding types
    (table_wise, column_wise and row_wise by default; table_column_wise and
    table_row_wise are also supported).
    Other ParameterConstraints fields (pooling_factors, ...) pass through. Merge the
    result with constraints for your other tables and give it to the planner.
    """
    bad = [s for s in sharding_types if s not in IBP_SHARDING_TYPES]
    if bad:
        raise ValueError(f"IBP tables support sharding types {list(IBP_SHARDING_TYPES)}, not {bad}")
    out = {}
    for t in tables:
        name = t.name if isinstance(t, EmbeddingBagConfig) else str(t)
        out[name] = ParameterConstraints(sharding_types=list(sharding_types),
                                         compute_kernels=[IBP_COMPUTE_KERNEL], **constraint_kwargs)
    return out


class IBPPerfEstimatorConfig(EmbeddingPerfEstimatorConfig):
    """TorchRec's default perf model plus a bandwidth for the IBP customized_kernel.

    On CPU the kernel is costed like FBGEMM's fused kernel at cpu_bandwidth_factor x
    the topology's DDR bandwidth. On CUDA, for inference, it is costed like
    fused_uvm_caching (or fused_uvm without a cache), its PCIe bandwidth times
    cuda_bandwidth_factor (the bytes saved by compression: set it to your tables'
    ratio): (c x HBM + (1 - c) x factor x HBM-to-DDR) / 10 for a cache of c =
    cache_load_factor of the rows (0 without one). Training on CUDA looks rows up on the
    host (see ibp_embed.torchrec.device), so it is costed as on CPU and uses no cache.
    Every other kernel is costed as by TorchRec.
    """

    def __init__(self, cpu_bandwidth_factor: float = DEFAULT_CPU_BANDWIDTH_FACTOR,
                 cuda_bandwidth_factor: float = DEFAULT_CUDA_BANDWIDTH_FACTOR,
                 is_inference: bool = False) -> None:
        super().__init__()
        if not cpu_bandwidth_factor > 0 or not cuda_bandwidth_factor > 0:
            raise ValueError("cpu_bandwidth_factor and cuda_bandwidth_factor must be positive")
        self.cpu_bandwidth_factor = float(cpu_bandwidth_factor)
        self.cuda_bandwidth_factor = float(cuda_bandwidth_factor)
        self.is_inference = bool(is_inference)

    def get_device_bw(self, compute_device, compute_kernel, hbm_mem_bw, ddr_mem_bw, ssd_mem_bw,
                      hbm_to_ddr_mem_bw, caching_ratio=None, prefetch_pipeline=False):
        if is_ibp(compute_kernel):
            device = compute_device.lower()
            if device == "cpu" or (device == "cuda" and not self.is_inference):
                return self.cpu_bandwidth_factor * ddr_mem_bw
            if device == "cuda":
                c = float(caching_ratio or 0.0)
                return (c * hbm_mem_bw + (1 - c) * self.cuda_bandwidth_factor * hbm_to_ddr_mem_bw) / 10
            raise ValueError(f"IBP customized_kernel has no {compute_device} implementation to cost")
        return super().get_device_bw(compute_device, compute_kernel, hbm_mem_bw, ddr_mem_bw, ssd_mem_bw,
                                     hbm_to_ddr_mem_bw, caching_ratio, prefetch_pipeline)


class IBPStorageEstimator(EmbeddingStorageEstimator):
    """TorchRec's storage estimator, with IBP shards counted at their compressed size.

    An IBP shard costs host memory (DDR) of raw_bytes / ratio plus, when training, its
    optimizer state (uncompressed, on the host, as TorchRec counts it). An inference
    shard on CUDA also costs HBM: its offsets index (ibp_embed.cuda places it on the
    device: rel_bytes + 1/8 a row) and its cache, cache_load_factor (from the plan's
    cache_params, else the sharder's fused_params) x the shard's decoded rows plus the
    cache's bookkeeping (ibp_embed.cache.RowCache: 4 bytes a row, 8 more with LFU, 24 a
    cached row). Training on CUDA places nothing on the device.
    The ratio of a table is, in order: compression_ratios[name]; measured by
    compressing a sample of up to sample_rows rows when the planned tensor holds values;
    default_ratio (1.0 when nothing is known: conservative).
    """

    def __init__(self, topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None,
                 compression_ratios: Optional[Dict[str, float]] = None, default_ratio: float = 1.0,
                 sample_rows: int = 8192, codec_options: Optional[Dict[str, Any]] = None,
                 **kwargs: Any) -> None:
        super().__init__(topology=topology, constraints=constraints, **kwargs)
        self._ratios = dict(compression_ratios or {})
        self._default_ratio = float(default_ratio)
        self._sample_rows = int(sample_rows)
        self._codec_options = check_codec_options(codec_options or {})
        self._measured: Dict[Tuple[str, str], float] = {}

    def ratio(self, sharding_option: ShardingOption) -> float:
        name = sharding_option.name
        if name in self._ratios:
            return float(self._ratios[name])
        key = (sharding_option.path, name)
        if key not in self._measured:
            self._measured[key] = self._measure(sharding_option.tensor)
        return self._measured[key]

    def _measure(self, tensor: torch.Tensor) -> float:
        if tensor.device.type == "meta" or tensor.numel() == 0 or \
                tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return self._default_ratio
        from ..codec import compress

        n = tensor.shape[0]
        if n > self._sample_rows:
            rows = np.sort(np.random.default_rng(0).choice(n, self._sample_rows, replace=False))
            sample = tensor.detach()[torch.from_numpy(rows)]
        else:
            sample = tensor.detach()
        opts = {k: v for k, v in self._codec_options.items() if k != "progress"}
        t = compress(sample.cpu().contiguous(), progress=False, **opts)
        return max(t.ratio, 1e-6)

    def estimate(self, sharding_options: List[ShardingOption], sharder_data_map=None) -> None:
        super().estimate(sharding_options, sharder_data_map)
        on_device = self._topology.compute_device == "cuda" and self._is_inference
        for so in sharding_options:
            if not is_ibp(so.compute_kernel):
                continue
            ratio = self.ratio(so)
            shape = so.tensor.shape
            tensor_bytes = so.tensor.numel() * so.tensor.element_size()
            try:
                from torchrec.distributed.planner.shard_estimators import _get_optimizer_multipler

                opt_mult = 0.0 if self._is_inference else _get_optimizer_multipler(
                    getattr(so.tensor, "_optimizer_classes", [None])[0], shape)
            except ImportError:  # pragma: no cover - private helper moved
                opt_mult = 0.0
            fused = getattr((sharder_data_map or {}).get(so.module_type_key), "fused_params", None) or {}
            clf, lfu = _cache_params(so, fused) if on_device else (0.0, False)
            for shard in so.shards:
                if shard.storage is None:
                    continue
                raw = math.ceil(tensor_bytes * math.prod(shard.size) / math.prod(shape))
                stock = raw + math.ceil(raw * opt_mult)
                host = math.ceil(raw / ratio) + math.ceil(raw * opt_mult)
                if self._topology.compute_device == "cpu":
                    ddr = max(shard.storage.ddr - stock, 0) + host
                    shard.storage = Storage(hbm=shard.storage.hbm, ddr=ddr, ssd=shard.storage.ssd)
                else:  # host memory, whatever the compute device; index and cache in HBM
                    rows = shard.size[0]
                    cached = int(clf * rows)
                    device = 0
                    if on_device:
                        device = math.ceil(rows * (lib.ibp_rel_bytes(shard.size[1] * so.tensor.element_size())
                                                   + 0.125))
                    if cached:
                        device += math.ceil(raw * cached / rows) + (12 if lfu else 4) * rows + 24 * cached
                    hbm = max(shard.storage.hbm - stock, 0) + device
                    shard.storage = Storage(hbm=hbm, ddr=shard.storage.ddr + host, ssd=shard.storage.ssd)



def _cache_params(so: ShardingOption, fused_params: Dict[str, Any]) -> Tuple[float, bool]:
    """(cache_load_factor, LFU?) of a sharding option: its cache_params, else the
    sharder's fused_params, as TorchRec reads them."""
    clf = so.cache_load_factor
    if clf is None:
        clf = fused_params.get("cache_load_factor")
    algo = so.cache_params.algorithm if so.cache_params and so.cache_params.algorithm is not None else \
        fused_params.get("cache_algorithm")
    options = cache_options(clf, algo)  # the kernel's own reading of them
    return float(clf or 0.0), options["cache_policy"] == "lfu"


def ibp_estimators(topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None, *,
                   compression_ratios: Optional[Dict[str, float]] = None, default_ratio: float = 1.0,
                   cpu_bandwidth_factor: float = DEFAULT_CPU_BANDWIDTH_FACTOR,
                   cuda_bandwidth_factor: float = DEFAULT_CUDA_BANDWIDTH_FACTOR, is_inference: bool = False,
                   codec_options: Optional[Dict[str, Any]] = None) -> list:
    """[perf, storage] estimators for EmbeddingEnumerator that can cost customized_kernel."""
    perf = EmbeddingPerfEstimator(topology=topology, constraints=constraints, is_inference=is_inference,
                                  config=IBPPerfEstimatorConfig(cpu_bandwidth_factor, cuda_bandwidth_factor,
                                                                is_inference))
    storage = IBPStorageEstimator(topology=topology, constraints=constraints, is_inference=is_inference,
                                  compression_ratios=compression_ratios, default_ratio=default_ratio,
                                  codec_options=codec_options)
    return [perf, storage]


def ibp_planner(topology: Topology, batch_size: int = BATCH_SIZE,
                constraints: Optional[Dict[str, ParameterConstraints]] = None, **estimator_kwargs: Any
                ) -> EmbeddingShardingPlanner:
    """A stock EmbeddingShardingPlanner whose enumerator can cost IBP tables (see ibp_estimators)."""
    enumerator = EmbeddingEnumerator(topology=topology, batch_size=batch_size, constraints=constraints,
                                     estimator=ibp_estimators(topology, constraints, **estimator_kwargs))
    return EmbeddingShardingPlanner(topology=topology, batch_size=batch_size, constraints=constraints,
                                    enumerator=enumerator)
