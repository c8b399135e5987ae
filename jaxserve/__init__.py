"""jaxserve: an LLM inference and serving engine in JAX."""
