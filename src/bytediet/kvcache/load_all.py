"""Import every built-in codec module so that each registers itself. Add one line per new codec file."""
from . import full  # noqa: F401
from . import int8  # noqa: F401
from . import turboquant  # noqa: F401
from . import fp8  # noqa: F401
from . import qjl  # noqa: F401
from . import kivi  # noqa: F401
from . import polarquant  # noqa: F401
