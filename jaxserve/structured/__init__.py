"""Structured output: a grammar per request masks the tokens the sampler may draw.

`llguidance.py` turns a `StructuredOutputsParams` into a compiled grammar and per-sequence
matchers (llguidance behind a small protocol); `compiler.py` compiles off the step loop
in a thread pool, cached by the spec; `request_grammar.py` is what a request carries:
its compile future and, once that resolves, its own matcher.
"""

from jaxserve.structured.compiler import GrammarCompiler
from jaxserve.structured.errors import GrammarError
from jaxserve.structured.request_grammar import RequestGrammar

__all__ = ["GrammarCompiler", "GrammarError", "RequestGrammar"]
