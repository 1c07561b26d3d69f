from __future__ import annotations

import numpy as np
import pytest

from fedppl.models import kernels


def test_closed_forms_on_known_distances():
    X1, X2 = np.zeros((1, 2)), np.array([[3.0, 4.0]])  # distance 5
    assert float(kernels.se(X1, X2, 5.0, 2.0)[0, 0]) == pytest.approx(2 * np.exp(-0.5))
    assert float(kernels.matern(X1, X2, 0.5, 5.0)[0, 0]) == pytest.approx(np.exp(-1))
    s3, s5 = np.sqrt(3), np.sqrt(5)
    assert float(kernels.matern(X1, X2, 1.5, 5.0)[0, 0]) == pytest.approx((1 + s3) * np.exp(-s3))
    assert float(kernels.matern(X1, X2, 2.5, 5.0)[0, 0]) == pytest.approx(
        (1 + s5 + 5 / 3) * np.exp(-s5))
    ard = kernels.se(X1, X2, np.array([3.0, 4.0]))
    assert float(ard[0, 0]) == pytest.approx(np.exp(-1.0))
    with pytest.raises(ValueError, match="nu"):
        kernels.matern(X1, X2, nu=3.0)
