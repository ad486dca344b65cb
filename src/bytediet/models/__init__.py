"""Models: checkpoint readers, architecture adapters, the transformer, tokenizers."""

from . import gemma3, llama, mixtral, olmoe, qwen2_moe  # register the architecture adapters
