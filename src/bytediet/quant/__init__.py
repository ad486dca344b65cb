"""Weight formats, chosen by name from :data:`WEIGHT_FORMATS`."""
from .base import WEIGHT_FORMATS, Packed, WeightFormat, get_weight_format

__all__ = ["WEIGHT_FORMATS", "Packed", "WeightFormat", "get_weight_format"]
