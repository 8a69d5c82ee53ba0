"""TorchRec's multi-process sharding tests (test_model_parallel.py's test_sharding_tw /
_cw / _twcw, run through test_model_parallel_gloo.py) on their whole argument grid:
data type FP32 / FP16, quantized comms or not, apply_optimizer_in_backward or not,
variable batch size or not. Hypothesis samples a few of these per run; this runs all
48 every time. Not a TorchRec file: the arguments are fixed, the test bodies are theirs.
"""
import itertools

import pytest
import torch
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig
from torchrec.types import DataType

import test_model_parallel_gloo as gloo

QC = QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16)
AOIB = {"embedding_bags": (torch.optim.SGD, {"lr": 0.01}), "embeddings": (torch.optim.SGD, {"lr": 0.2})}
CASES = [(name, dt, qc, ao, vbs)
         for name in ("test_sharding_tw", "test_sharding_cw", "test_sharding_twcw")
         for dt, qc, ao, vbs in itertools.product([DataType.FP32, DataType.FP16], [None, QC], [None, AOIB],
                                                  [False, True])]


@pytest.mark.parametrize("name,dt,qc,ao,vbs", CASES,
                         ids=[f"{n[13:]}-{d.value}-qc{q is not None:d}-aoib{a is not None:d}-vbs{v:d}"
                              for n, d, q, a, v in CASES])
def test_case(name, dt, qc, ao, vbs):
    cls = gloo.ModelParallelTestGloo
    t = cls(name)
    cls.setUpClass()
    t.setUp()
    kw = dict(sharder_type="embedding_bag_collection", kernel_type="fused", qcomms_config=qc,
              apply_optimizer_in_backward_config=ao, variable_batch_size=vbs, data_type=dt)
    if name == "test_sharding_cw":
        kw["allow_zero_batch_size"] = False
    getattr(cls, name).hypothesis.inner_test(t, **kw)
