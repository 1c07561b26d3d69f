"""Data for private Bayesian co-training (thesis Ch. 4): simulated Gaussian views and CCPP.

Every problem is a :class:`TwoViewData`: each party ``v`` holds private labelled data
``(X[v], y[v])`` in its own view (its own covariate columns), both parties index one shared
unlabelled pool (``pool[v]`` is the pool in view ``v``; row ``i`` is the same point in every
view), and a test set carries every view's covariates and the targets.

* :func:`simulate_two_views` -- the design of Sec. 4.3.1: two 1-D views and a response, jointly
  Gaussian with unit variances and ``corr(x_v, y) = r``; :func:`oracle_unexplained_sd` is the
  closed form behind Tables 4.1-4.2.
* :func:`ccpp_two_views` -- Sec. 4.5: the Combined Cycle Power Plant data split 2 + 2 into
  views, standardised, optionally masked by 2-means clusters (:func:`ccpp_split` keeps the rows).

Example::

    >>> data = simulate_two_views(r=0.9, cond_indep=True, masked=True, n_obs=25, seed=3)
    >>> X1, y1 = data.party(0)                    # x1 > 0 only
    >>> X1.shape, y1.shape
    ((25, 1), (25,))
    >>> round(float(oracle_unexplained_sd(0.9, cond_indep=True, masked=False, joint=True)), 3)
    0.324

``ccpp_two_views(path, n_obs=50, masked=True)`` splits the power-plant data into the views
(AT, V) and (AP, RH) the same way.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from fedppl.datasets import Standardiser, load_uci

__all__ = [
    "TwoViewData",
    "sample_gaussian_views",
    "simulate_two_views",
    "oracle_unexplained_sd",
    "CCPP_VIEWS",
    "CCPPSplit",
    "two_means",
    "ccpp_split",
    "ccpp_two_views",
]

Array = np.ndarray


@dataclass(frozen=True, eq=False)
class TwoViewData:
    """A co-training problem with ``V >= 1`` views, one party per view.

    ``X[v]`` (n_v, d_v) and ``y[v]`` (n_v,) are party ``v``'s private labelled data;
    ``pool[v]`` (n_pool, d_v) is the shared unlabelled pool in view ``v``; ``X_test[v]``
    (n_test, d_v) and ``y_test`` (n_test,) the test set; ``views[v]`` are view ``v``'s columns
    in the full covariate matrix (disjoint, together ``0 .. D-1``). ``y_pool`` holds the pool's
    true targets for diagnostics only: no party may see them.
    """

    X: tuple[Array, ...]
    y: tuple[Array, ...]
    pool: tuple[Array, ...]
    X_test: tuple[Array, ...]
    y_test: Array
    views: tuple[tuple[int, ...], ...]
    y_pool: Array | None = None

    def __post_init__(self) -> None:
        V = len(self.views)
        if V < 1 or not len(self.X) == len(self.y) == len(self.pool) == len(self.X_test) == V:
            raise ValueError(f"need V >= 1 views and one X, y, pool and X_test per view, got "
                             f"{len(self.views)} views, {len(self.X)} X, {len(self.y)} y, "
                             f"{len(self.pool)} pools and {len(self.X_test)} test views")
        cols = sorted(c for view in self.views for c in view)
        if cols != list(range(len(cols))) or any(len(view) == 0 for view in self.views):
            raise ValueError(f"views must be non-empty, disjoint and cover columns 0..D-1, "
                             f"got {self.views}")
        n_pool, n_test = self.pool[0].shape[0], self.y_test.shape[0]
        for v, view in enumerate(self.views):
            d, n = len(view), self.y[v].shape[0]
            if self.X[v].shape != (n, d) or self.y[v].ndim != 1:
                raise ValueError(f"party {v}: need X of shape (n, {d}) and y of shape (n,), "
                                 f"got {self.X[v].shape} and {self.y[v].shape}")
            if self.pool[v].shape != (n_pool, d) or self.X_test[v].shape != (n_test, d):
                raise ValueError(f"view {v}: pool {self.pool[v].shape} and test "
                                 f"{self.X_test[v].shape} should be ({n_pool}, {d}) and "
                                 f"({n_test}, {d})")
        if self.y_pool is not None and self.y_pool.shape != (n_pool,):
            raise ValueError(f"y_pool should have shape ({n_pool},), got {self.y_pool.shape}")

    @classmethod
    def from_rows(cls, X: Array, y: Array, views: Sequence[Sequence[int]],
                  party_rows: Sequence[Array], pool_rows: Array,
                  test_rows: Array) -> TwoViewData:
        """Cut the full data ``X`` (N, D), ``y`` (N,) into views by row indices.

        Party ``v`` gets rows ``party_rows[v]`` in columns ``views[v]``; pool and test keep
        every view. The pool's targets go to ``y_pool``.
        """
        X, y = np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64)
        view_cols = tuple(tuple(int(c) for c in view) for view in views)
        if len(party_rows) != len(view_cols):
            raise ValueError(f"{len(view_cols)} views but {len(party_rows)} parties")
        cut = [list(view) for view in view_cols]
        return cls(
            X=tuple(X[np.asarray(r)][:, c] for r, c in zip(party_rows, cut, strict=True)),
            y=tuple(y[np.asarray(r)] for r in party_rows),
            pool=tuple(X[np.asarray(pool_rows)][:, c] for c in cut),
            X_test=tuple(X[np.asarray(test_rows)][:, c] for c in cut),
            y_test=y[np.asarray(test_rows)],
            views=view_cols,
            y_pool=y[np.asarray(pool_rows)],
        )

    @property
    def n_views(self) -> int:
        return len(self.views)

    def party(self, v: int) -> tuple[Array, Array]:
        """Party ``v``'s private labelled data ``(X_v, y_v)``."""
        return self.X[v], self.y[v]

    def _join(self, parts: tuple[Array, ...]) -> Array:
        full = np.empty((parts[0].shape[0], sum(len(view) for view in self.views)))
        for view, part in zip(self.views, parts, strict=True):
            full[:, list(view)] = part
        return full

    def pool_joint(self) -> Array:
        """The pool with every view's columns in place, shape (n_pool, D)."""
        return self._join(self.pool)

    def test_joint(self) -> Array:
        """The test covariates with every view's columns in place, shape (n_test, D)."""
        return self._join(self.X_test)


