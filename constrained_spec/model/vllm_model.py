"""A model served by vLLM's engine: what the frontend needs of it here (tokenizer, config,
grammar tokenizer data) and the options vLLM's engine is built with.

``load_model(path, engine="vllm", tensor_parallel_size=2, ...)`` returns a `LoadedModel`
whose ``vllm`` field holds `VLLMOptions`; it has no runner of ours. The engine itself (vLLM's
``LLMEngine``) is built by `constrained_spec.generation.vllm_engine` at the first request,
once per speculative config, since vLLM fixes speculation when its engine starts. The
embedded model and GGUF files reach vLLM as the dense folder `export.export_hf` writes once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from constrained_spec.config import check_count
from constrained_spec.errors import ConfigError, ModelLoadError

logger = logging.getLogger(__name__)

# what `load_model(engine="vllm", **options)` passes to vLLM under our names; any other keyword
# goes to vLLM's EngineArgs as it is (checked against its fields when the engine is built)
_OPTION_NAMES = ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend",
                 "dtype", "max_model_len")
EXECUTOR_BACKENDS = ("mp", "ray", "uni", "external_launcher")


@dataclass(frozen=True)
class VLLMOptions:
    """How vLLM's engine is built for a model (docs/scale-out.md).

    ``tensor_parallel_size`` GPUs split each layer (one node); ``pipeline_parallel_size``
    stages split the layers (across nodes with ``distributed_executor_backend="ray"``);
    ``dtype``: vLLM's (``"auto"``: bfloat16 on a CPU, the checkpoint's on a GPU);
    ``max_model_len``: the context vLLM reserves KV cache for (None: the model's, capped at
    4096 on a CPU); ``engine_args``: any other field of ``vllm.EngineArgs``."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    engine_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_count(self.tensor_parallel_size, "tensor_parallel_size", minimum=1)
        check_count(self.pipeline_parallel_size, "pipeline_parallel_size", minimum=1)
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ConfigError(f"distributed_executor_backend must be one of "
                              f"{', '.join(EXECUTOR_BACKENDS)} (or None: vLLM chooses), got "
                              f"{self.distributed_executor_backend!r}",
                              option="distributed_executor_backend")
        if self.max_model_len is not None:
            check_count(self.max_model_len, "max_model_len", minimum=16)
        if not isinstance(self.dtype, str):
            raise ConfigError(f"dtype must be a string such as 'auto' or 'bfloat16', got "
                              f"{self.dtype!r}", option="dtype")

    @classmethod
    def from_keywords(cls, options: Mapping[str, Any]) -> VLLMOptions:
        """Ours by name, the rest as vLLM engine arguments."""
        ours = {k: options[k] for k in _OPTION_NAMES if k in options}
        rest = {k: v for k, v in options.items() if k not in _OPTION_NAMES}
        for key in ("model", "tokenizer", "speculative_config", "structured_outputs_config"):
            if key in rest:
                raise ConfigError(f"{key} is set by constrained_spec for the vLLM engine "
                                  "(the model argument, speculative=, the compiled grammar)",
                                  option=key)
        return cls(**ours, engine_args=rest)

    def key(self) -> tuple[Any, ...]:
        return (*(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "engine_args"),
                tuple(sorted((k, repr(v)) for k, v in self.engine_args.items())))


class ConfigView:
    """The model object of a vLLM-served model: its config and generation config, nothing
    to run (the weights live in vLLM's workers)."""

    def __init__(self, config: Any, generation_config: Any) -> None:
        self.config = config
        self.generation_config = generation_config


def load_folder(folder: Path | str) -> tuple[Any, Any, Any]:
    """``(tokenizer, config, generation_config)`` of a Hugging Face folder (or a hub id where
    one can be fetched), as vLLM will read it."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
        config = AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many kinds: say which model failed and why
        raise ModelLoadError(f"could not read the model {str(folder)!r} for vLLM: "
                             f"{type(e).__name__}: {e}") from e
    try:
        gen = GenerationConfig.from_pretrained(str(folder))
    except Exception:  # optional: many folders have none
        gen = None
    return tok, config, gen


def vllm_device() -> torch.device:
    """Where vLLM runs: a GPU when torch sees one, else the CPU (vLLM's CPU build)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
