"""Split a dataset ``(X, y)`` across clients, homogeneously or with skew.

Every function returns a :class:`~fedppl.clients.Clients` whose clients each hold ``(X_k, y_k)``.

Example::

    >>> import numpy as np
    >>> from fedppl import partition
    >>> X = np.random.default_rng(0).normal(size=(100, 3)); y = X[:, 0] > 0
    >>> clients = partition.homogeneous(X, y, num_clients=10, seed=0)
    >>> skewed = partition.by_feature(X, y, num_clients=10)          # sorted chunks
    >>> labels = partition.dirichlet(X, y, num_clients=10, alpha=0.5, seed=0)
    >>> clients.sizes.tolist()
    [10, 10, 10, 10, 10, 10, 10, 10, 10, 10]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedppl.clients import Clients

__all__ = ["homogeneous", "by_feature", "by_group", "dirichlet", "from_indices", "paired_chunks"]


def _check(X: np.ndarray, y: np.ndarray, num_clients: int | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    X, y = np.asarray(X), np.asarray(y)
    if X.ndim == 0 or y.ndim == 0:
        raise ValueError(f"X and y need a leading data axis, got shapes {X.shape} and {y.shape}")
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} rows but y has {y.shape[0]}")
    if num_clients is not None:
        if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)):
            raise TypeError(f"num_clients must be a whole number, got {num_clients!r}")
        if num_clients < 1:
            raise ValueError(f"num_clients must be at least 1, got {num_clients}")
        if num_clients > X.shape[0]:
            raise ValueError(f"{num_clients} clients but only {X.shape[0]} data points")
    return X, y


def from_indices(X: np.ndarray, y: np.ndarray, indices: Sequence[Sequence[int]]) -> Clients:
    """Client ``k`` takes the rows ``indices[k]`` (empty clients raise, naming the client)."""
    X, y = _check(X, y)
    for k, idx in enumerate(indices):
        if len(idx) == 0:
            raise ValueError(f"client {k} has no data")
    return Clients.from_list([(X[np.asarray(idx)], y[np.asarray(idx)]) for idx in indices])


def homogeneous(X: np.ndarray, y: np.ndarray, num_clients: int, seed: int = 0) -> Clients:
    """A random permutation cut into ``num_clients`` near-equal parts."""
    X, y = _check(X, y, num_clients)
    perm = np.random.default_rng(seed).permutation(X.shape[0])
    return from_indices(X, y, np.array_split(perm, num_clients))


def _feature_order(X: np.ndarray, y: np.ndarray, feature: int | None) -> np.ndarray:
    """Row order by ``X[:, feature]``; ``None`` takes the feature most correlated with ``y``."""
    if X.ndim != 2:
        hint = ": use X[:, None] for one feature" if X.ndim == 1 else ""
        raise ValueError(f"sorting by a feature needs X of shape (N, D), got {X.shape}{hint}")
    if feature is not None and (isinstance(feature, bool)
                                or not isinstance(feature, (int, np.integer))):
        raise TypeError(f"feature must be a column index, got {feature!r}")
    if feature is None:
        Xc, yc = X - X.mean(0), (y - y.mean()).reshape(-1)
        denom = np.sqrt((Xc**2).sum(0) * (yc**2).sum()) + 1e-300
        feature = int(np.argmax(np.abs(Xc.T @ yc) / denom))
    if not 0 <= feature < X.shape[1]:
        raise ValueError(f"feature {feature} out of range for {X.shape[1]} features")
    return np.argsort(X[:, feature], kind="stable")


def by_feature(X: np.ndarray, y: np.ndarray, num_clients: int, feature: int | None = None,
               sizes: Sequence[int] | None = None) -> Clients:
    """Inhomogeneous split: sort by one input feature and cut into contiguous chunks.

    ``feature=None`` sorts by the feature with the largest absolute correlation with ``y``
    (the choice of the FedBNR paper). ``sizes`` gives unequal chunk sizes (summing to N).
    """
    X, y = _check(X, y, num_clients)
    order = _feature_order(X, y, feature)
    if sizes is None:
        chunks = np.array_split(order, num_clients)
    else:
        sizes = np.asarray(sizes)
        if (sizes.shape != (num_clients,) or not np.issubdtype(sizes.dtype, np.integer)
                or sizes.min() < 1 or sizes.sum() != X.shape[0]):
            raise ValueError(f"sizes must be {num_clients} positive whole numbers summing to "
                             f"{X.shape[0]}, got {sizes.tolist()}")
        chunks = np.split(order, np.cumsum(sizes)[:-1])
    return from_indices(X, y, chunks)


def by_group(X: np.ndarray, y: np.ndarray, groups: np.ndarray) -> Clients:
    """One client per distinct value of ``groups`` (e.g. hospital id), in sorted order."""
    X, y = _check(X, y)
    groups = np.asarray(groups)
    if groups.shape[0] != X.shape[0]:
        raise ValueError(f"groups has {groups.shape[0]} entries but X has {X.shape[0]} rows")
    values = np.unique(groups)
    clients = from_indices(X, y, [np.nonzero(groups == v)[0] for v in values])
    return Clients(clients.data, tuple(f"group {v}" for v in values))


def dirichlet(X: np.ndarray, y: np.ndarray, num_clients: int, alpha: float, seed: int = 0,
              min_size: int = 1, max_tries: int = 100) -> Clients:
    """Label skew: for each class, its points go to clients in Dirichlet(alpha) proportions.

    Small ``alpha`` gives each client few classes; large ``alpha`` approaches homogeneous.
    Draws again (up to ``max_tries``) until every client has at least ``min_size`` points.
    """
    X, y = _check(X, y, num_clients)
    if not (isinstance(alpha, (int, float, np.number)) and np.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a positive finite number, got {alpha!r}")
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.nonzero(y == c)[0])
            cuts = (np.cumsum(rng.dirichlet(np.full(num_clients, alpha))) * len(idx)).astype(int)
            for k, chunk in enumerate(np.split(idx, cuts[:-1])):
                parts[k].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return from_indices(X, y, [np.sort(p) for p in parts])
    raise ValueError(
        f"could not give every one of {num_clients} clients {min_size} points in {max_tries} "
        f"draws with alpha={alpha}; raise alpha or lower num_clients"
    )


def paired_chunks(X: np.ndarray, y: np.ndarray, num_clients: int, seed: int = 0,
                  feature: int | None = None) -> Clients:
    """Heterogeneous split of the FedBNR paper: each client gets two random sorted chunks.

    Sort by ``feature`` (``None``: the feature most correlated with ``y``, as in
    :func:`by_feature`), cut into ``2 * num_clients`` contiguous near-equal chunks, and pair the
    chunks off at random (a permutation, without replacement). Client ``k`` holds its two chunks
    in sorted-feature order.
    """
    X, y = _check(X, y, num_clients)
    if X.shape[0] < 2 * num_clients:
        raise ValueError(f"{num_clients} clients need at least {2 * num_clients} data points "
                         f"(two chunks each), got {X.shape[0]}")
    chunks = np.array_split(_feature_order(X, y, feature), 2 * num_clients)
    pairs = np.random.default_rng(seed).permutation(2 * num_clients).reshape(num_clients, 2)
    return from_indices(X, y, [np.concatenate([chunks[i] for i in np.sort(p)]) for p in pairs])
