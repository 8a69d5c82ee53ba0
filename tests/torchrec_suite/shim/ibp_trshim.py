"""Run TorchRec's own unit tests with ibp_embed substituted (their assertions untouched).

install_aliases()      - import aliases so the test files of the pytorch/torchrec repository
                         (stored copy ~1.4.0a0) import against the installed torchrec 1.8.0.
patch_test_module(m)   - in one imported test module's namespace, replace the name
                         ``EmbeddingBagCollection`` (and ``torchrec.EmbeddingBagCollection``
                         if the module does ``import torchrec``) by IBPTestEBC.
install_dmp()          - for DistributedModelParallel tests: the sharders TorchRec's test
                         helpers build for EBCs become IBP sharders planned on
                         ``customized_kernel``; the stock planner gets ibp_estimators.

IBP_TRSHIM=1 (conftest.py / sitecustomize.py) substitutes; IBP_TRSHIM=0 runs stock TorchRec.
"""
import os
import sys
import types
import unittest
from typing import List


# ---------------------------------------------------------------------------
# Import aliases (test files from the stored torchrec mirror vs the 1.8.0 wheel)
# ---------------------------------------------------------------------------

def install_aliases() -> None:
    # torchrec.distributed.test_utils.test_sharding (in the wheel) imports
    # torchrec.distributed.tests.test_sequence_model, which the wheel lacks: serve the
    # mirror's copy (shim/trtests_compat/test_sequence_model.py).
    if "torchrec.distributed.tests" not in sys.modules:
        try:
            import torchrec.distributed.tests  # noqa: F401
        except ImportError:
            import trtests_compat
            import trtests_compat.test_sequence_model as tsm

            sys.modules["torchrec.distributed.tests"] = trtests_compat
            sys.modules["torchrec.distributed.tests.test_sequence_model"] = tsm

    import torchrec.distributed.test_utils.model_input as model_input

    # torchrec.distributed.test_utils.test_input was renamed model_input
    sys.modules.setdefault("torchrec.distributed.test_utils.test_input", model_input)

    # torchrec.ir is not in the 1.8.0 wheel: stubs whose use skips the test.
    if "torchrec.ir" not in sys.modules:
        try:
            import torchrec.ir  # noqa: F401
        except ImportError:
            def _absent(*_a, **_k):
                raise unittest.SkipTest("torchrec.ir is absent from the installed torchrec 1.8.0 wheel")

            class JsonSerializer:  # noqa: D401 - stub
                def __init__(self, *a, **k):
                    _absent()

                def __getattr__(self, name):
                    _absent()

            ir = types.ModuleType("torchrec.ir")
            ser = types.ModuleType("torchrec.ir.serializer")
            utils = types.ModuleType("torchrec.ir.utils")
            ser.JsonSerializer = JsonSerializer
            utils.encapsulate_ir_modules = _absent
            utils.decapsulate_ir_modules = _absent
            ir.serializer, ir.utils = ser, utils
            sys.modules.update({"torchrec.ir": ir, "torchrec.ir.serializer": ser, "torchrec.ir.utils": utils})


# ---------------------------------------------------------------------------
# The module substitution
# ---------------------------------------------------------------------------

import inspect  # noqa: E402

import torch  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection as _TorchRecEBC  # noqa: E402

from ibp_embed.torchrec import IBPEmbeddingBagCollection  # noqa: E402
from ibp_embed.torchrec.lookup import compress_weight, table_dtype  # noqa: E402

_IBP_INIT_PARAMS = inspect.signature(IBPEmbeddingBagCollection.__init__).parameters


class IBPTestEBC(IBPEmbeddingBagCollection):
    """IBPEmbeddingBagCollection built the way the tests build a TorchRec EBC.

    Unless the weights are given (_tables) it first builds torchrec's
    EmbeddingBagCollection with the same (tables, is_weighted, device) - so the torch
    RNG is consumed exactly as the test expects and the weights equal those a seeded
    test computes with TorchRec - then compresses those weights (what
    from_embedding_bag_collection does). When that EBC lands on the meta device
    (device="meta" or a ``with torch.device("meta")`` block) IBPEmbeddingBagCollection
    is built directly with the test's own arguments (its native behaviour).
    Other keyword arguments go to IBPEmbeddingBagCollection unchanged; its signature
    is what inspect.signature(IBPTestEBC.__init__) reports (for the schema test).
    """

    constructed = 0  # instances built so far (conftest reports which tests built one)

    def __init__(self, tables, is_weighted=False, device=None, **kwargs):
        type(self).constructed += 1
        if kwargs.get("_tables") is None:
            ref = _TorchRecEBC(tables=tables, is_weighted=is_weighted, device=device)
            weights = {c.name: ref.embedding_bags[c.name].weight for c in tables}
            if all(w.device.type != "meta" for w in weights.values()):
                codec = {k: v for k, v in kwargs.items() if k not in _IBP_INIT_PARAMS}
                kwargs["_tables"] = {c.name: compress_weight(weights[c.name], table_dtype(c), codec)
                                     for c in tables}
            del ref
        super().__init__(tables, is_weighted, device, **kwargs)


IBPTestEBC.__init__.__signature__ = inspect.signature(IBPEmbeddingBagCollection.__init__)


