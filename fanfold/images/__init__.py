"""Building EnvSpecs into content-addressed layers, and the images that stack them; pulling and
importing images (``fanfold.images.oci``, loaded when first used)."""

from .store import Healthcheck, Image, LayerStore

__all__ = ["Healthcheck", "Image", "LayerStore"]
