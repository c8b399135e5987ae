"""transformers' `PreTrainedTokenizerFast`, imported without its advice that torch is missing.

jaxserve uses transformers for tokenizers only, and never needs torch; without torch,
`import transformers` advises at every start that its models are unavailable. The advice
is silenced for that one import (TRANSFORMERS_NO_ADVISORY_WARNINGS, unless the user set
it), and the environment is left as it was: nothing changes for the rest of the process.
"""

from __future__ import annotations

import os
import sys

_NO_ADVICE = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def fast_tokenizer_class() -> type:
    """`transformers.PreTrainedTokenizerFast` (not AutoTokenizer: that imports torch when it is installed)."""
    if "transformers" not in sys.modules and _NO_ADVICE not in os.environ:
        os.environ[_NO_ADVICE] = "1"  # read when transformers' __init__ runs, and only then
        try:
            import transformers  # noqa: F401
        finally:
            del os.environ[_NO_ADVICE]
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast
