"""Container images as task environments: an image reference (reference.py) is read without unpacking it
(archive.py), unpacked safely with OCI layer semantics (unpack.py) into a content-addressed, node-local cache
(cache.py), and fetched or built through podman or skopeo when it is named rather than given as a file (podman.py).
"""

from gyre_slurm.images.archive import ImageConfig, ImageSource, Layer, open_image
from gyre_slurm.images.cache import Image, ImageCache
from gyre_slurm.images.reference import ImageRef, parse_ref
from gyre_slurm.images.unpack import LayerStats, UnpackStats, apply_layer, unpack_image

__all__ = ["Image", "ImageCache", "ImageConfig", "ImageRef", "ImageSource", "Layer", "LayerStats", "UnpackStats",
           "apply_layer", "open_image", "parse_ref", "unpack_image"]
