"""KV-cache codecs, chosen by name from :data:`KV_CODECS`."""
from .base import KV_CODECS, AttentionMetadata, KVCodec, LayerKVCache, get_kv_codec

__all__ = ["KV_CODECS", "AttentionMetadata", "KVCodec", "LayerKVCache", "get_kv_codec"]
