"""Idiomatic NumPyro models with inhomogeneous federated data generators (see :mod:`.models`)."""

from .models import GALLERY, NUM_CLIENTS, Entry

__all__ = ["Entry", "GALLERY", "NUM_CLIENTS"]
