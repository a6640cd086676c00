"""The proposer (worker side) and the draft policy (scheduler side) an EngineConfig asks for."""
from __future__ import annotations

from tokenmill.spec_decode.adaptive import DraftPolicy
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import NgramProposer


def build_proposer(spec: SpeculativeConfig | None):
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    raise ValueError(f"speculative method {spec.method!r} is not implemented yet; use 'ngram'")


def build_draft_policy(spec: SpeculativeConfig | None) -> DraftPolicy | None:
    return None if spec is None else DraftPolicy(spec.num_speculative_tokens, spec.adaptive)
