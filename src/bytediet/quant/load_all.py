"""Import every built-in weight-format module so that each registers itself. One line per format file."""
from . import unquantized  # noqa: F401
from . import int8  # noqa: F401
from . import int4  # noqa: F401
from . import fp8  # noqa: F401
from . import mxfp4  # noqa: F401
from . import nvfp4  # noqa: F401
from . import gguf_blocks  # noqa: F401
from . import sparse24  # noqa: F401
