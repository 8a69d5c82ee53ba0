"""TorchRec backend: IBP-compressed EmbeddingBagCollection and a sharding-plan option.

* :class:`IBPEmbeddingBagCollection` - a drop-in EmbeddingBagCollection whose tables
  are IBP-compressed in host memory (CPU lookups in the native library).
* :class:`IBPEmbeddingBagCollectionSharder` + :func:`ibp_constraints` +
  :func:`ibp_planner` - keep a plain TorchRec EmbeddingBagCollection and put chosen
  tables on IBP storage under DistributedModelParallel (``customized_kernel``), next to
  tables on TorchRec's own kernels; they train with the plan's fused optimizer.
"""
from .distributed import (
    IBP_COMPUTE_KERNEL,
    IBP_SHARDING_TYPES,
    IBPEmbeddingBagCollectionSharder,
    IBPGroupedPooledEmbeddingsLookup,
    IBPShardedEmbeddingBagCollection,
)
from .fused_optimizer import IBPFusedOptimizer, optimizer_from_fused_params
from .kernel import IBPBatchedEmbeddingBag
from .lookup import FeatureKeyError
from .modules import IBPEmbeddingBag, IBPEmbeddingBagCollection
from .planner import (
    IBPPerfEstimatorConfig,
    IBPStorageEstimator,
    ibp_constraints,
    ibp_estimators,
    ibp_planner,
)

__all__ = [
    "IBPEmbeddingBagCollection",
    "IBPEmbeddingBag",
    "FeatureKeyError",
    "IBP_COMPUTE_KERNEL",
    "IBP_SHARDING_TYPES",
    "IBPBatchedEmbeddingBag",
    "IBPFusedOptimizer",
    "IBPEmbeddingBagCollectionSharder",
    "IBPGroupedPooledEmbeddingsLookup",
    "IBPPerfEstimatorConfig",
    "IBPShardedEmbeddingBagCollection",
    "IBPStorageEstimator",
    "ibp_constraints",
    "ibp_estimators",
    "ibp_planner",
    "optimizer_from_fused_params",
]
