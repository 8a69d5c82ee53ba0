"""Sparse optimizers that update compressed rows in place (FBGEMM's definitions).

Backward of a pooled lookup gives each touched row the sum of its occurrences'
output gradients (scaled by per-sample weights, and by 1/bag size for MEAN).
An optimizer step then decodes the touched rows, updates them in fp32 and
re-encodes them into the UpdatableTable, as FBGEMM's fused TBE optimizers do
inside backward. Optimizer state is plain fp32 and counted by `state_nbytes`.
"""
from __future__ import annotations

import torch

from .store import UpdatableTable


def row_gradients(indices: torch.Tensor, offsets: torch.Tensor, grad_out: torch.Tensor,
                  per_sample_weights: torch.Tensor | None = None, mode: str = "sum"):
    """(distinct row ids, their summed gradients [n, D] fp32) for a pooled lookup
    whose output gradient is grad_out [B, D]; offsets has B + 1 entries."""
    lengths = offsets[1:] - offsets[:-1]
    bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    g = grad_out.float()[bag]
    if per_sample_weights is not None:
        g = g * per_sample_weights.float()[:, None]
    if mode == "mean":
        g = g / lengths.clamp(min=1).float()[bag][:, None]
    ids, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    grads = torch.zeros(ids.numel(), grad_out.shape[1], dtype=torch.float32)
    grads.index_add_(0, inverse, g)
    return ids, grads


class SparseOptimizer:
    """Base class. The caller owns the per-table state (`init_state`) so it can be
    checkpointed with the table; `step` updates rows `ids` of `table` in place."""

    def __init__(self, lr: float):
        if not lr >= 0.0:
            raise ValueError(f"learning rate must be >= 0, not {lr}")
        self.lr = float(lr)

    def init_state(self, n_rows: int) -> dict[str, torch.Tensor]:
        return {}

    def step(self, table: UpdatableTable, state: dict[str, torch.Tensor], ids: torch.Tensor,
             grads: torch.Tensor) -> None:
        if ids.numel() == 0:
            return
        rows = self._apply(state, ids, table.gather(ids).float(), grads.float())
        table.update(ids, rows.to(table.dtype))

    def _apply(self, state, ids, rows, grads) -> torch.Tensor:
        raise NotImplementedError


class SGD(SparseOptimizer):
    """w <- w - lr * g (FBGEMM EXACT_SGD)."""

    def _apply(self, state, ids, rows, grads):
        return rows - self.lr * grads


class RowWiseAdagrad(SparseOptimizer):
    """FBGEMM EXACT_ROWWISE_ADAGRAD: per row, m += mean(g^2); w <- w - lr * g / (sqrt(m) + eps)."""

    def __init__(self, lr: float, eps: float = 1e-8):
        super().__init__(lr)
        self.eps = float(eps)

    def init_state(self, n_rows: int) -> dict[str, torch.Tensor]:
        return {"momentum1": torch.zeros(n_rows, dtype=torch.float32)}

    def _apply(self, state, ids, rows, grads):
        m = state["momentum1"]
        new = m[ids] + (grads * grads).mean(dim=1)
        m[ids] = new
        return rows - (self.lr / (new.sqrt() + self.eps))[:, None] * grads


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
