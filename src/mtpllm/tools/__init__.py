"""Tools over GGUF files: inspect, doctor."""
