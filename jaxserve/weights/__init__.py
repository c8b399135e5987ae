"""Weights: from a Hugging Face folder, a GGUF file or a hub id, into a `DecoderLM`.

`load_model` and `LoadedModel` are imported when first used: the weight cache's tools
(`jaxserve.weights.cache`, `cache_admin`, `sizes`) import no jax.
"""

__all__ = ["LoadedModel", "load_model"]


def __getattr__(name: str):
    if name in __all__:
        from jaxserve.weights import load

        return getattr(load, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
