"""The 1-D synthetic regression data of the federated sparse GP paper (Sec. 6.1, Fig. 1).

Five clients each hold a cluster of inputs, with gaps between the clusters; the targets are one
draw of a GP with an SE kernel (``TRUE_HYPER``) plus Gaussian noise, so the true hyperparameters
are known and can be held fixed, as in the paper. :func:`inducing_drift` measures how far the
learnt inducing locations sit from the data: the quantity that separates FedAvg of the inducing
locations from PVI with an HVM over them.

Example::

    >>> data = five_partitions(seed=0)
    >>> data.clients.num_clients, data.X_test.shape
    (5, (200, 1))
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from fedppl.clients import Clients
from fedppl.partition import from_indices

__all__ = ["TRUE_HYPER", "Synthetic", "five_partitions", "inducing_drift"]

TRUE_HYPER = {"lengthscale": 0.25, "variance": 1.0, "noise": 0.2}
CENTRES = (-2.0, -1.0, 0.0, 1.0, 2.0)  # inputs on the scale of standardised data


class Synthetic(NamedTuple):
    clients: Clients
    X: np.ndarray  # all training inputs (N, 1)
    y: np.ndarray
    X_test: np.ndarray  # a grid over the whole range, gaps included
    f_test: np.ndarray  # the noiseless function on the grid


def _se(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d = (a[:, None, 0] - b[None, :, 0]) / TRUE_HYPER["lengthscale"]
    return TRUE_HYPER["variance"] * np.exp(-0.5 * d**2)


def five_partitions(per_client: int = 40, width: float = 0.5, num_test: int = 200,
                    seed: int = 0) -> Synthetic:
    """Five clusters of ``per_client`` inputs, ``width`` wide, one per client (see module doc)."""
    rng = np.random.default_rng(seed)
    X = np.concatenate([c + width * (rng.random(per_client) - 0.5) for c in CENTRES])[:, None]
    X_test = np.linspace(CENTRES[0] - 0.75, CENTRES[-1] + 0.75, num_test)[:, None]
    both = np.concatenate([X, X_test])
    cov = _se(both, both) + 1e-8 * np.eye(len(both))
    f = np.linalg.cholesky(cov) @ rng.normal(size=len(both))
    y = f[: len(X)] + TRUE_HYPER["noise"] * rng.normal(size=len(X))
    blocks = np.arange(len(X)).reshape(len(CENTRES), per_client)
    return Synthetic(from_indices(X, y, blocks), X, y, X_test, f[len(X):])


def inducing_drift(Z: np.ndarray, X: np.ndarray) -> dict[str, float]:
    """Distance of each inducing location to its nearest data input: mean, max, and the fraction
    of locations farther than one true lengthscale from every input."""
    Z, X = np.asarray(Z).reshape(len(Z), -1), np.asarray(X).reshape(len(X), -1)
    d = np.sqrt(((Z[:, None, :] - X[None, :, :]) ** 2).sum(-1)).min(axis=1)
    return {"mean": float(d.mean()), "max": float(d.max()),
            "far": float(np.mean(d > TRUE_HYPER["lengthscale"]))}
