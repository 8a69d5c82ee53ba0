"""Sparse optimizers applied to compressed rows in backward (FBGEMM's fused TBE definitions).

Backward of a pooled lookup gives every touched row the sum of its occurrences'
output gradients (scaled by the per-sample weight, or 1/L for MEAN bags); one
optimizer step then updates the row and it is re-encoded, as FBGEMM's fused TBE
optimizers do inside backward. Everything runs in libibp (``ibp_store_backward``,
``native/ibp_optim.inc``), which reproduces fbgemm-gpu 1.8's CPU arithmetic for
fp32 tables operation by operation, so the same inputs give bit-identical rows and
state (tests/test_training.py runs both side by side):

* :class:`SGD` - ``EXACT_SGD``: ``w -= lr * g``.
* :class:`Adagrad` - ``EXACT_ADAGRAD``: ``m += g * g``; ``w -= lr * g / (sqrt(m) + eps)``,
  state ``momentum1`` of one fp32 per element.
* :class:`RowWiseAdagrad` - ``EXACT_ROWWISE_ADAGRAD``: ``m += mean(g^2)``;
  ``w -= lr / (sqrt(m) + eps) * g``, state ``momentum1`` of one fp32 per row;
  optional weight decay (``"l2"``: ``g += wd * w``; ``"decouple"``: ``w *= 1 - lr * wd``),
  as FBGEMM's kernels define it.

Differences from FBGEMM's CPU kernels, both where FBGEMM's own paths disagree:
fbgemm-gpu 1.8's CPU fast path for row-wise Adagrad (fp32 tables read by one
feature) ignores weight decay, which its generic path and GPU kernels apply; here
every table applies it. And its CPU backward drops the 1/L of MEAN pooling when
the input has per-sample weights; here a weighted MEAN bag passes w/L, the
gradient of what the forward computes.

The optimizer state is plain fp32, owned by the caller (``init_state``), so it can
be checkpointed with the table.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ._native import ffi, lib

WEIGHT_DECAY_MODES = {"none": 0, "l2": 1, "decouple": 2}


class SparseOptimizer:
    """Base class: hyper-parameters and the shape of the per-table state."""

    name = "base"
    kind = -1

    def __init__(self, lr: float):
        if not lr >= 0.0:
            raise ValueError(f"learning rate must be >= 0, not {lr}")
        self.lr = float(lr)

    def state_shapes(self, n_rows: int, dim: int) -> dict[str, tuple]:
        """The shape of each state tensor for a table of n_rows x dim (float32)."""
        return {}

    def init_state(self, n_rows: int, dim: int) -> dict[str, torch.Tensor]:
        """Fresh optimizer state for a table of n_rows x dim."""
        return {name: torch.zeros(shape, dtype=torch.float32) for name, shape in self.state_shapes(n_rows, dim).items()}

    def params(self) -> dict:
        """Hyper-parameters (for checkpoints, comparisons and make_optimizer)."""
        return {"lr": self.lr}

    def check_state(self, state: Mapping, n_rows: int, dim: int) -> None:
        """Raises unless `state` holds state_shapes(n_rows, dim)'s tensors: libibp reads and
        writes them in place, as contiguous float32 on the CPU of exactly those shapes."""
        shapes = self.state_shapes(n_rows, dim)
        if shapes and not isinstance(state, Mapping):
            raise TypeError(f"{self.name} state must be a mapping of init_state's tensors, got {type(state).__name__}")
        for name, want in shapes.items():
            x = state.get(name)
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{self.name} needs its state {name!r} (init_state's), got {type(x).__name__}")
            if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
                raise TypeError(f"{self.name} state {name!r} must be a contiguous float32 CPU tensor, got "
                                f"{x.dtype} on {x.device}{'' if x.is_contiguous() else ', not contiguous'}")
            if tuple(x.shape) != want:
                raise ValueError(f"{self.name} state {name!r} must be of shape {want} for a table of "
                                 f"{n_rows} x {dim}, got {tuple(x.shape)}")

    def c_struct(self, state: dict[str, torch.Tensor]):
        """The ibp_sparse_optim libibp applies (state checked by check_state); state
        tensors must stay alive meanwhile."""
        o = ffi.new("ibp_sparse_optim *")
        o.kind = self.kind
        o.learning_rate = self.lr
        m = state.get("momentum1")
        o.momentum1 = ffi.NULL if m is None else ffi.cast("float *", m.data_ptr())
        return o

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.params() == self.params()

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.params().items()))))


class SGD(SparseOptimizer):
    """w <- w - lr * g (FBGEMM EXACT_SGD). No state."""

    name = "sgd"
    kind = lib.IBP_OPT_SGD


class Adagrad(SparseOptimizer):
    """FBGEMM EXACT_ADAGRAD: per element m += g^2; w <- w - lr * g / (sqrt(m) + eps).
    State: momentum1 [N, D] fp32."""

    name = "adagrad"
    kind = lib.IBP_OPT_ADAGRAD

    def __init__(self, lr: float, eps: float = 1e-8):
        super().__init__(lr)
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, not {eps}")
        self.eps = float(eps)

    def params(self) -> dict:
        return {"lr": self.lr, "eps": self.eps}

    def state_shapes(self, n_rows: int, dim: int) -> dict[str, tuple]:
        return {"momentum1": (n_rows, dim)}

    def c_struct(self, state):
        o = super().c_struct(state)
        o.eps = self.eps
        return o


class RowWiseAdagrad(Adagrad):
    """FBGEMM EXACT_ROWWISE_ADAGRAD: per row m += mean(g^2);
    w <- w - lr / (sqrt(m) + eps) * g. State: momentum1 [N] fp32.

    weight_decay_mode: "none" (default), "l2" (g += weight_decay * w) or "decouple"
    (w *= 1 - lr * weight_decay), FBGEMM's WeightDecayMode.L2 / DECOUPLE."""

    name = "rowwise_adagrad"
    kind = lib.IBP_OPT_ROWWISE_ADAGRAD

    def __init__(self, lr: float, eps: float = 1e-8, weight_decay: float = 0.0,
                 weight_decay_mode: str = "none"):
        super().__init__(lr, eps)
        if weight_decay_mode not in WEIGHT_DECAY_MODES:
            raise ValueError(f"weight_decay_mode must be one of {list(WEIGHT_DECAY_MODES)}, "
                             f"not {weight_decay_mode!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, not {weight_decay}")
        self.weight_decay = float(weight_decay)
        self.weight_decay_mode = weight_decay_mode if weight_decay else "none"

    def params(self) -> dict:
        p = {"lr": self.lr, "eps": self.eps}
        if self.weight_decay_mode != "none":
            p.update(weight_decay=self.weight_decay, weight_decay_mode=self.weight_decay_mode)
        return p

    def state_shapes(self, n_rows: int, dim: int) -> dict[str, tuple]:
        return {"momentum1": (n_rows,)}

    def c_struct(self, state):
        o = super().c_struct(state)
        o.weight_decay = self.weight_decay
        o.weight_decay_mode = WEIGHT_DECAY_MODES[self.weight_decay_mode]
        return o


OPTIMIZERS = {cls.name: cls for cls in (SGD, Adagrad, RowWiseAdagrad)}


def make_optimizer(name: str, **params) -> SparseOptimizer:
    """An optimizer from its name ('sgd', 'adagrad', 'rowwise_adagrad') and params()."""
    cls = OPTIMIZERS.get(name)
    if cls is None:
        raise ValueError(f"unknown sparse optimizer {name!r}; expected one of {list(OPTIMIZERS)}")
    return cls(**params)


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
