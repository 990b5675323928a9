"""Tiny random model pairs built in code, for mechanics tests and examples (never for figures)."""

from .tiny import save_tiny_pair, tiny_eagle3_head, tiny_llama_pair

__all__ = ["tiny_llama_pair", "save_tiny_pair", "tiny_eagle3_head"]
