"""Export a fedppl result to ArviZ, with a ``client`` dimension for the client factors.

Example::

    >>> import jax, numpy as np, fedppl
    >>> from fedppl.models import linear_regression as model
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(60, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2), num_clients=3, seed=0)
    >>> result = fedppl.PVI(model, fedppl.PVIGuide(model)).run(
    ...     jax.random.key(0), clients, num_rounds=1, progress_bar=False)
    >>> idata = result.to_arviz(jax.random.key(0), num_samples=100)
    >>> idata.posterior["w"].shape                   # (chain, draw, w_dim_0)
    (1, 100, 2)
    >>> idata.constant_data["factor_nat1"].dims      # each t_k in natural parameters, per client
    ('client', 'theta')
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np

from fedppl.families import gaussian as g

if TYPE_CHECKING:  # pragma: no cover
    from fedppl.infer.variational import PVIResult

__all__ = ["to_inference_data"]


def _arviz():
    try:
        import arviz
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("ArviZ export needs the arviz extra: pip install 'fedppl[arviz]'") from e
    return arviz


def to_inference_data(result: PVIResult, rng_key=None, num_samples: int = 1000):
    """Posterior draws (one chain), per-client factor precisions and run history.

    Local sites (a client's random effects) carry a ``client`` dimension after ``draw``.

    The factors are exported as their natural parameters over the flat unconstrained vector
    (``factor_nat1``, ``factor_prec``), since a factor need not be a normalisable distribution.
    The history entries a result names in ``client_stats`` (EP: its sampler's ``rhat``, ``ess``
    and ``mc_error``) go to ``constant_data`` as ``last_<name>``, the last round's value per
    client (dimension ``client``).
    """
    az = _arviz()
    rng_key = jax.random.key(0) if rng_key is None else rng_key
    # every client's local sites, drawn given the same draws of the global ones
    draws = result.guide.sample(rng_key, result.q, num_samples, result.local)
    draws = {k: np.asarray(v)[None] for k, v in draws.items()}
    nat1 = np.asarray(result.factors.nat1)
    prec = np.asarray(result.factors.prec)
    full = isinstance(result.factors, g.FullGaussian)
    constant = {"factor_nat1": nat1, "factor_prec": prec}
    dims = {"factor_nat1": ["client", "theta"],
            "factor_prec": ["client", "theta", "theta_"] if full else ["client", "theta"]}
    coords = {"client": list(result.client_names) or list(range(nat1.shape[0]))}
    if result.local is not None:
        for site in result.guide.local_layout.sites:
            dims[site.name] = ["client"] + [f"{site.name}_dim_{i}" for i in range(len(site.shape))]
    for key in result.client_stats:  # per-client statistics of the last round
        values = result.history.get(key)
        if values is not None and len(values):
            constant[f"last_{key}"] = np.asarray(values[-1])
            dims[f"last_{key}"] = ["client"]
    idata = az.from_dict(posterior=draws, constant_data=constant, coords=coords, dims=dims)
    fe = result.history.get("free_energy")
    if fe is not None and len(fe):
        idata.posterior.attrs["final_local_free_energy"] = np.asarray(fe[-1]).tolist()
        idata.posterior.attrs["num_rounds"] = len(fe)
    for key in ("converged", "kl_change"):
        values = result.history.get(key)
        if values is not None and len(values):
            idata.posterior.attrs[f"final_{key}"] = np.asarray(values[-1]).tolist()
    return idata
