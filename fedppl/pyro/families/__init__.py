"""Natural-parameter algebra in torch (Gaussian, Polya-Gamma)."""

from fedppl.pyro.families import gaussian, polya_gamma
from fedppl.pyro.families.gaussian import DiagGaussian, FullGaussian, Gaussian

__all__ = ["gaussian", "polya_gamma", "DiagGaussian", "FullGaussian", "Gaussian"]
