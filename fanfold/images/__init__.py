"""Building EnvSpecs into content-addressed layers, and the images that stack them."""

from .store import Image, LayerStore

__all__ = ["Image", "LayerStore"]
