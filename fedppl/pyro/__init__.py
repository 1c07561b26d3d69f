"""fedppl's Pyro port: federated inference for Pyro models, with torch and ``pyro.poutine``.

It mirrors the NumPyro core layer by layer (natural-parameter algebra, messengers, the PVI
guide, the PVI trio and its front) and takes the same :class:`fedppl.Clients`; it shares no code
with the JAX side beyond pure-NumPy helpers (``fedppl.partition``, ``fedppl.Clients``' arrays,
``fedppl.validation.positive_int``). It needs the ``pyro`` extra: ``pip install 'fedppl[pyro]'``.

Example::

    >>> import torch, numpy as np, pyro, pyro.distributions as dist, fedppl
    >>> import fedppl.pyro as fp
    >>> def model(X, y=None):
    ...     w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    ...     with pyro.plate("data", X.shape[0]):
    ...         pyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)
    >>> X = np.random.default_rng(0).normal(size=(40, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2), num_clients=4, seed=0)
    >>> pvi = fp.PVI(model, fp.PVIGuide(model, family="fullrank", dtype=torch.float64),
    ...              schedule="synchronous")
    >>> result = pvi.run(torch.Generator().manual_seed(0), clients, 2, progress_bar=False)
    >>> result.sample(torch.Generator().manual_seed(1), 500)["w"].shape
    torch.Size([500, 2])
"""

try:
    import pyro as _pyro  # noqa: F401
    import torch as _torch  # noqa: F401
except ImportError as _err:  # pragma: no cover - depends on the environment
    raise ImportError("fedppl.pyro needs torch and Pyro, from the pyro extra: "
                      "pip install 'fedppl[pyro]'") from _err

from fedppl.pyro import families, handlers
from fedppl.pyro.guides import CAVI, PVIGuide
from fedppl.pyro.infer import PVI, GlobalVI, PVIResult

__all__ = ["PVI", "GlobalVI", "PVIResult", "PVIGuide", "CAVI", "handlers", "families"]
