"""Guides whose distribution is a prior times per-client factors."""

from fedppl.guides.pvi_guide import PVIGuide

__all__ = ["PVIGuide"]
