"""Tools that change a model, above the model and the engine: weight calibration (AWQ, GPTQ, SmoothQuant,
Wanda, SparseGPT), scale folding, mixed precision, KV-codec calibration and GGUF export.

Calibration methods are chosen by name from :data:`CALIBRATION_METHODS`; each registers itself when this
package is imported. Methods take token windows; the caller cuts them from a corpus
(:func:`bytediet.eval.corpus.calibration_windows`), so nothing here reads text.
"""

from .base import (
    CALIBRATION_METHODS,
    CalibrationConfig,
    calibrate_and_quantize,
    calibration_method_names,
    get_calibration_method,
)

# every built-in method registers itself here, when the package is imported (one line per method file)
# isort: off
from . import awq
from . import gptq
from . import smoothquant
from . import wanda
from . import sparsegpt
# isort: on

__all__ = [
    "CALIBRATION_METHODS",
    "CalibrationConfig",
    "calibrate_and_quantize",
    "calibration_method_names",
    "get_calibration_method",
]
