"""bytediet: an LLM inference engine that makes data smaller, fewer and less moved."""
__version__ = "0.1.0"
