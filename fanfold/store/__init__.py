"""Layers and images on disk: the content-addressed store (``layers``) and the root filesystems
overlayfs assembles from its layers (``rootfs``). Images are built and pulled into it by
``fanfold.images``; the backends mount sandboxes from it."""

from .layers import Image, LayerStore

__all__ = ["Image", "LayerStore"]
