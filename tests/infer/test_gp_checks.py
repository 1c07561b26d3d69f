from __future__ import annotations

import numpy as np
import pytest

from fedppl.clients import Clients
from fedppl.infer import _gp_checks as chk


def test_converged_round_is_relative_to_the_range():
    assert chk.converged_round([0.0, 5.0, 9.0, 9.99, 10.0]) == 4
    assert chk.converged_round([1.0, 1.0]) == 1
    assert chk.converged_round([]) is None
    assert chk.converged_round([0.0, float("nan")]) is None
    assert chk.converged_round([-10.0, -3.0, -1.2, -0.9, -1.0], rel_tol=0.05) == 3


def test_regression_clients_are_float64_and_bernoulli_labels_checked():
    raw = Clients.from_list([(np.ones((3, 2), int), np.array([0, 1, 1]))], ["hospital A"])
    out = chk.regression_clients(raw, binary=True)
    assert out.data[0][0].dtype == np.float64 and out.data[0][1].dtype == np.float64
    assert out.names == ("hospital A",)
    bad = Clients.from_list([(np.ones((3, 2)), np.array([0.0, 1.0, -1.0]))], ["hospital B"])
    with pytest.raises(ValueError, match=r"hospital B: Bernoulli labels.*-1\.0"):
        chk.regression_clients(bad, binary=True)


@pytest.mark.parametrize("X, match", [(np.zeros(3), r"shape \(n, 2\)"),
                                      (np.zeros((3, 1)), r"shape \(n, 2\)"),
                                      (np.array([["a", "b"]]), "must hold numbers"),
                                      (np.array([[0.0, np.inf]]), "NaN or infinite")])
def test_check_inputs(X, match):
    with pytest.raises((ValueError, TypeError), match=match):
        chk.check_inputs(X, 2)