# --------------------------------------------------------------------------- simulated views

def _check_r(r: float) -> float:
    r = float(r)
    if not 0.0 < r < 1.0:  # also rejects NaN
        raise ValueError(f"correlation r must lie in (0, 1), got {r}")
    return r


def _check_count(name: str, n: int, minimum: int = 1) -> int:
    if isinstance(n, bool) or int(n) != n or n < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {n!r}")
    return int(n)


def sample_gaussian_views(r: float, cond_indep: bool, n: int,
                          rng: np.random.Generator | int | None = None) -> tuple[Array, Array]:
    """``n`` draws of ``(x1, x2)`` (n, 2) and ``y`` (n,) from the generator of Sec. 4.3.1.

    All three are standard normal with ``corr(x_v, y) = r``. With ``cond_indep`` the precision
    between ``x1`` and ``x2`` is zero, i.e. ``x_v = r y + sqrt(1 - r^2) e_v`` with independent
    noises, so ``corr(x1, x2) = r^2``; without it ``x1 = x2`` (one shared noise).
    """
    r, n = _check_r(r), _check_count("n", n)
    rng = np.random.default_rng(rng)
    y = rng.standard_normal(n)
    noise = rng.standard_normal((n, 2 if cond_indep else 1))
    X = r * y[:, None] + math.sqrt(1.0 - r * r) * noise
    return (X if cond_indep else np.repeat(X, 2, axis=1)), y


