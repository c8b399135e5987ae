"""Which proposer a speculative config asks for (the heavier ones are imported only when used)."""

from __future__ import annotations

from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.context import ProposerContext
from jaxserve.spec_decode.proposers import NgramProposer, Proposer


def make_proposer(config: SpeculativeConfig, context: ProposerContext) -> Proposer:
    """The proposer `config.method` names, over the target that `context` shows."""
    if config.method == "medusa":
        from jaxserve.spec_decode.medusa import MedusaProposer

        return MedusaProposer(config, context)
    if config.method in ("eagle", "eagle3"):
        from jaxserve.spec_decode.eagle import EagleProposer

        return EagleProposer(config, context)
    if config.method == "ngram":
        return NgramProposer(config)
    from jaxserve.spec_decode.draft_model import DraftModelProposer  # loads a second model

    return DraftModelProposer(config, context)
