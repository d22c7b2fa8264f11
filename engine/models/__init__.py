"""The DiT families (engine/models/family.py) and their models; importing this package registers them."""
from . import demo, ernie_image, zimage  # noqa: F401  (registers the ERNIE-Image and Z-Image families, the demo's bundle)
from .family import Companions, Family, Latent, detect, families, family_of, get, register, unregister

__all__ = ["Companions", "Family", "Latent", "detect", "families", "family_of", "get", "register", "unregister"]
