"""tests/fuzz_lookups.py: a few of its cases pass, and it notices what it is there to notice."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import fuzz_lookups
from ibp_embed import CompressedTable, batched
from ibp_embed._native import lib, runnable_kernel_sets


@pytest.fixture
def odd_settings():
    """libibp on its portable kernels and 3 threads (not what it starts with), and put back after."""
    isa, threads = lib.ibp_isa(), lib.ibp_get_num_threads()
    lib.ibp_set_isa(lib.IBP_ISA_GENERIC)
    lib.ibp_set_num_threads(3)
    yield lib.IBP_ISA_GENERIC, 3
    lib.ibp_set_isa(isa)
    lib.ibp_set_num_threads(threads)


def test_a_few_cases_pass_and_leave_the_settings_as_they_were(odd_settings):
    out = io.StringIO()
    assert fuzz_lookups.run(0, 4, None, out) == 0, out.getvalue()
    assert "4 cases (seeds 0-3)" in out.getvalue()
    assert (lib.ibp_isa(), lib.ibp_get_num_threads()) == odd_settings


def test_mismatch_is_exact_where_it_must_be_and_close_elsewhere():
    ref = np.array([[1.0, 2.0, np.nan, 4.0]], dtype=np.float32)
    exact = np.array([True, True, True, False])
    out = ref.copy()
    out[0, 2] = np.uint32(0x7FC00001).view(np.float32)  # a NaN of another payload: torch keeps none through sums
    assert out.view(np.uint32)[0, 2] != ref.view(np.uint32)[0, 2]
    out[0, 3] = np.nextafter(np.float32(4.0), np.float32(5.0))  # one ulp: within the tolerance
    assert not len(fuzz_lookups.mismatch(out, ref, exact))
    out[0, 1] = np.nextafter(np.float32(2.0), np.float32(3.0))  # one ulp where sums must be exact
    out[0, 3] = 4.001
    assert fuzz_lookups.mismatch(out, ref, exact).tolist() == [[0, 1], [0, 3]]


def _flip_a_bit(out: torch.Tensor) -> torch.Tensor:
    """An exponent bit of the last value: wrong by any measure (NaNs, infinities, zeros included)."""
    bits = out.view(torch.int32) if out.element_size() == 4 else out.view(torch.int16)
    bits.view(-1)[-1] ^= 1 << 30 if out.element_size() == 4 else 1 << 13
    return out


FAULTS = {  # what a broken library could do, and the start of the report that must name it
    "lookup_many, one bit": ("lookup_many", lambda real: lambda *a, **k: _flip_a_bit(real(*a, **k)), "lookup_many"),
    "lookup_many, a row": ("lookup_many", lambda real: lambda *a, **k: real(*a, **k).index_fill_(0, torch.tensor([0]), 0.5),
                           "lookup_many"),
    "gather": ("gather", lambda real: lambda self, *a: _flip_a_bit(real(self, *a)), "table"),
    "lookup": ("lookup", lambda real: lambda self, *a, **k: _flip_a_bit(real(self, *a, **k)), "table"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_wrong_result_is_reported_with_its_seed(monkeypatch, fault):
    name, make, report = FAULTS[fault]
    owner = batched if name == "lookup_many" else CompressedTable
    monkeypatch.setattr(owner, name, make(getattr(owner, name)))
    problem = fuzz_lookups.one_case(7, dict(list(runnable_kernel_sets().items())[:1]))
    assert problem is not None and problem.startswith(report) and "seed 7:" in problem, problem


def test_an_id_out_of_range_that_raises_nothing_is_reported(monkeypatch):
    real = batched.lookup_many

    def silent(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        except IndexError:
            return torch.zeros(1)

    monkeypatch.setattr(batched, "lookup_many", silent)
    problem = fuzz_lookups.one_case(7, dict(list(runnable_kernel_sets().items())[:1]))
    assert problem is not None and problem.startswith("an id out of table") and "seed 7:" in problem


@pytest.mark.parametrize("bad", [["--cases", "0"], ["--cases", "-3"], ["--minutes", "0"], ["--minutes", "-1"]])
def test_bad_arguments(bad):
    with pytest.raises(SystemExit):
        fuzz_lookups.main(bad)
