"""Structured output: a grammar per request masks the tokens the sampler may draw.

`backend.py` turns a `StructuredOutputsParams` into a compiled grammar and per-sequence
matchers (llguidance behind a small protocol); `compiler.py` compiles off the step loop
in a thread pool, cached by the spec; `request_grammar.py` is what a request carries:
its compile future and, once that resolves, its own matcher.
"""


class GrammarError(ValueError):
    """The structured_outputs spec cannot be compiled (invalid schema, regex or grammar, or
    an unsupported JSON-schema feature): `kind` says which field, `detail` what is wrong."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"invalid structured_outputs.{kind}: {detail}")
        self.kind, self.detail = kind, detail


from jaxserve.structured.compiler import GrammarCompiler  # noqa: E402
from jaxserve.structured.request_grammar import RequestGrammar  # noqa: E402

__all__ = ["GrammarCompiler", "GrammarError", "RequestGrammar"]
