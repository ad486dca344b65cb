"""llama.cpp's ``q4_0`` KV cache type, for keys and values (``llama-server -ctk q4_0 -ctv q4_0``).

Block math and layout: :mod:`bytediet.kvcache.ggml_block`. Mix it with another type through a split spec,
e.g. llama.cpp's usual ``k=q8_0,v=q4_0``.
"""
from __future__ import annotations

from .base import KV_CODECS
from .ggml_block import ggml_codec_class

Q4_0Codec = KV_CODECS.register("q4_0")(ggml_codec_class("q4_0"))
