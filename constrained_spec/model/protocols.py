"""The contracts between the engine, the model runners and the drafters.

The engine and the draft-model drafter call a model through `Runner`; the EAGLE-3 and MTP
drafters read the target's hidden states and weights through `FeatureSource`. Both are
structural (`typing.Protocol`): `runner.LeanRunner` is both; `runner.HFRunner` (any
transformers model, one cache per slot) is a `Runner` only, so a feature drafter on it is
refused with the ConfigError `feature_source` raises, before anything is read.

Shapes: V = the logits width (vocabulary, padding included), D = the hidden size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from constrained_spec.errors import ConfigError
from constrained_spec.model.families import FAMILIES


@runtime_checkable
class Runner(Protocol):
    """A model with a KV cache in slots (one per running request) and positions.

    ``forward`` appends ``tokens[i]`` to slot ``slots[i]`` after its current length, in one
    batched forward, and returns the logits of the last ``num_logits[i]`` appended positions
    of each slot, concatenated: float32 [sum(num_logits), V]. The cache is written by
    position, so ``truncate`` is all a rejected draft needs: the next forward overwrites it.
    """

    @property
    def vocab_size(self) -> int:
        """V, the width of the logits rows."""
        ...

    @property
    def max_context(self) -> int:
        """Positions a slot can hold (the model's context length)."""
        ...

    @property
    def slots_in_use(self) -> int:
        """Slots handed out and not freed yet (more than the running requests = a leak)."""
        ...

    def new_slot(self) -> int: ...

    def free_slot(self, slot: int) -> None: ...

    def length(self, slot: int) -> int: ...

    def truncate(self, slot: int, length: int) -> None: ...

    def forward(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                num_logits: Sequence[int]) -> torch.Tensor: ...


@runtime_checkable
class FeatureSource(Protocol):
    """The target's hidden states and weights, as a drafter head reads them.

    ``enable_features(layers)`` makes every later forward keep, per slot and position, the
    hidden states of ``layers`` (transformers' ``hidden_states`` numbering: 0 = embeddings,
    i = output of decoder layer i - 1, the last one, or -1, after the final norm);
    ``features(slot, start, end, layers)`` reads them back: [end - start, len(layers) * D].
    """

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def max_context(self) -> int: ...

    @property
    def embed(self) -> torch.Tensor:
        """The token embedding [V, D] (a head shares it)."""
        ...

    @property
    def lm_head(self) -> torch.Tensor:
        """The LM head weight [V, D] (a head shares its rows)."""
        ...

    def length(self, slot: int) -> int: ...

    def enable_features(self, layers: Sequence[int]) -> None: ...

    def features(self, slot: int, start: int, end: int, layers: Sequence[int]) -> torch.Tensor: ...


def feature_source(runner: object) -> FeatureSource:
    """``runner`` as a `FeatureSource`, or a ConfigError saying that drafters reading hidden
    states (eagle3, mtp) cannot run on it and what to use instead."""
    if isinstance(runner, FeatureSource):
        return runner
    raise ConfigError(f"{type(runner).__name__} does not keep hidden states; drafters that read "
                      "them (eagle3, mtp) need a target the lean runner runs (model types "
                      f"{', '.join(FAMILIES)}; see families.FAMILIES); use method 'ngram' or "
                      "'draft_model' for this one", option="speculative.method")
