"""fedppl's Pyro port: the core's federated inference for Pyro models.

Everything that does not touch the PPL is the core's, in JAX (the natural-parameter algebra, the
local steps' iterations, the server and its acceptance rule, the schedules and runtimes, the
round log, results); the port supplies what touches Pyro: messengers
(:mod:`fedppl.pyro.handlers`), site tracing (:mod:`fedppl.pyro.sites`), the guide
(:class:`PVIGuide`: sites, constraints, the prior's Gaussian base) and each client's log
density, gradient and Hessian, evaluated by torch and called from the core's compiled rounds
(:mod:`fedppl.pyro.bridge`). It takes the same :class:`fedppl.Clients`; ``rng_key`` is a
``torch.Generator`` and results hold torch tensors. It needs the ``pyro`` extra:
``pip install 'fedppl[pyro]'``.

Example::

    >>> import torch, numpy as np, pyro, pyro.distributions as dist, fedppl
    >>> import fedppl.pyro as fp
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)
    >>> X = np.random.default_rng(0).normal(size=(40, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2), num_clients=4, seed=0)
    >>> pvi = fp.PVI(model, fp.PVIGuide(model, family="fullrank", dtype=torch.float32),
    ...              schedule="synchronous")
    >>> result = pvi.run(torch.Generator().manual_seed(0), clients, 2, progress_bar=False)
    >>> result.sample(torch.Generator().manual_seed(1), 500)["w"].shape
    torch.Size([500, 2])
"""

try:
    import pyro as _pyro  # noqa: F401
    import torch as as_torch  # noqa: F401
except ImportError as _err:  # pragma: no cover - depends on the environment
    raise ImportError("fedppl.pyro needs torch and Pyro, from the pyro extra: "
                      "pip install 'fedppl[pyro]'") from _err

from fedppl.pyro import families, handlers
from fedppl.pyro.ep import EP, EPResult
from fedppl.pyro.guides import CAVI, PVIGuide
from fedppl.pyro.infer import PVI, GlobalVI, PVIResult

__all__ = ["PVI", "GlobalVI", "EP", "PVIResult", "EPResult", "PVIGuide", "CAVI", "handlers",
           "families"]
