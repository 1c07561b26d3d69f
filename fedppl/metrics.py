"""Test metrics for predictive distributions: accuracy, log-likelihood and calibration.

Inputs may be numpy or jax arrays; everything is computed in float64 numpy and scalar
results come back as Python floats. Regression metrics take Gaussian predictives
``N(mean, var)`` per test point, where ``var`` is the *predictive* variance (epistemic
variance of the mean plus observation noise). Classification metrics take ``prob = P(y=1)``
for binary labels, or an ``(N, C)`` matrix of class probabilities.

Example::

    >>> import numpy as np
    >>> from fedppl import metrics
    >>> y_test = np.array([1.0, 2.0, 3.0])
    >>> mean, var = metrics.unstandardise(np.zeros(3), np.ones(3), 2.0, 1.0)  # original units
    >>> round(metrics.rmse(y_test, mean), 3), round(metrics.gaussian_log_likelihood(
    ...     y_test, mean, var), 3)
    (0.816, -1.252)
    >>> cal = metrics.regression_calibration(y_test, mean, var)  # cal.ece, cal.mce, cal.brier
    >>> labels, prob = np.array([0, 1, 1]), np.array([0.2, 0.9, 0.4])
    >>> metrics.accuracy(labels, prob)
    0.6666666666666666
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from scipy.special import ndtri

__all__ = [
    "Calibration",
    "Reliability",
    "rmse",
    "gaussian_log_likelihood",
    "unstandardise",
    "regression_calibration",
    "accuracy",
    "classification_ece",
    "reliability_diagram",
    "rounds_to_convergence",
]


class Calibration(NamedTuple):
    """Regression calibration summary: scores, the levels ``p_j`` and observed coverages."""

    ece: float
    mce: float
    brier: float
    levels: np.ndarray
    observed: np.ndarray


class Reliability(NamedTuple):
    """Per-bin mean confidence, accuracy (NaN for empty bins), counts, and the bin edges."""

    confidence: np.ndarray
    accuracy: np.ndarray
    count: np.ndarray
    edges: np.ndarray


# ---------------------------------------------------------------------------------------------
# validation helpers

def _array(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or inf")
    return a


def _vector(x: Any, name: str) -> np.ndarray:
    a = _array(x, name)
    if a.ndim == 2 and a.shape[1] == 1:
        a = a[:, 0]
    if a.ndim != 1:
        raise ValueError(f"{name} must be one value per point (shape (N,) or (N, 1)), "
                         f"got {a.shape}")
    if a.size == 0:
        raise ValueError(f"{name} is empty")
    return a


def _same_length(a: np.ndarray, b: np.ndarray, name_a: str, name_b: str) -> None:
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{name_a} has {a.shape[0]} entries but {name_b} has {b.shape[0]}")


def _gaussian(y: Any, mean: Any, var: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validated ``(y, mean, var)`` as float64 vectors; a scalar ``var`` is broadcast."""
    y, mean = _vector(y, "y"), _vector(mean, "mean")
    _same_length(y, mean, "y", "mean")
    v = _array(var, "var")
    if v.ndim == 0:
        v = np.full_like(mean, float(v))
    v = _vector(v, "var")
    _same_length(y, v, "y", "var")
    if np.any(v <= 0):
        raise ValueError(f"var must be positive, got minimum {v.min():g}")
    return y, mean, v


