"""Drafters: plug-ins that propose tokens for the target to verify (one file each)."""

from __future__ import annotations

from typing import Any

from constrained_spec.config import SpeculativeConfig
from constrained_spec.drafters.base import Drafter, DraftState, GrammarCursor
from constrained_spec.drafters.draft_model import DraftModelDrafter, load_draft_model
from constrained_spec.drafters.forced import ForcedDrafter
from constrained_spec.drafters.ngram import NgramDrafter
from constrained_spec.errors import ConfigError

__all__ = [
    "DraftModelDrafter",
    "DraftState",
    "Drafter",
    "ForcedDrafter",
    "GrammarCursor",
    "NgramDrafter",
    "make_drafter",
]


def make_drafter(config: SpeculativeConfig | None, model: Any) -> Drafter | None:
    """The model drafter ``config.method`` names for the target ``model`` (a ``LoadedModel``);
    the forced drafter is the engine's own."""
    if config is None or config.method is None or config.num_speculative_tokens == 0:
        return None
    if config.method == "ngram":
        return NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min)
    if config.method == "draft_model":
        return load_draft_model(config.model, model)
    if config.method in ("eagle3", "mtp"):
        from constrained_spec.drafters.feature import load_feature_drafter

        return load_feature_drafter(config.method, config.model, model)
    raise ConfigError(f"unknown method {config.method!r}", option="speculative.method")
