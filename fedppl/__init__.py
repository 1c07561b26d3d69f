"""fedppl: federated Bayesian inference as NumPyro effect handlers and guides.

Example::

    >>> import fedppl
    >>> from fedppl.guides import PVIGuide
    >>> clients = fedppl.partition.homogeneous(X, y, num_clients=10, seed=0)
    >>> result = fedppl.PVI(model, PVIGuide(model)).run(jax.random.key(0), clients, num_rounds=10)
"""

from fedppl import datasets, families, handlers, metrics, partition
from fedppl.clients import Clients
from fedppl.infer.bayesian_regression import FedBNR
from fedppl.infer.fedavg_gp import FSGPConfig, fit_fsgp
from fedppl.guides import PVIGuide
from fedppl.infer.variational import PVI, GlobalVI, PVIResult
from fedppl.infer.sparse_gps import SGPConfig, fit_sgp

__version__ = "0.1.0"

__all__ = ["PVI", "GlobalVI", "PVIResult", "PVIGuide", "FedBNR", "fit_sgp", "SGPConfig",
           "fit_fsgp", "FSGPConfig", "Clients", "partition",
           "handlers", "families", "metrics", "datasets", "__version__"]
