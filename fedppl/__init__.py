"""fedppl: federated Bayesian inference as NumPyro effect handlers and guides.

Every method is an object with numpyro ``SVI``'s shape (``init`` / ``update`` / ``run``) over
a trio of pure functions that the runtime drives; see :mod:`fedppl.infer`.

Example::

    >>> import jax, numpy as np, fedppl
    >>> from fedppl.models import linear_regression as model
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(100, 2))
    >>> clients = fedppl.partition.homogeneous(X, X @ np.ones(2), num_clients=5, seed=0)
    >>> result = fedppl.PVI(model, fedppl.PVIGuide(model)).run(jax.random.key(0), clients,
    ...                                                        num_rounds=2, progress_bar=False)
    >>> sorted(result.sample(jax.random.key(1), 10))
    ['b', 'w']
"""

from fedppl import datasets, families, handlers, metrics, partition
from fedppl.algorithms.dp_pvi import DPLocalAveraging, DPOptimisation, DPVirtualParties
from fedppl.algorithms.dp_statistics import PrivateStatistics
from fedppl.clients import Clients
from fedppl.guides import PVIGuide
from fedppl.infer import (
    FSGP,
    PVI,
    SMC,
    CoTraining,
    CoTrainingResult,
    FedBNR,
    FedBNRResult,
    FederatedSGP,
    FSGPConfig,
    FSGPResult,
    GlobalVI,
    Importance,
    ImportanceResult,
    PFedMul,
    PFedMulResult,
    PVIResult,
    SGPConfig,
    SGPResult,
    SMCResult,
)
from fedppl.infer.ep import EP, EPResult
from fedppl.infer.one_shot import OneShot, OneShotResult

__version__ = "0.1.0"

__all__ = ["PVI", "GlobalVI", "PVIResult", "EP", "EPResult", "OneShot", "OneShotResult",
           "Importance", "ImportanceResult", "SMC", "SMCResult", "PVIGuide", "FederatedSGP",
           "SGPConfig", "SGPResult", "FSGP", "FSGPConfig", "FSGPResult", "FedBNR", "FedBNRResult",
           "PFedMul", "PFedMulResult", "CoTraining", "CoTrainingResult", "DPOptimisation",
           "DPLocalAveraging", "DPVirtualParties", "PrivateStatistics", "Clients", "partition",
           "handlers", "families", "metrics", "datasets", "__version__"]
