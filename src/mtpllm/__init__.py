"""mtpllm: LLM inference with Multi-Token Prediction speculative decoding."""
__version__ = "0.1.0"
