"""The systems timed: FBGEMM's TBE, TorchRec's fused EBC, the IBP collection, and torch's reference."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .workloads import Batch


def fbgemm_precision(dtype: torch.dtype):
    """SparseType for FBGEMM's CPU kernel, or None where it has none (bf16 in FBGEMM 1.8)."""
    from fbgemm_gpu.split_embedding_configs import SparseType

    return {torch.float32: SparseType.FP32, torch.float16: SparseType.FP16}.get(dtype)


def collapse_onto_huge_pages(t: torch.Tensor) -> bool:
    """hostmem.collapse of tensor t's memory."""
    from ibp_embed import hostmem

    return hostmem.collapse(t.data_ptr(), t.numel() * t.element_size())


def build_tbe(rows, dims, dtype, huge_pages: bool = True):
    """FBGEMM's TBE (HOST) of these tables. Its weights go onto huge pages where the
    system allows (huge_pages), as ibp_embed's payloads do (ibp_embed/hostmem.py): torch
    asks for none, and where its allocation reuses memory the process touched before, the
    TBE's pages, and so its lookups from memory, were 4 KiB or 2 MiB by chance
    (benchmarks.pages times both). A RuntimeWarning says where the kernel refused, and
    the TBE's `collapse_refused` (None where not asked) tells the results files."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(n, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for n, d in zip(rows, dims)],
        optimizer=EmbOptimType.EXACT_SGD, pooling_mode=PoolingMode.SUM,
        weights_precision=fbgemm_precision(dtype), output_dtype=SparseType.FP32, device=torch.device("cpu"))
    tbe.collapse_refused = None if not huge_pages else not collapse_onto_huge_pages(tbe.weights_host)
    if tbe.collapse_refused:
        warnings.warn("FBGEMM's TBE weights stay where torch put them (the kernel refused "
                      "madvise(MADV_COLLAPSE)): its lookups from memory may run on 4 KiB pages "
                      "while ibp_embed's payloads have huge pages", RuntimeWarning, stacklevel=2)
    return tbe


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


def torchrec_quant_ebc(weights, dtype):
    """TorchRec's inference EBC (torchrec.quant.EmbeddingBagCollection, whose forward is
    FBGEMM's inference TBE, IntNBitTableBatchedEmbeddingBagsCodegen) holding `weights`
    (table t: feature f<t>) as FP32 or FP16 rows, as stored: the module TorchRec serves
    with (quantize_inference_model's), made by from_float."""
    from torch.ao.quantization import PlaceholderObserver, QConfig
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.modules.embedding_configs import DataType
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

    data_type = {torch.float32: DataType.FP32, torch.float16: DataType.FP16}[dtype]
    configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=w.shape[1], num_embeddings=w.shape[0],
                                  feature_names=[f"f{t}"], data_type=data_type) for t, w in enumerate(weights)]
    ebc = EmbeddingBagCollection(configs)
    with torch.no_grad():
        for t, w in enumerate(weights):
            ebc.embedding_bags[f"t{t}"].weight.copy_(w)
    ebc.qconfig = QConfig(activation=PlaceholderObserver.with_args(dtype=torch.float),
                          weight=PlaceholderObserver.with_args(dtype=dtype))
    return QuantEmbeddingBagCollection.from_float(ebc)


def captured(module):
    """`module` as TorchRec models are served: torchrec.fx.symbolic_trace, then
    torch.jit.script of the graph."""
    import torchrec.fx

    return torch.jit.script(torchrec.fx.symbolic_trace(module))
