"""Sparse optimizers that update compressed rows in place (FBGEMM's definitions).

Backward of a pooled lookup gives each touched row the sum of its occurrences'
output gradients (scaled by per-sample weights, and by 1/bag size for MEAN).
An optimizer step then decodes the touched rows, updates them in fp32 and
re-encodes them into the UpdatableTable, as FBGEMM's fused TBE optimizers do
inside backward. Optimizer state is plain fp32 and counted by `state_nbytes`.

Arithmetic follows FBGEMM's CPU TBE (fbgemm-gpu 1.8, fp32 tables) operation by
operation, so that the same inputs give bit-identical rows and state:

* row gradients: occurrences summed in input order, starting from zero (what the
  CPU backward's csr2csc + SpMDM kernel does for unweighted SUM pooling);
* EXACT_SGD: ``w - lr * g`` with the fp32 lr, evaluated in fp64 and rounded to fp32;
* EXACT_ROWWISE_ADAGRAD (fbgemm's JIT rowwise SparseAdaGrad): the squared
  gradient is summed in 8 fp32 lanes (lane l takes elements l, l+8, l+16, ...),
  the lanes are reduced pairwise ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)) and divided
  by D; ``m += that``; ``step = lr / (sqrt(m) + eps)`` with a correctly rounded
  sqrt and division; ``w - step * g``. (torch's own fp32 ``sqrt`` on AVX-512 is
  not correctly rounded and ``python_float / tensor`` is computed as
  ``reciprocal * lr``; both are avoided here.) A table read by several features
  goes through FBGEMM's generic kernel instead, which sums g^2 sequentially
  (``step(..., shared=True)``).

Verified bit for bit against the installed fbgemm-gpu-cpu 1.8.0 TBE (HOST): SUM,
MEAN and weighted SUM pooling, dims 4-128, shared tables, 200 steps
(tests/test_training.py).
"""
from __future__ import annotations

import torch

from .store import UpdatableTable

OPTIMIZERS = ("sgd", "rowwise_adagrad")


def row_gradients(indices: torch.Tensor, offsets: torch.Tensor, grad_out: torch.Tensor,
                  per_sample_weights: torch.Tensor | None = None, mode: str = "sum"):
    """(distinct row ids sorted, their summed gradients [n, D] fp32) for a pooled lookup
    whose output gradient is grad_out [B, D]; offsets has B + 1 entries.

    Each row's occurrences are accumulated in input order starting from zero, as
    FBGEMM's CPU backward does. Unweighted SUM adds the bag gradients (fp32 adds).
    Otherwise every occurrence has a scale (its per-sample weight; for MEAN the fp32
    value 1/L of its bag, times the weight if any) and is accumulated as FBGEMM's
    kernels do, with a fused multiply-add acc = fma(scale, g, acc) (emulated in fp64
    and rounded to fp32, which can differ from a true fma only when the fp64 result
    falls exactly on an fp32 rounding tie).
    """
    indices = torch.as_tensor(indices).reshape(-1).to(torch.int64)
    offsets = torch.as_tensor(offsets).reshape(-1).to(torch.int64)
    grad_out = grad_out.float()
    dim = grad_out.shape[1]
    lengths = offsets[1:] - offsets[:-1]
    if indices.numel() == 0:
        return indices.new_zeros(0), torch.zeros(0, dim, dtype=torch.float32)
    bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    scale = None
    if per_sample_weights is not None:
        scale = torch.as_tensor(per_sample_weights).reshape(-1).float()
    if mode == "mean":
        inv_len = torch.reciprocal(lengths.clamp(min=1).to(torch.float64)).float()[bag]
        scale = inv_len if scale is None else scale * inv_len
    elif mode != "sum":
        raise ValueError(f"mode must be 'sum' or 'mean', not {mode!r}")
    ids, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    grads = torch.zeros(ids.numel(), dim, dtype=torch.float32)
    if scale is None:
        grads.index_add_(0, inverse, grad_out[bag])
        return ids, grads
    # Occurrence k of every row is accumulated in round k (a row's occurrences in
    # input order), so each accumulation can round like FBGEMM's fma.
    order = torch.sort(inverse, stable=True).indices
    counts = torch.bincount(inverse, minlength=ids.numel())
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel()) - torch.repeat_interleave(starts, counts)
    acc = grads.double()
    g64 = grad_out.double()
    s64 = scale.double()
    by_rank = torch.sort(rank, stable=True)
    sel_all, rank_sorted = by_rank.indices, by_rank.values
    bounds = torch.searchsorted(rank_sorted, torch.arange(int(counts.max()) + 1))
    bounds = torch.cat([bounds, torch.tensor([rank_sorted.numel()])])
    for k in range(int(counts.max())):
        sel = sel_all[bounds[k]:bounds[k + 1]]
        rows = inverse[sel]
        acc[rows] = (acc[rows] + g64[bag[sel]] * s64[sel][:, None]).float().double()
    return ids, acc.float()


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(float(x), dtype=torch.float32)


