"""constrained_spec: schema-constrained generation with local language models, made fast by
speculative decoding that respects the grammar at every draft position.

    from constrained_spec import generate
    person = generate(None, "Ada Lovelace, 36, mathematician", schema=Person)
"""

from constrained_spec.schemas import Grammar, JsonLayout, Regex

from .api import GenerationResult, Generator, generate
from .config import SamplingParams, SpeculativeConfig
from .errors import (
    ConfigError,
    ConstrainedSpecError,
    GenerationError,
    IncompleteOutputError,
    ModelLoadError,
    OutputValidationError,
    PromptTooLongError,
    RepetitionLoopError,
    SchemaError,
)
from .models import LoadedModel, load_model
from .stats import SpecStats

__version__ = "0.1.0"

__all__ = [
    "generate", "Generator", "GenerationResult", "SpeculativeConfig", "SamplingParams",
    "Regex", "Grammar", "JsonLayout", "ConstrainedSpecError", "SchemaError", "GenerationError",
    "IncompleteOutputError", "OutputValidationError", "ModelLoadError", "ConfigError",
    "PromptTooLongError", "RepetitionLoopError", "LoadedModel", "load_model", "SpecStats",
]
