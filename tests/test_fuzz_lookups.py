"""tests/fuzz_lookups.py: a few of its cases pass, and it notices what it is there to notice."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import fuzz_lookups
from ibp_embed import batched
from ibp_embed._native import lib, runnable_kernel_sets


def test_a_few_cases_pass_and_leave_the_settings_as_they_were():
    isa, threads = lib.ibp_isa(), lib.ibp_get_num_threads()
    out = io.StringIO()
    assert fuzz_lookups.run(0, 4, None, out) == 0, out.getvalue()
    assert "4 cases (seeds 0-3)" in out.getvalue()
    assert (lib.ibp_isa(), lib.ibp_get_num_threads()) == (isa, threads)


def test_mismatch_is_exact_where_it_must_be_and_close_elsewhere():
    ref = np.array([[1.0, 2.0, np.nan, 4.0]], dtype=np.float32)
    exact = np.array([True, True, True, False])
    out = ref.copy()
    out[0, 2] = np.float32(np.nan) * -1  # another NaN: torch keeps no payloads through sums
    out[0, 3] = np.nextafter(np.float32(4.0), np.float32(5.0))  # one ulp: within 1e-5
    assert not len(fuzz_lookups.mismatch(out, ref, exact))
    out[0, 1] = np.nextafter(np.float32(2.0), np.float32(3.0))  # one ulp where sums must be exact
    out[0, 3] = 4.001
    assert fuzz_lookups.mismatch(out, ref, exact).tolist() == [[0, 1], [0, 3]]


@pytest.mark.parametrize("fault", ["one bit", "a row's sums"])
def test_a_wrong_lookup_is_reported_with_its_seed(monkeypatch, fault):
    real = batched.lookup_many

    def wrong(*args, **kwargs):
        out = real(*args, **kwargs)
        if fault == "one bit":  # an exponent bit: wrong by any measure, NaNs and zeros included
            out.view(torch.int32)[-1, -1] ^= 1 << 30
        else:
            out[0] = 0.5
        return out

    monkeypatch.setattr(batched, "lookup_many", wrong)
    problem = fuzz_lookups.one_case(7, dict(list(runnable_kernel_sets().items())[:1]))
    assert problem is not None and problem.startswith("lookup_many") and "seed 7:" in problem