class SparseOptimizer:
    """Base class. The caller owns the per-table state (`init_state`) so it can be
    checkpointed with the table; `step` updates rows `ids` of `table` in place."""

    name = "base"

    def __init__(self, lr: float):
        if not lr >= 0.0:
            raise ValueError(f"learning rate must be >= 0, not {lr}")
        self.lr = float(lr)

    def init_state(self, n_rows: int) -> dict[str, torch.Tensor]:
        return {}

    def params(self) -> dict[str, float]:
        """Hyper-parameters (for checkpoints and comparisons)."""
        return {"lr": self.lr}

    def step(self, table: UpdatableTable, state: dict[str, torch.Tensor], ids: torch.Tensor,
             grads: torch.Tensor, shared: bool = False) -> None:
        """Update rows `ids` (distinct) of `table` given their summed gradients [n, D].

        shared: the table is read by more than one feature (FBGEMM then takes its
        generic CPU kernel, whose row-wise reductions run sequentially)."""
        if ids.numel() == 0:
            return
        ids = torch.as_tensor(ids).reshape(-1).to(torch.int64)
        rows = self.apply(state, ids, table.gather(ids).float(), grads.float(), shared=shared)
        table.update(ids, rows.to(table.dtype))

    def apply(self, state, ids: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor,
              shared: bool = False) -> torch.Tensor:
        """New fp32 values of `rows` (the current values of rows `ids`); updates `state`."""
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.params() == self.params()

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.params().items()))))


class SGD(SparseOptimizer):
    """w <- w - lr * g (FBGEMM EXACT_SGD)."""

    name = "sgd"

    def apply(self, state, ids, rows, grads, shared=False):
        # FBGEMM's CPU kernel computes w -= lr * g with lr the fp32 learning rate
        # promoted to double: lr * g is exact in fp64, the difference is rounded to
        # fp64 and then to fp32.
        lr = float(_f32(self.lr))
        return (rows.double() - lr * grads.double()).float()


def rowwise_mean_square(grads: torch.Tensor, sequential: bool = False) -> torch.Tensor:
    """mean(g^2) per row in FBGEMM's order, grads [n, D] fp32 -> [n] fp32: summed in
    8 fp32 lanes reduced pairwise (the JIT kernel), or one element after the other
    (sequential: the generic kernel, used for tables shared by several features);
    then divided by D."""
    n, d = grads.shape
    if d == 0:
        return torch.zeros(n, dtype=torch.float32)
    if sequential:
        total = torch.zeros(n, dtype=torch.float32)
        for j in range(d):
            total += grads[:, j] * grads[:, j]
        return torch.div(total, _f32(d))
    pad = (-d) % 8
    sq = grads * grads
    if pad:
        sq = torch.nn.functional.pad(sq, (0, pad))
    sq = sq.view(n, -1, 8)
    lanes = sq[:, 0].clone()
    for c in range(1, sq.shape[1]):
        lanes += sq[:, c]
    total = (lanes[:, 0] + lanes[:, 1] + (lanes[:, 2] + lanes[:, 3])) \
        + ((lanes[:, 4] + lanes[:, 5]) + (lanes[:, 6] + lanes[:, 7]))
    return torch.div(total, _f32(d))


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt (fp64 sqrt rounded once more is exact for fp32)."""
    return x.double().sqrt().float()


class RowWiseAdagrad(SparseOptimizer):
    """FBGEMM EXACT_ROWWISE_ADAGRAD (no weight decay): per row
    m += mean(g^2); w <- w - lr / (sqrt(m) + eps) * g. State: momentum1 [N] fp32."""

    name = "rowwise_adagrad"

    def __init__(self, lr: float, eps: float = 1e-8):
        super().__init__(lr)
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, not {eps}")
        self.eps = float(eps)

    def params(self) -> dict[str, float]:
        return {"lr": self.lr, "eps": self.eps}

    def init_state(self, n_rows: int) -> dict[str, torch.Tensor]:
        return {"momentum1": torch.zeros(n_rows, dtype=torch.float32)}

    def apply(self, state, ids, rows, grads, shared=False):
        m = state["momentum1"]
        new = m[ids] + rowwise_mean_square(grads, sequential=shared)
        m[ids] = new
        step = torch.div(_f32(self.lr), _sqrt_rn(new) + _f32(self.eps))
        return rows - step[:, None] * grads


def make_optimizer(name: str, **params) -> SparseOptimizer:
    """An optimizer from its name ('sgd' or 'rowwise_adagrad') and params()."""
    if name == SGD.name:
        return SGD(**params)
    if name in (RowWiseAdagrad.name, "adagrad"):
        return RowWiseAdagrad(**params)
    raise ValueError(f"unknown sparse optimizer {name!r}; expected one of {OPTIMIZERS}")


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
