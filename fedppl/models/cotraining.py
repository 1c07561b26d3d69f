"""The Bayesian co-training kernel (Yu et al. 2011; thesis Eq. 4.4) and a GP over several views.

Each view ``v`` sees some of the ``n`` points (labelled, unlabelled and test alike: the kernel is
transductive) with covariance ``C_v = K_v + s_v^2 I`` there. The co-training kernel is

    K_c = [ sum_v E_v C_v^-1 E_v^T ]^-1,

``E_v`` embedding view v's points among all n. When one view covers every point (the usual case
from a party's own side), the others are folded in by the Woodbury identity,
``K_c = C_1 - C_1 U (B + U^T C_1 U)^-1 U^T C_1`` with ``U = [E_2, E_3, ...]`` and
``B = blockdiag(C_2, C_3, ...)``, which needs one linear solve and no explicit inverse.

Example (view 1 sees all three points, view 2 the last two)::

    >>> import numpy as np
    >>> C1, C2 = 2.0 * np.eye(3), np.eye(2)
    >>> Kc = cotraining_kernel([(np.arange(3), C1), (np.array([1, 2]), C2)], 3)
    >>> [round(float(v), 3) for v in np.diag(Kc)]  # 1 / (1/2 + 1) where both views see it
    [2.0, 0.667, 0.667]

:func:`cotraining_gp` is the same kernel as a NumPyro model, for type-II ML of every view's
hyperparameters by SVI with an empty guide.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import numpyro
import numpyro.distributions as dist
from jax import Array
from numpyro.distributions import constraints

from fedppl.models.kernels import se

__all__ = ["cotraining_kernel", "cotraining_gp"]

Block = tuple[np.ndarray | Array, Array]  # (the view's points among all n, their covariance)


def cotraining_kernel(blocks: Sequence[Block], n: int) -> Array:
    """``[sum_v E_v C_v^-1 E_v^T]^-1`` over ``n`` points (see module doc)."""
    if not blocks:
        raise ValueError("the co-training kernel needs at least one view")
    covered = np.zeros(n, bool)
    for idx, C in blocks:
        idx = np.asarray(idx)
        if C.shape != (len(idx), len(idx)):
            raise ValueError(f"a view covers {len(idx)} points but its covariance is {C.shape}")
        covered[idx] = True
    if not covered.all():
        raise ValueError(f"points {np.nonzero(~covered)[0][:5].tolist()} are seen by no view: "
                         "their covariance is undefined")
    full = next((i for i, (idx, _) in enumerate(blocks) if len(np.unique(idx)) == n), None)
    if full is not None:
        return _woodbury(blocks, full, n)
    precision = jnp.zeros((n, n))
    for idx, C in blocks:
        chol = jnp.linalg.cholesky(C)
        precision = precision.at[jnp.ix_(idx, idx)].add(jsl.cho_solve((chol, True),
                                                                      jnp.eye(len(idx))))
    chol = jnp.linalg.cholesky(precision)
    return jsl.cho_solve((chol, True), jnp.eye(n))


def _woodbury(blocks: Sequence[Block], full: int, n: int) -> Array:
    idx1, C1 = blocks[full]
    order = np.argsort(np.asarray(idx1))
    C1 = C1[np.ix_(order, order)]  # C1 in the natural order of the n points
    rest = [b for i, b in enumerate(blocks) if i != full]
    if not rest:
        return C1
    cols = np.concatenate([np.asarray(idx) for idx, _ in rest])
    B = jsl.block_diag(*[C for _, C in rest])
    C1U = C1[:, cols]
    inner = B + C1U[cols, :]
    return C1 - C1U @ jnp.linalg.solve(inner, C1U.T)


def cotraining_gp(views: Sequence[Array], obs_idx: Array, y_obs: Array | None = None) -> None:
    """A NumPyro GP with the co-training kernel over views that each see all points.

    ``views[v]`` holds view v's covariates for all n points (labelled first or anywhere:
    ``obs_idx`` says which are labelled). Each view has an SE-ARD kernel whose lengthscales,
    variance and noise are NumPyro params, so type-II ML is SVI with an empty guide.
    """
    n = views[0].shape[0]
    blocks = []
    for v, X in enumerate(views):
        ell = numpyro.param(f"lengthscale_{v}", jnp.ones(X.shape[1]),
                            constraint=constraints.positive)
        var = numpyro.param(f"variance_{v}", 1.0, constraint=constraints.positive)
        noise = numpyro.param(f"noise_{v}", 0.3, constraint=constraints.positive)
        blocks.append((np.arange(n), se(X, X, ell, var) + noise**2 * jnp.eye(n)))
    Kc = cotraining_kernel(blocks, n)
    K_obs = Kc[jnp.ix_(obs_idx, obs_idx)]
    numpyro.sample("y", dist.MultivariateNormal(jnp.zeros(len(obs_idx)), K_obs), obs=y_obs)
