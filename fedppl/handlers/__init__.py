"""Effect handlers for federated inference (one per file)."""

from fedppl.handlers.cavity import cavity
from fedppl.handlers.client import client
from fedppl.handlers.tempered import tempered

__all__ = ["cavity", "client", "tempered"]
