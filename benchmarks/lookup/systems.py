"""The systems timed: FBGEMM's TBE, TorchRec's fused EBC, the IBP collection, and torch's reference."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .workloads import Batch


def fbgemm_precision(dtype: torch.dtype):
    """SparseType for FBGEMM's CPU kernel, or None where it has none (bf16 in FBGEMM 1.8)."""
    from fbgemm_gpu.split_embedding_configs import SparseType

    return {torch.float32: SparseType.FP32, torch.float16: SparseType.FP16}.get(dtype)


def build_tbe(rows, dims, dtype):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(n, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for n, d in zip(rows, dims)],
        optimizer=EmbOptimType.EXACT_SGD, pooling_mode=PoolingMode.SUM,
        weights_precision=fbgemm_precision(dtype), output_dtype=SparseType.FP32, device=torch.device("cpu"))


def set_weights(ts) -> tuple:
    """(FBGEMM's TBE holding table set ts's weights, or None where FBGEMM has no kernel
    for its dtype; the weights: the TBE's own tensors, or plain ones)."""
    if fbgemm_precision(ts.dtype) is None:
        return None, [ts.weights(t).contiguous() for t in range(len(ts.rows))]
    tbe = build_tbe(ts.rows, ts.dims, ts.dtype)
    weights = tbe.split_embedding_weights()
    with torch.no_grad():
        for t, w in enumerate(weights):
            w.copy_(ts.weights(t))
    return tbe, weights


def torchrec_fused_ebc(tbe, dims):
    """TorchRec's FusedEmbeddingBagCollection whose forward runs on `tbe` (see module doc)."""
    from torchrec import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=d, num_embeddings=1, feature_names=[f"f{t}"])
               for t, d in enumerate(dims)]
    ebc = FusedEmbeddingBagCollection(configs, optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.01})
    assert len(ebc._emb_modules) == 1
    ebc._emb_modules[0]._emb_module = tbe
    return ebc


def ibp_ebc(tables, dims, dtype):
    from torchrec import EmbeddingBagConfig
    from torchrec.modules.embedding_configs import DataType

    from ibp_embed.torchrec import IBPEmbeddingBagCollection

    dt = {torch.float32: DataType.FP32, torch.float16: DataType.FP16, torch.bfloat16: DataType.BF16}[dtype]
    configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=d, num_embeddings=tab.shape[0],
                                  feature_names=[f"f{t}"], data_type=dt)
               for t, (d, tab) in enumerate(zip(dims, tables))]
    return IBPEmbeddingBagCollection(configs, _tables={f"t{t}": tab for t, tab in enumerate(tables)})



def reference_output(weights, batch: Batch) -> torch.Tensor:
    outs = []
    for w, (ids, off) in zip(weights, batch.features):
        ids_t = torch.from_numpy(ids)
        uniq, inv = torch.unique(ids_t, return_inverse=True)
        outs.append(F.embedding_bag(inv, w[uniq].float(), torch.from_numpy(off), mode="sum",
                                    include_last_offset=True))
    return torch.cat(outs, dim=1)
