"""Import every built-in weight-format module so that each registers itself. One line per format file."""
from . import unquantized  # noqa: F401
