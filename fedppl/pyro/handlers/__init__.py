"""Pyro messengers for federated inference (one per file); each dispatches ``_pyro_sample``."""

from fedppl.pyro.handlers.cavity import cavity
from fedppl.pyro.handlers.client import client
from fedppl.pyro.handlers.polya_gamma import polya_gamma
from fedppl.pyro.handlers.substitute import substitute
from fedppl.pyro.handlers.tempered import tempered

__all__ = ["cavity", "client", "polya_gamma", "tempered", "substitute"]
