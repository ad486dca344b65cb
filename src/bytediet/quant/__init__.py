"""Weight formats, chosen by name from :data:`WEIGHT_FORMATS`; one file each, registered on import."""

from .base import WEIGHT_FORMATS, Packed, WeightFormat, build_format, get_weight_format

# every built-in format registers itself here, when the package is imported (one line per format file)
# isort: off
from . import unquantized
from . import int8
from . import int4
from . import fp8
from . import mxfp4
from . import nvfp4
from . import gguf_blocks
from . import sparse24
from . import unstructured
# isort: on

__all__ = ["WEIGHT_FORMATS", "Packed", "WeightFormat", "build_format", "get_weight_format"]
