"""KV-cache codecs, chosen by name from :data:`KV_CODECS`; one file each, registered on import."""

from .base import KV_CODECS, AttentionMetadata, KVCodec, LayerKVCache, default_block_size, get_kv_codec

# every built-in codec registers itself here, when the package is imported (one line per codec file)
# isort: off
from . import full
from . import int8
from . import turboquant
from . import fp8
from . import fp8_vllm
from . import qjl
from . import kivi
from . import polarquant
from . import ggml_block  # q8_0, q5_0, q4_1, q4_0
from . import hfquant
from . import rotated  # after int8 and ggml_block, whose halves it rotates
# isort: on

__all__ = ["KV_CODECS", "AttentionMetadata", "KVCodec", "LayerKVCache", "default_block_size", "get_kv_codec"]
