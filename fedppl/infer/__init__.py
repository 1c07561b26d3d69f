"""The public front: one object per federated method, all with numpyro ``SVI``'s shape."""

from fedppl.infer.bayesian_regression import FedBNR
from fedppl.infer.fedavg_gp import FSGPConfig, fit_fsgp
from fedppl.infer.sparse_gps import SGPConfig, fit_sgp
from fedppl.infer.variational import PVI, GlobalVI, PVIResult

__all__ = ["PVI", "GlobalVI", "PVIResult", "FedBNR", "fit_sgp", "SGPConfig", "fit_fsgp",
           "FSGPConfig"]