def simulate_two_views(r: float, cond_indep: bool, masked: bool, n_obs: int,
                       n_test: int = 500, n_pool: int = 500, seed: int = 0) -> TwoViewData:
    """The simulated two-view problem of Sec. 4.3.1 (views ``(0,)`` = x1 and ``(1,)`` = x2).

    Party 1 holds ``n_obs`` labelled draws in view x1, party 2 ``n_obs`` independent draws in
    view x2; pool and test are unmasked draws. With ``masked`` party 1 sees only ``x1 > 0`` and
    party 2 only ``x2 < 0``. Masking is exact conditioning without rejection: the joint is a
    zero-mean Gaussian, so ``(x1, x2, y)`` given ``x1 > 0`` is distributed as
    ``sign(x1) (x1, x2, y)``; each party's draws are multiplied by that sign (``-sign(x2)`` for
    party 2). Draw order from ``seed``: party 1, party 2, pool, test.
    """
    n_obs = _check_count("n_obs", n_obs)
    n_test, n_pool = _check_count("n_test", n_test), _check_count("n_pool", n_pool)
    rng = np.random.default_rng(seed)
    parts = []
    for v, sign in ((0, 1.0), (1, -1.0)):
        X, y = sample_gaussian_views(r, cond_indep, n_obs, rng)
        if masked:  # flip whole draws onto the half sign * x_v > 0
            flip = np.where(sign * X[:, v] < 0, -1.0, 1.0)
            X, y = X * flip[:, None], y * flip
        parts.append((X, y))
    parts.append(sample_gaussian_views(r, cond_indep, n_pool, rng))
    parts.append(sample_gaussian_views(r, cond_indep, n_test, rng))
    X = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    starts = np.cumsum([0, n_obs, n_obs, n_pool, n_test])
    rows = [np.arange(a, b) for a, b in itertools.pairwise(starts)]
    return TwoViewData.from_rows(X, y, ((0,), (1,)), rows[:2], rows[2], rows[3])


def oracle_unexplained_sd(r: float, cond_indep: bool, masked: bool, joint: bool) -> float:
    """Best achievable residual SD of ``y`` in the simulated design (Tables 4.1 and 4.2).

    Derivation (unit variances, ``corr(x_v, y) = r``):

    * individual, unmasked: ``E[y | x_v] = r x_v`` leaves ``Var = 1 - r^2``;
    * joint with conditional independence: ``Sigma_xx = [[1, r^2], [r^2, 1]]``,
      ``Sigma_xy = (r, r)``, explained ``Sigma_yx Sigma_xx^-1 Sigma_xy = 2 r^2 / (1 + r^2)``,
      leaving ``(1 - r^2) / (1 + r^2)``; without it ``x1 = x2`` adds nothing to one view;
    * individual, masked: a party predicts ``r x_v`` on its half (residual ``1 - r^2``, mass
      1/2) and the prior mean 0 on the other half, where ``E[y^2 | half] = 1`` by the symmetry
      ``(x, y) -> -(x, y)``: ``Var = (1 - r^2)/2 + 1/2 = 1 - r^2 / 2``;
    * joint, masked: as unmasked (the thesis's convention: the joint oracle is the
      population regression ``E[y | x1, x2]``, which masking of the labelled data does not
      change), so ``masked`` is ignored when ``joint``.
    """
    r = _check_r(r)
    if joint and cond_indep:
        var = (1.0 - r * r) / (1.0 + r * r)
    elif masked and not joint:
        var = 1.0 - r * r / 2.0
    else:
        var = 1.0 - r * r
    return math.sqrt(var)


# --------------------------------------------------------------------------- CCPP

# UCI column order of power-plant: AT (ambient temperature), V (exhaust vacuum),
# AP (ambient pressure), RH (relative humidity); target PE (net hourly energy output).
CCPP_VIEWS: tuple[tuple[int, ...], ...] = ((0, 1), (2, 3))


class CCPPSplit(NamedTuple):
    """Row-level record of :func:`ccpp_split` (rows index ``X``/``y``).

    ``X`` (N, 4) and ``y`` (N,) are standardised with ``scaler``; ``clusters`` (N,) are the
    2-means labels of every row when masked (0 = cooler cluster, party 1's), else ``None``.
    """

    X: Array
    y: Array
    party_rows: tuple[Array, Array]
    pool_rows: Array
    test_rows: Array
    clusters: Array | None
    scaler: Standardiser

    def views(self) -> TwoViewData:
        """The co-training problem in views :data:`CCPP_VIEWS`."""
        return TwoViewData.from_rows(self.X, self.y, CCPP_VIEWS, self.party_rows,
                                     self.pool_rows, self.test_rows)


