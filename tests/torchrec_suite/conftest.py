"""TorchRec's own unit tests (verbatim copies from the pytorch/torchrec repository, whose
wheel ships no tests) with IBPEmbeddingBagCollection and the IBP sharder substituted for
TorchRec's EmbeddingBagCollection and its sharder; their assertions are untouched.
See shim/ibp_trshim.py for the substitution and README.md ("TorchRec's own tests").

Run apart from tests/ (the substitution patches TorchRec's test helpers process-wide):
`make test` runs ``PYTHONPATH=tests/torchrec_suite/shim pytest -c tests/torchrec_suite/pytest.ini
tests/torchrec_suite``. IBP_TRSHIM=0 runs the same files on stock TorchRec.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim"))
import ibp_trshim  # noqa: E402

ibp_trshim.install_aliases()
SUBST = os.environ.get("IBP_TRSHIM", "1") == "1"
# read by shim/sitecustomize.py in the processes the multi-process tests start
os.environ["IBP_TRSHIM_ALIASES"] = "1"
os.environ["IBP_TRSHIM"] = "1" if SUBST else "0"
if SUBST:
    ibp_trshim.install_dmp()

# Tests that cannot apply to IBP tables, with the reason (README.md lists them too).
# strict: should one start passing, the run fails and the entry must go.
CANNOT_APPLY = {
    "test_model_parallel_gloo.py::ModelParallelSparseOnlyTestGloo::test_initialize_torch_state_error_includes_table_name":
        "it checks the error TorchRec's ShardedEmbeddingBagCollection._initialize_torch_state raises for a "
        "table's ShardedTensor; TorchRec skips that step for customized_kernel tables (any outside kernel)",
}


def pytest_collection_modifyitems(session, config, items):
    seen = set()
    for item in items:
        mod = getattr(item, "module", None)
        if SUBST and mod is not None and mod.__name__ not in seen:
            seen.add(mod.__name__)
            ibp_trshim.patch_test_module(mod)
        reason = CANNOT_APPLY.get(item.nodeid)
        if SUBST and reason:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
