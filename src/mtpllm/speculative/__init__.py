"""Speculative decoding: proposers (MTP, draft model, n-gram) and one lossless verifier."""
from .config import SpecConfig, parse_speculative_json
from .verifier import SpeculativeDecoder, SpecStats

__all__ = ["SpecConfig", "parse_speculative_json", "SpeculativeDecoder", "SpecStats"]