def two_means(Z: Array, fit_rows: Array | None = None, random_state: int = 0) -> Array:
    """2-means labels of the rows of ``Z`` (scikit-learn ``KMeans``, 10 restarts).

    The centroids are fitted on ``Z[fit_rows]`` (all rows by default) and every row gets the
    nearest one. Labels are ordered by the centroids' first column: 0 for the lower.
    """
    from sklearn.cluster import KMeans

    Z = np.asarray(Z, dtype=np.float64)
    fit = Z if fit_rows is None else Z[np.asarray(fit_rows)]
    km = KMeans(n_clusters=2, n_init=10, random_state=random_state).fit(fit)
    order = np.argsort(km.cluster_centers_[:, 0])
    relabel = np.empty(2, dtype=np.int64)
    relabel[order] = np.arange(2)
    return relabel[km.predict(Z)]


def ccpp_split(path: str | Path, n_obs: int, masked: bool, n_test: int = 250,
               n_pool: int = 250, seed: int = 0, *, raw_clusters: bool = False) -> CCPPSplit:
    """Rows of the CCPP co-training problem of Sec. 4.5 (see :func:`ccpp_two_views`)."""
    n_obs = _check_count("n_obs", n_obs)
    n_test, n_pool = _check_count("n_test", n_test), _check_count("n_pool", n_pool)
    data = load_uci(path)
    N, D = data.X.shape
    if D != 4:
        raise ValueError(f"CCPP has 4 covariates, {path} has {D}")
    if n_test + n_pool >= N:
        raise ValueError(f"n_test + n_pool = {n_test + n_pool} leaves no labelled rows of {N}")
    rng = np.random.default_rng(seed)
    perm = rng.permutation(N)
    test, pool = perm[:n_test], perm[n_test:n_test + n_pool]
    cand = perm[n_test + n_pool:]  # rows the parties' labelled data come from
    scaler = Standardiser.fit(data.X[cand], data.y[cand])
    X, y = scaler.transform_X(data.X), scaler.transform_y(data.y)
    if masked:
        clusters = two_means(data.X if raw_clusters else X, fit_rows=cand)
        per_party = [cand[clusters[cand] == k] for k in (0, 1)]
        for v, rows in enumerate(per_party):
            if n_obs > rows.size:
                raise ValueError(f"n_obs = {n_obs} exceeds the {rows.size} labelled rows in "
                                 f"party {v + 1}'s cluster")
        first, second = (rng.choice(rows, n_obs, replace=False) for rows in per_party)
        party = (first, second)
    else:
        clusters = None
        if 2 * n_obs > cand.size:
            raise ValueError(f"2 * n_obs = {2 * n_obs} exceeds the {cand.size} labelled rows")
        chosen = rng.choice(cand, 2 * n_obs, replace=False)
        party = (chosen[:n_obs], chosen[n_obs:])
    return CCPPSplit(X, y, party, pool, test, clusters, scaler)


def ccpp_two_views(path: str | Path, n_obs: int, masked: bool, n_test: int = 250,
                   n_pool: int = 250, seed: int = 0, *, raw_clusters: bool = False
                   ) -> TwoViewData:
    """The CCPP co-training problem of Sec. 4.5 from the UCI folder ``path`` (power-plant).

    Rows are shuffled by ``seed``: the first ``n_test`` are the test set, the next ``n_pool``
    the unlabelled pool, the rest the candidates for labelled data. View 1 is (AT, V), view 2
    (AP, RH) (:data:`CCPP_VIEWS`). Covariates and target are standardised with the candidates'
    moments (test and pool play no part). Unmasked, the two parties get ``n_obs`` disjoint
    random candidates each. Masked, :func:`two_means` runs on all four standardised
    covariates (centroids fitted on the candidates, ``random_state=0``): party 1 draws from
    the cooler cluster (lower AT centroid), party 2 from the other; pool and test stay
    unmasked. ``raw_clusters`` clusters the unscaled covariates instead (dominated by V and
    RH). The thesis says only "running a k-means algorithm on the covariates to generate two
    clusters"; which covariates form which view and which party gets which cluster are our
    choices (view 1 = (AT, V) reproduces the strong view 1 of Table 4.13). Use
    :func:`ccpp_split` for the row indices, clusters and scaler.
    """
    return ccpp_split(path, n_obs, masked, n_test, n_pool, seed,
                      raw_clusters=raw_clusters).views()