def _classification(y: Any, prob: Any) -> tuple[np.ndarray, np.ndarray]:
    """Validated labels and an ``(N, C)`` probability matrix (binary ``p`` becomes ``[1-p, p]``)."""
    p = _array(prob, "prob")
    if p.ndim == 2 and p.shape[1] == 1:
        p = p[:, 0]
    if p.ndim not in (1, 2) or p.shape[0] == 0:
        raise ValueError(f"prob must have shape (N,) or (N, C) with N > 0, got {p.shape}")
    if np.any(p < 0) or np.any(p > 1):
        raise ValueError(f"prob must lie in [0, 1], got range [{p.min():g}, {p.max():g}]")
    labels = _vector(y, "y")
    _same_length(labels, p, "y", "prob")
    if p.ndim == 1:
        if not np.all((labels == 0) | (labels == 1)):
            raise ValueError("binary labels y must be 0 or 1")
        return labels.astype(np.int64), np.stack([1.0 - p, p], axis=1)
    num_classes = p.shape[1]
    if not np.allclose(p.sum(1), 1.0, atol=1e-3):
        raise ValueError("each row of prob must sum to 1")
    if not np.all((labels == np.round(labels)) & (labels >= 0) & (labels < num_classes)):
        raise ValueError(f"labels y must be integers in [0, {num_classes - 1}]")
    return labels.astype(np.int64), p


# ---------------------------------------------------------------------------------------------
# regression

def rmse(y: Any, mean: Any) -> float:
    """Root mean squared error ``sqrt(mean_i (y_i - mean_i)^2)``."""
    y, mean = _vector(y, "y"), _vector(mean, "mean")
    _same_length(y, mean, "y", "mean")
    return float(np.sqrt(np.mean((y - mean) ** 2)))


def gaussian_log_likelihood(y: Any, mean: Any, var: Any) -> float:
    """Average test log-likelihood ``mean_i log N(y_i | mean_i, var_i)``.

    ``var`` is the full predictive variance, *including* observation noise (a scalar is
    broadcast). Use :func:`unstandardise` first to report it in original units.
    """
    y, mean, var = _gaussian(y, mean, var)
    return float(np.mean(-0.5 * np.log(2 * np.pi * var) - 0.5 * (y - mean) ** 2 / var))


def unstandardise(mean: Any, var: Any, y_mean: float,
                  y_std: float) -> tuple[np.ndarray, np.ndarray]:
    """Map a predictive from standardised targets ``(y - y_mean) / y_std`` to original units.

    Returns ``(mean * y_std + y_mean, var * y_std**2)``. RMSE then scales by ``y_std``, and
    because the variance is rescaled the log-likelihood picks up the Jacobian automatically:
    ``loglik_original = loglik_standardised - log(y_std)``.
    """
    y_mean, y_std = float(y_mean), float(y_std)
    if not (np.isfinite(y_mean) and np.isfinite(y_std)) or y_std <= 0:
        raise ValueError(f"y_std must be positive and y_mean finite, got {y_mean}, {y_std}")
    mean, var = _array(mean, "mean"), _array(var, "var")
    if np.any(var <= 0):
        raise ValueError(f"var must be positive, got minimum {var.min():g}")
    return mean * y_std + y_mean, var * y_std**2


def regression_calibration(y: Any, mean: Any, var: Any, levels: Any = None) -> Calibration:
    """Calibration of Gaussian predictives on central credible intervals.

    For each level ``p_j`` (default ``np.linspace(0.01, 0.99, 99)``) the central interval is
    ``I_j(x_i) = mean_i ± z_j sqrt(var_i)`` with ``z_j = Phi^-1(0.5 + p_j / 2)``, and
    ``observed_j = mean_i 1[y_i in I_j(x_i)]`` is its empirical coverage. Then

    * ``ece   = mean_j |observed_j - p_j|``;
    * ``mce   = max_j  |observed_j - p_j|``;
    * ``brier = mean_{i,j} (1[y_i in I_j(x_i)] - p_j)^2``.

    A calibrated predictive has ``ece ≈ 0`` and ``brier ≈ mean_j p_j (1 - p_j)`` (about 1/6 for
    the default levels); the worst ECE is about 0.5. ``observed < levels`` means over-confident,
    ``observed > levels`` under-confident.
    """
    y, mean, var = _gaussian(y, mean, var)
    p = np.linspace(0.01, 0.99, 99) if levels is None else _array(levels, "levels").reshape(-1)
    if p.size == 0 or np.any(p <= 0) or np.any(p >= 1):
        raise ValueError("levels must be a non-empty set of numbers strictly between 0 and 1")
    z = ndtri(0.5 + p / 2)  # the standard normal's quantile
    inside = np.abs(y - mean)[:, None] <= z[None, :] * np.sqrt(var)[:, None]  # (N, J)
    observed = inside.mean(0)
    gap = np.abs(observed - p)
    brier = np.mean((inside - p[None, :]) ** 2)
    return Calibration(float(gap.mean()), float(gap.max()), float(brier), p, observed)


