"""The public front: one object per federated method, all with numpyro ``SVI``'s shape
(``init`` / ``update`` / ``run``, see :mod:`fedppl.infer.base`), each over a trio of pure
functions in :mod:`fedppl.algorithms` that the runtime drives."""

from fedppl.infer.base import FederatedMethod, Result, RunState
from fedppl.infer.bayesian_regression import FedBNR, FedBNRResult
from fedppl.infer.co_training import CoTraining, CoTrainingResult
from fedppl.infer.ep import EP, EPResult
from fedppl.infer.fedavg_gp import FSGP, FSGPConfig, FSGPResult
from fedppl.infer.importance import Importance, ImportanceResult
from fedppl.infer.multitask_gp import PFedMul, PFedMulResult
from fedppl.infer.one_shot import OneShot, OneShotResult
from fedppl.infer.smc import SMC, SMCResult
from fedppl.infer.sparse_gps import FederatedSGP, SGPConfig, SGPResult
from fedppl.infer.variational import PVI, GlobalVI, PVIResult

__all__ = ["FederatedMethod", "Result", "RunState", "PVI", "GlobalVI", "PVIResult",
           "FederatedSGP", "SGPConfig", "SGPResult", "FSGP", "FSGPConfig", "FSGPResult",
           "FedBNR", "FedBNRResult", "PFedMul", "PFedMulResult", "CoTraining",
           "CoTrainingResult", "EP", "EPResult", "OneShot", "OneShotResult", "Importance",
           "ImportanceResult", "SMC", "SMCResult"]
