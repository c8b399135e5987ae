"""Turning logits into tokens: the sampler, and the exact verification of draft tokens
(chains: rejection sampling; trees: tree verification), which sits beside it as in vLLM."""

from jaxserve.sample.rejection_sampler import VerifyOutput, verify
from jaxserve.sample.sampler import SamplerOutput, SamplingMetadata, sample
from jaxserve.sample.tree_verify import TreeVerifyOutput, verify_tree

__all__ = ["SamplerOutput", "SamplingMetadata", "TreeVerifyOutput", "VerifyOutput", "sample", "verify", "verify_tree"]
