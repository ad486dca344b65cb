"""Models: checkpoint readers, architecture adapters, the transformer, tokenizers."""
from . import gemma3, llama  # noqa: F401  (register the architecture adapters)
