"""The one error of structured output."""


class GrammarError(ValueError):
    """The structured_outputs spec cannot be compiled (invalid schema, regex or grammar, or
    an unsupported JSON-schema feature): `kind` says which field, `detail` what is wrong."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"invalid structured_outputs.{kind}: {detail}")
        self.kind, self.detail = kind, detail
