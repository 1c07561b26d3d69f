"""Effect handlers for federated inference (one per file)."""

from fedppl.handlers.cavity import cavity
from fedppl.handlers.client import client
from fedppl.handlers.polya_gamma import polya_gamma
from fedppl.handlers.tempered import tempered

__all__ = ["cavity", "client", "polya_gamma", "tempered"]