# ---------------------------------------------------------------------------------------------
# classification

def accuracy(y: Any, prob: Any) -> float:
    """Fraction of correct argmax predictions (binary: predict 1 when ``prob >= 0.5``)."""
    labels, p = _classification(y, prob)
    pred = (p[:, 1] >= 0.5).astype(np.int64) if p.shape[1] == 2 else np.argmax(p, axis=1)
    return float(np.mean(pred == labels))


def reliability_diagram(y: Any, prob: Any, num_bins: int = 10, ax: Any = None) -> Reliability:
    """Bin predictions by confidence (the max class probability) into equal-width bins.

    Bin ``b`` is ``[b / num_bins, (b + 1) / num_bins)`` (the last bin includes 1). Returns the
    mean confidence, accuracy and count per bin (NaN confidence/accuracy for empty bins). If a
    matplotlib ``ax`` is given, draws accuracy bars per bin against the diagonal.
    """
    if int(num_bins) != num_bins or num_bins < 1:
        raise ValueError(f"num_bins must be a positive integer, got {num_bins}")
    num_bins = int(num_bins)
    labels, p = _classification(y, prob)
    # keep the binary tie rule of accuracy(): p = 0.5 predicts class 1
    pred = (p[:, 1] >= 0.5).astype(np.int64) if p.shape[1] == 2 else np.argmax(p, axis=1)
    conf = p[np.arange(p.shape[0]), pred]
    correct = (pred == labels).astype(np.float64)
    bins = np.minimum((conf * num_bins).astype(np.int64), num_bins - 1)
    count = np.bincount(bins, minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(bins, weights=conf, minlength=num_bins) / count
        mean_acc = np.bincount(bins, weights=correct, minlength=num_bins) / count
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    if ax is not None:
        _draw_reliability(ax, mean_acc, edges)
    return Reliability(mean_conf, mean_acc, count, edges)


def _draw_reliability(ax: Any, acc: np.ndarray, edges: np.ndarray) -> None:
    # Only the given axis's methods are used, so matplotlib itself is never imported here.
    width = edges[1] - edges[0]
    filled = ~np.isnan(acc)
    ax.bar(edges[:-1][filled], acc[filled], width=width, align="edge", edgecolor="black",
           alpha=0.7, label="accuracy")
    ax.plot([0, 1], [0, 1], "k--", label="perfect calibration")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.legend(loc="upper left")


def classification_ece(y: Any, prob: Any, num_bins: int = 10) -> float:
    """Binned confidence ECE: ``sum_b (n_b / N) |acc_b - conf_b|`` over equal-width bins.

    ``conf_b`` and ``acc_b`` are the mean confidence (max class probability) and accuracy of
    the ``n_b`` points in bin ``b``; see :func:`reliability_diagram` for the binning.
    """
    rel = reliability_diagram(y, prob, num_bins)
    filled = rel.count > 0
    weights = rel.count[filled] / rel.count.sum()
    return float(np.sum(weights * np.abs(rel.accuracy[filled] - rel.confidence[filled])))


def rounds_to_convergence(values: Any, tol: float) -> int:
    """First round (1-based) after which a per-round curve stays within ``tol`` of its last value.

    >>> rounds_to_convergence([0.0, 5.0, 9.0, 9.99, 10.0], tol=0.1)
    4
    """
    v = _vector(values, "values")  # raises on an empty or non-finite curve
    far = np.flatnonzero(np.abs(v - v[-1]) > tol)
    return int(far[-1] + 2) if len(far) else 1
