"""What the sparse-GP fronts (:mod:`.sparse_gps`, :mod:`.fedavg_gp`) share on top of
:mod:`fedppl.validation`: checks of regression data and test arrays (run before any compiled
code), the convergence round of a curve, and the ArviZ export of draws and constants.

Example::

    >>> converged_round([0.0, 5.0, 9.0, 9.99, 10.0])    # within 1 % of the range from round 4
    4
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedppl import metrics, validation
from fedppl.clients import Clients

__all__ = ["regression_clients", "check_inputs", "check_targets", "converged_round",
           "inference_data"]


def regression_clients(clients: Any, binary: bool = False) -> Clients:
    """Clients holding ``(X (N_k, D), y (N_k,))`` of finite numbers, as float64 arrays (``binary``:
    labels 0 or 1); a clear error naming the client otherwise."""
    if not isinstance(clients, Clients):
        raise TypeError(f"clients must be a fedppl.Clients (see fedppl.partition), got "
                        f"{type(clients).__name__}")
    out = []
    for who, arrays in zip(clients.names, clients.data, strict=True):
        if len(arrays) != 2:
            raise ValueError(f"{who}: need (X of shape (N, D), y of shape (N,)); got "
                             f"{len(arrays)} arrays")
        X, y = (_numbers(f"{who}: {n}", a) for n, a in zip("Xy", arrays, strict=True))
        validation.inputs_2d(X, who)
        if y.ndim != 1:
            hint = (": use y.reshape(-1) (fedppl does not guess which axis to drop)"
                    if y.ndim == 2 and y.shape[1] == 1 else "")
            raise ValueError(f"{who}: need y of shape (N,), got {y.shape}{hint}")
        if X.shape[1] == 0:
            raise ValueError(f"{who}: X has no features (shape {X.shape})")
        if binary:
            validation.labels_in(y, (0.0, 1.0), who, "Bernoulli labels")
        out.append((X, y))
    return clients.with_data(out)


def _numbers(name: str, a: Any) -> np.ndarray:
    try:
        arr = np.asarray(a, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must hold numbers, got dtype {np.asarray(a).dtype}") from None
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or infinite values")
    return arr


def check_inputs(X: Any, dim: int, name: str = "X") -> np.ndarray:
    """Test inputs of shape ``(n, dim)``, finite, as float64."""
    arr = _numbers(name, X)
    if arr.ndim != 2 or arr.shape[1] != dim:
        hint = f": use {name}[:, None] for one feature" if arr.ndim == 1 and dim == 1 else ""
        raise ValueError(f"{name} must have shape (n, {dim}), got {arr.shape}{hint}")
    return arr


def check_targets(y: Any, n: int, name: str = "y") -> np.ndarray:
    """Test targets of shape ``(n,)``, finite, as float64."""
    arr = _numbers(name, y)
    if arr.shape != (n,):
        hint = f": use {name}.reshape(-1)" if arr.shape == (n, 1) else ""
        raise ValueError(f"{name} must have shape ({n},), got {arr.shape}{hint}")
    return arr


def converged_round(values: Any, rel_tol: float = 0.01) -> int | None:
    """:func:`fedppl.metrics.rounds_to_convergence` with ``tol = rel_tol`` times the range the
    curve covered; ``None`` for an empty or non-finite curve."""
    v = np.asarray(values, dtype=float)
    if v.size == 0 or not np.all(np.isfinite(v)):
        return None
    return metrics.rounds_to_convergence(v, rel_tol * max(float(np.ptp(v)), 1e-12))


def inference_data(posterior: dict[str, Any], constant: dict[str, Any],
                   attrs: dict[str, Any]) -> Any:
    """An ``xarray.DataTree`` for ArviZ 1.x of posterior draws (``(S, ...)`` arrays of
    independent draws, exported as 4 chains) and constant data, with ``attrs`` on the posterior
    group (or on the constant data)."""
    from fedppl import arviz

    dims = {k: [f"{k}_dim_{i}" for i in range(np.ndim(v) - 1)] for k, v in posterior.items()}
    dims.update({k: [f"{k}_dim_{i}" for i in range(np.ndim(v))] for k, v in constant.items()})
    group = "posterior" if posterior else "constant_data"
    return arviz.from_dict(
        {"posterior": {k: arviz.as_chains(v) for k, v in posterior.items()},
         "constant_data": constant},
        dims=dims, attrs={group: {k: v for k, v in attrs.items() if v is not None}})
