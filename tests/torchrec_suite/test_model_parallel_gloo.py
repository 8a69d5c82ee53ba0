# torchrec/distributed/tests/test_model_parallel_gloo.py adapted to the 1.8.0 wheel's
# base classes (they read a `backend` class attribute; ModelParallelBase is now
# _ModelParallelBase). The test bodies live in the installed wheel
# (torchrec/distributed/test_utils/test_model_parallel{,_base}.py). The bases are
# imported as modules so that pytest does not collect them a second time.
from torchrec.distributed.test_utils import test_model_parallel as _mp, test_model_parallel_base as _mpb


class ModelParallelTestGloo(_mp._ModelParallelBase):
    backend = "gloo"


class ModelParallelStateDictTestGloo(_mpb.ModelParallelStateDictBase):
    backend = "gloo"


class ModelParallelSparseOnlyTestGloo(_mpb.ModelParallelSparseOnlyBase):
    backend = "gloo"
