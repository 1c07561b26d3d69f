"""Guides whose distribution is a prior times per-client factors (Pyro)."""

from fedppl.pyro.guides.cavi import CAVI
from fedppl.pyro.guides.pvi_guide import PVIGuide

__all__ = ["PVIGuide", "CAVI"]
