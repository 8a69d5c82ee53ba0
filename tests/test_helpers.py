"""The tests' own helpers where a mistake would hide a kernel's: poisoned outputs."""
import numpy as np
import torch

from helpers import every_isa, poisoned_empty


def test_poisoned_empty_fills_what_it_returns_and_restores_once():
    real_torch, real_np = torch.empty, np.empty
    with poisoned_empty():
        assert torch.isnan(torch.empty(3, 5)).all() and torch.isnan(torch.empty((2,), dtype=torch.float16)).all()
        assert (torch.empty(4, dtype=torch.int32).view(torch.uint8) == 0xA5).all()
        assert torch.empty(0, requires_grad=True).requires_grad  # a leaf that requires grad (the TorchRec module)
        assert np.isnan(np.empty((2, 3))).all()
        assert (np.empty((3, 4), np.int32, order="F").ravel(order="K").view(np.uint8) == 0xA5).all()
        assert np.empty(2, dtype=object).shape == (2,)  # references: left alone
        with poisoned_empty():  # nested: restores nothing on its way out
            pass
        assert torch.empty is not real_torch
        inner = every_isa()
        next(inner)
        inner.close()
        assert np.empty is not real_np
    assert torch.empty is real_torch and np.empty is real_np
