"""Small, compile-friendly model definitions used by the end-to-end benchmark (`tilefish bench e2e`)."""
from .llama import LlamaConfig, LlamaForCausalLM

__all__ = ["LlamaConfig", "LlamaForCausalLM"]
