"""Federated algorithms as pure init / client_update / server_update functions."""

from fedppl.algorithms import conjugate, natural_gradient, pvi

__all__ = ["conjugate", "natural_gradient", "pvi"]
