"""Coral: cost-efficient multi-LLM serving on mixed cloud GPUs, planned offline and re-allocated online."""

__version__ = "0.1.0"
