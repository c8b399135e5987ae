"""Speculative decoding: proposers of draft tokens and their exact verification."""

from jaxserve.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
