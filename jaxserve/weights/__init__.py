"""Weights: from a Hugging Face folder, a GGUF file or a hub id, into a `DecoderLM`."""

from jaxserve.weights.load import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
