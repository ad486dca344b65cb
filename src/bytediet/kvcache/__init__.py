"""KV-cache codecs, chosen by name from :data:`KV_CODECS`; one file each, registered on import."""
from .base import KV_CODECS, AttentionMetadata, KVCodec, LayerKVCache, default_block_size, get_kv_codec

# every built-in codec registers itself here, when the package is imported (one line per codec file)
from . import full  # noqa: E402,F401  isort: skip
from . import int8  # noqa: E402,F401  isort: skip
from . import turboquant  # noqa: E402,F401  isort: skip
from . import fp8  # noqa: E402,F401  isort: skip
from . import fp8_vllm  # noqa: E402,F401  isort: skip
from . import qjl  # noqa: E402,F401  isort: skip
from . import kivi  # noqa: E402,F401  isort: skip
from . import polarquant  # noqa: E402,F401  isort: skip
from . import ggml_block  # noqa: E402,F401  isort: skip  (q8_0, q5_0, q4_1, q4_0)
from . import hfquant  # noqa: E402,F401  isort: skip
from . import rotated  # noqa: E402,F401  isort: skip  (after int8 and ggml_block, whose halves it rotates)

__all__ = ["KV_CODECS", "AttentionMetadata", "KVCodec", "LayerKVCache", "default_block_size", "get_kv_codec"]
