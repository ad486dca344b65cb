"""Weight formats, chosen by name from :data:`WEIGHT_FORMATS`; one file each, registered on import."""
from .base import WEIGHT_FORMATS, Packed, WeightFormat, build_format, get_weight_format

# every built-in format registers itself here, when the package is imported (one line per format file)
from . import unquantized  # noqa: E402,F401  isort: skip
from . import int8  # noqa: E402,F401  isort: skip
from . import int4  # noqa: E402,F401  isort: skip
from . import fp8  # noqa: E402,F401  isort: skip
from . import mxfp4  # noqa: E402,F401  isort: skip
from . import nvfp4  # noqa: E402,F401  isort: skip
from . import gguf_blocks  # noqa: E402,F401  isort: skip
from . import sparse24  # noqa: E402,F401  isort: skip
from . import unstructured  # noqa: E402,F401  isort: skip

__all__ = ["WEIGHT_FORMATS", "Packed", "WeightFormat", "build_format", "get_weight_format"]
