"""Export a Pyro-port result to ArviZ 1.x (an ``xarray.DataTree``), with a ``client`` dimension
for the client factors (the twin of :mod:`fedppl.arviz`).

Example::

    >>> import torch, numpy as np, fedppl, pyro, pyro.distributions as dist
    >>> from fedppl.pyro import PVI, PVIGuide
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Normal(X @ w, 1.0), obs=y)
    >>> X = np.random.default_rng(0).normal(size=(30, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2), num_clients=3, seed=0)
    >>> result = PVI(model, PVIGuide(model)).run(torch.Generator().manual_seed(0), clients, 1,
    ...                                          progress_bar=False)
    >>> dt = result.to_arviz(torch.Generator().manual_seed(0), num_samples=100)
    >>> dt.posterior["w"].shape, dt.constant_data["factor_nat1"].dims      # 4 chains
    ((4, 25, 2), ('client', 'theta'))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedppl import arviz
from fedppl.pyro.families import gaussian as g

if TYPE_CHECKING:  # pragma: no cover
    from fedppl.pyro.result import PVIResult

__all__ = ["to_inference_data"]


def to_inference_data(result: PVIResult, rng_key: torch.Generator | None = None,
                      num_samples: int = 1000):
    """Posterior draws (4 chains of ``num_samples / 4``; local sites with a ``client``
    dimension after ``draw``), the factors' natural parameters per client, and the run's final
    diagnostics as attributes (the layout of :func:`fedppl.arviz.to_inference_data`)."""
    num_samples = arviz.check_num_samples(num_samples)
    gen = torch.Generator().manual_seed(0) if rng_key is None else rng_key
    draws = result.guide.sample(gen, result.q, num_samples, result.local)
    posterior = {k: arviz.as_chains(v.detach().numpy()) for k, v in draws.items()}
    nat1, prec = (x.detach().numpy() for x in result.factors)
    full = isinstance(result.factors, g.FullGaussian)
    dims = {"factor_nat1": ["client", "theta"],
            "factor_prec": ["client", "theta", "theta_"] if full else ["client", "theta"]}
    coords: dict[str, list] = {"client": list(result.client_names) or list(range(nat1.shape[0]))}
    if result.local is not None:
        assert result.guide.local_layout is not None
        for site in result.guide.local_layout.sites:
            dims[site.name] = ["client"] + [f"{site.name}_dim_{i}" for i in range(len(site.shape))]
    return arviz.from_dict({"posterior": posterior,
                            "constant_data": {"factor_nat1": nat1, "factor_prec": prec}},
                           coords=coords, dims=dims,
                           attrs={"posterior": arviz.history_attrs(result.history)})
