"""Exponential-family algebra in natural parameters (Gaussian, LogNormal)."""

from fedppl.families import gaussian, lognormal
from fedppl.families.gaussian import DiagGaussian, FullGaussian, Gaussian

__all__ = ["gaussian", "lognormal", "DiagGaussian", "FullGaussian", "Gaussian"]
