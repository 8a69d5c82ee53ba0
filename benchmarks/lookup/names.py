"""System names, variants and dtypes of the lookup benchmark, and which systems pair up."""
from __future__ import annotations

import torch

FBGEMM = "fbgemm TBE"
TORCHREC = "torchrec FusedEBC"
TORCH_RAW = "torch embedding_bag"
IBP_VARIANTS = ((64, 1), (32, 1), (64, 4), (32, 4))  # (word bits, clusters asked)
HEADLINE = "ibp lookup W64 K1"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_SHORT = {v: k for k, v in DTYPES.items()}
INIT_LABEL = {"torchrec": "torchrec init", "trained": "trained-like", "dir": "trained (dir)"}
BATCHED = "ibp lookup_many W64 K1"  # every feature in one native call, as the TBE's forward
COLLECTION = "ibp EBC W64 K1"  # the IBP collection paired with TorchRec's fused EBC
EBC_VARIANTS = ((64, 1), (64, 4))


def lookup_name(w, k):
    return f"ibp lookup W{w} K{k}"


def ebc_name(w, k):
    return f"ibp EBC W{w} K{k}"


def pair_of(system: str) -> str | None:
    """The FBGEMM-side system an ibp system is compared with."""
    if system.startswith("ibp lookup"):
        return FBGEMM
    if system.startswith("ibp EBC"):
        return TORCHREC
    return None
