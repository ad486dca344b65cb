"""Import every built-in codec module so that each registers itself. Add one line per new codec file."""
from . import full  # noqa: F401
from . import int8  # noqa: F401
from . import turboquant  # noqa: F401
