import math

import torch

from kdev.compare import compare, cos_diff
from kdev.config import Tolerance

TOL = Tolerance(atol=1e-2, rtol=1e-2, cos_diff=1e-5)


def test_identical_passes_and_single_wrong_element_fails():
    g = torch.Generator().manual_seed(0)
    want = torch.randn(4, 8, 16, generator=g, dtype=torch.float64)
    assert compare("x", want.clone(), want, TOL).passed
    got = want.clone()
    got[2, 5, 7] += 0.5
    c = compare("x", got, want, TOL)
    assert not c.passed and c.worst[0][0] == (2, 5, 7) and math.isclose(c.worst[0][3], 0.5, rel_tol=1e-9)
    assert c.frac_passed == 1 - 1 / want.numel() and "1 element(s) beyond" in c.reason


def test_abs_or_rel():
    want = torch.tensor([1000.0, 0.001])
    got = torch.tensor([1005.0, 0.009])  # 5 off but 0.5% relative; 0.008 off, within atol
    assert compare("x", got, want, Tolerance(atol=1e-2, rtol=1e-2, cos_diff=1e-4)).passed
    assert not compare("x", got, want, Tolerance(atol=1e-2, rtol=1e-3, cos_diff=1e-4)).passed
    assert not compare("x", got, want, Tolerance(atol=1e-3, rtol=1e-2, cos_diff=1e-4)).passed


def test_nan_and_inf_positions_must_match():
    want = torch.tensor([1.0, float("nan"), float("inf"), 2.0])
    assert compare("x", want.clone(), want, TOL).passed
    c = compare("x", torch.tensor([1.0, 0.0, float("inf"), 2.0]), want, TOL)
    assert not c.passed and c.nonfinite_mismatch == 1 and c.worst[0][0] == (1,)
    c = compare("x", torch.tensor([1.0, float("nan"), float("-inf"), 2.0]), want, TOL)
    assert not c.passed and c.nonfinite_mismatch == 1
    c = compare("x", torch.tensor([float("nan"), float("nan"), float("inf"), 2.0]), want, TOL)
    assert not c.passed  # a NaN where a number belongs (an unwritten, poisoned output)


def test_cos_diff_catches_small_systematic_error():
    g = torch.Generator().manual_seed(1)
    want = torch.randn(10000, generator=g, dtype=torch.float64)
    assert cos_diff(want, want) == 0.0
    tol = Tolerance(atol=0, rtol=1e-2, cos_diff=1e-6)
    got = want * 1.009  # every element within rtol, but all biased the same way
    c = compare("x", got, want, tol)
    assert c.frac_passed == 1.0 and not c.passed and "cos_diff" in c.reason
    got = want * (1 + 1e-3 * torch.randn(10000, generator=g, dtype=torch.float64))  # unbiased rounding-like noise
    assert compare("x", got, want, tol).passed


def test_shape_mismatch_fails():
    c = compare("x", torch.zeros(3), torch.zeros(4), TOL)
    assert not c.passed and "shape" in c.reason
