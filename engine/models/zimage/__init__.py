"""Z-Image (Tongyi-MAI): its DiT and configuration; importing this package registers the family."""
from .config import ZImageConfig
from .model import FAMILY, ZImageTransformer

__all__ = ["FAMILY", "ZImageConfig", "ZImageTransformer"]
