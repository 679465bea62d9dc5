"""Building EnvSpecs into content-addressed layers, and the images that stack them; pulling and
importing images (``fanfold.images.oci``, loaded when first used). Layers and images are kept in
``fanfold.store``, whose ``Image`` and ``LayerStore`` are named here too."""

from ..store import Image, LayerStore
from ..store.layers import Healthcheck

__all__ = ["Healthcheck", "Image", "LayerStore"]
