"""Federated algorithms as pure init / client_update / server_update functions."""

from fedppl.algorithms import conjugate, pvi

__all__ = ["conjugate", "pvi"]
