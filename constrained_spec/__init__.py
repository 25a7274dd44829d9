"""constrained_spec: schema-constrained generation with local language models, made fast by
speculative decoding that respects the grammar at every draft position.

    from constrained_spec import generate
    person = generate(None, "Ada Lovelace, 36, mathematician", schema=Person)
"""

from constrained_spec.api import GenerationResult, Generator, generate
from constrained_spec.config import SamplingParams, SpeculativeConfig
from constrained_spec.errors import (
    ConfigError,
    ConstrainedSpecError,
    GenerationError,
    IncompleteOutputError,
    ModelLoadError,
    OutputValidationError,
    OutputWarning,
    PromptTooLongError,
    RepetitionLoopError,
    SchemaError,
)
from constrained_spec.frontend.tools import ToolCall
from constrained_spec.generation.stats import SpecStats
from constrained_spec.model.loading import LoadedModel, load_model
from constrained_spec.schemas import Grammar, JsonLayout, Regex, StructuralTag, Tag, TaggedText

__version__ = "0.1.0"

__all__ = [
    "generate", "Generator", "GenerationResult", "SpeculativeConfig", "SamplingParams",
    "Regex", "Grammar", "JsonLayout", "StructuralTag", "Tag", "TaggedText",
    "ConstrainedSpecError", "SchemaError", "GenerationError",
    "IncompleteOutputError", "OutputValidationError", "ModelLoadError", "ConfigError",
    "PromptTooLongError", "RepetitionLoopError", "LoadedModel", "load_model", "SpecStats",
    "ToolCall", "OutputWarning",
]
