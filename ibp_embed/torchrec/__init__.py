"""TorchRec backend: IBP-compressed EmbeddingBagCollection and a sharding-plan option.

* :class:`IBPEmbeddingBagCollection` - a drop-in EmbeddingBagCollection whose tables
  are IBP-compressed in host memory (CPU lookups in the native library).
* :class:`IBPEmbeddingBagCollectionSharder` + :func:`ibp_constraints` +
  :func:`ibp_planner` - keep a plain TorchRec EmbeddingBagCollection and put chosen
  tables on IBP storage under DistributedModelParallel (``customized_kernel``), next to
  tables on TorchRec's own kernels.
"""
from .modules import FeatureKeyError, IBPEmbeddingBag, IBPEmbeddingBagCollection
from .distributed import (
    IBP_COMPUTE_KERNEL,
    IBP_SHARDING_TYPES,
    IBPBatchedEmbeddingBag,
    IBPEmbeddingBagCollectionSharder,
    IBPGroupedPooledEmbeddingsLookup,
    IBPPerfEstimatorConfig,
    IBPShardedEmbeddingBagCollection,
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
    "IBPEmbeddingBagCollectionSharder",
    "IBPGroupedPooledEmbeddingsLookup",
    "IBPPerfEstimatorConfig",
    "IBPShardedEmbeddingBagCollection",
    "IBPStorageEstimator",
    "ibp_constraints",
    "ibp_estimators",
    "ibp_planner",
]