def _torchrec_proxy(pkg: types.ModuleType) -> types.ModuleType:
    """A stand-in for the ``torchrec`` package inside one test module: the same
    attributes, except EmbeddingBagCollection (the real package stays untouched)."""
    proxy = types.ModuleType("torchrec")
    proxy.__dict__.update({k: v for k, v in vars(pkg).items() if not k.startswith("__")})
    proxy.__path__ = pkg.__path__  # type: ignore[attr-defined]
    proxy.EmbeddingBagCollection = IBPTestEBC
    return proxy


def patch_test_module(mod: types.ModuleType) -> List[str]:
    """Substitute IBPTestEBC for EmbeddingBagCollection in `mod`'s globals only."""
    done = []
    if getattr(mod, "EmbeddingBagCollection", None) is _TorchRecEBC:
        mod.EmbeddingBagCollection = IBPTestEBC
        done.append("EmbeddingBagCollection")
    import torchrec

    if getattr(mod, "torchrec", None) is torchrec:
        mod.torchrec = _torchrec_proxy(torchrec)
        done.append("torchrec.EmbeddingBagCollection")
    return done


# ---------------------------------------------------------------------------
# DMP tests: IBP sharder on customized_kernel + a planner that can cost it
# ---------------------------------------------------------------------------

def install_dmp() -> None:
    """Patch TorchRec's DMP test helpers (in every process: call it from sitecustomize
    so forkserver/spawn children get it too)."""
    import torchrec.distributed.model_parallel as mp
    import torchrec.distributed.sharding_plan as sp
    import torchrec.distributed.test_utils.test_model_parallel as tmp
    import torchrec.distributed.test_utils.test_model_parallel_base as tmpb
    import torchrec.distributed.test_utils.test_sharding as ts
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.test_utils.test_sharding import SharderType

    from ibp_embed.torchrec import IBP_COMPUTE_KERNEL, IBPEmbeddingBagCollectionSharder, ibp_estimators

    if getattr(ts, "_ibp_trshim", False):
        return

    class IBPTestEBCSharder(IBPEmbeddingBagCollectionSharder):
        """TorchRec's TestEBCSharder (one sharding type, one kernel) on the IBP kernel."""

        def __init__(self, sharding_type: str, kernel_type: str = IBP_COMPUTE_KERNEL, fused_params=None,
                     qcomm_codecs_registry=None) -> None:
            self._sharding_type, self._kernel_type = sharding_type, kernel_type
            super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)

        def sharding_types(self, compute_device_type: str) -> List[str]:
            return [self._sharding_type]

        def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
            return [self._kernel_type]

    class IBPOnlyEBCSharder(IBPEmbeddingBagCollectionSharder):
        """For get_default_sharders(): every table of every EBC on the IBP kernel."""

        def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
            ks = super().compute_kernels(sharding_type, compute_device_type)
            return [k for k in ks if k == IBP_COMPUTE_KERNEL]

        def sharding_types(self, compute_device_type: str) -> List[str]:
            return [t for t in super().sharding_types(compute_device_type)
                    if self.compute_kernels(t, compute_device_type)]

    # Picklable by reference (multi-process tests pickle sharders into the children).
    for cls in (IBPTestEBCSharder, IBPOnlyEBCSharder):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
        globals()[cls.__name__] = cls

    orig_create = ts.create_test_sharder

    def create_test_sharder(sharder_type, sharding_type, kernel_type, fused_params=None, qcomms_config=None,
                            device=None):
        if sharder_type == SharderType.EMBEDDING_BAG_COLLECTION.value and \
                kernel_type in (EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.FUSED_UVM.value,
                                EmbeddingComputeKernel.FUSED_UVM_CACHING.value):
            s = orig_create(sharder_type, sharding_type, kernel_type, fused_params, qcomms_config, device)
            return IBPTestEBCSharder(sharding_type, IBP_COMPUTE_KERNEL, s.fused_params, s.qcomm_codecs_registry)
        # DENSE (data-parallel) and other module types: TorchRec's own sharder
        return orig_create(sharder_type, sharding_type, kernel_type, fused_params, qcomms_config, device)

    orig_defaults = sp.get_default_sharders

    def get_default_sharders():
        return [IBPOnlyEBCSharder() if type(s) is EmbeddingBagCollectionSharder else s for s in orig_defaults()]

    class IBPAwarePlanner(EmbeddingShardingPlanner):
        """The stock planner; its default enumerator gets estimators that cost customized_kernel."""

        def __init__(self, topology=None, batch_size=None, enumerator=None, constraints=None, **kwargs):
            if enumerator is None and topology is not None:
                from torchrec.distributed.planner.constants import BATCH_SIZE

                enumerator = EmbeddingEnumerator(topology=topology, batch_size=batch_size or BATCH_SIZE,
                                                 constraints=constraints,
                                                 estimator=ibp_estimators(topology, constraints))
            super().__init__(topology=topology, batch_size=batch_size, enumerator=enumerator,
                             constraints=constraints, **kwargs)

    IBPAwarePlanner.__module__, IBPAwarePlanner.__qualname__ = __name__, "IBPAwarePlanner"
    globals()["IBPAwarePlanner"] = IBPAwarePlanner

    for m in (ts, tmp, tmpb):
        if hasattr(m, "create_test_sharder"):
            m.create_test_sharder = create_test_sharder
    for m in (sp, mp, tmpb, tmp, ts):
        if hasattr(m, "get_default_sharders"):
            m.get_default_sharders = get_default_sharders
    for m in (mp, tmpb, tmp, ts):
        if hasattr(m, "EmbeddingShardingPlanner"):
            m.EmbeddingShardingPlanner = IBPAwarePlanner
    ts._ibp_trshim = True

