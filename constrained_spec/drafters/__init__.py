"""Drafters: plug-ins that propose tokens for the target to verify (one file each)."""

from __future__ import annotations

from typing import Any

from ..config import SpeculativeConfig
from ..errors import ConfigError
from .base import DraftState, Drafter, GrammarCursor
from .draft_model import DraftModelDrafter, load_draft_model
from .forced import ForcedDrafter
from .ngram import NgramDrafter

__all__ = ["DraftState", "Drafter", "GrammarCursor", "DraftModelDrafter", "ForcedDrafter",
           "NgramDrafter", "make_drafter"]


def make_drafter(config: SpeculativeConfig | None, model: Any) -> Drafter | None:
    """The model drafter ``config.method`` names for the target ``model`` (a ``LoadedModel``);
    the forced drafter is the engine's own."""
    if config is None or config.method is None or config.num_speculative_tokens == 0:
        return None
    if config.method == "ngram":
        return NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min)
    if config.method == "draft_model":
        return load_draft_model(config.model, model)
    raise ConfigError(f"method {config.method!r} is not available in this version; use 'ngram' "
                      "or 'draft_model' (or method=None for forced tokens only)",
                      option="speculative.method")
