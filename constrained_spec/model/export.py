"""A GGUF file as a dense Hugging Face folder (config, safetensors, tokenizer), for engines that
read one: vLLM's loader wants a config folder, not a ``.gguf``.

`export_hf` dequantises the file once through transformers' GGUF reader and keeps the folder in
the cache (owner-only, keyed by the file's content hash, built through `cached_build`, so a
killed export is never trusted); the embedded model's export is `converted_default_dir`, the
folder the transformers runner already loads. ``out=`` copies the export to a folder of the
caller's (``constrained-spec export-hf``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from constrained_spec.cache import cache_dir, cached_build, file_digest, private_mkdir
from constrained_spec.errors import ModelLoadError
from constrained_spec.model.embedded import (
    converted_default_dir,
    fetch_default_gguf,
    save_plain_checkpoint,
)

# bumped when the exported folder's layout changes (an older export is then rebuilt)
_EXPORT_VERSION = 1


def export_hf(model: str | Path | None = None, out: str | Path | None = None, *,
              quiet: bool = False) -> Path:
    """The dense Hugging Face folder of ``model`` (None / ``"default"``: the embedded model; a
    ``.gguf`` file; a folder is returned as it is), exported once into the cache. With ``out``,
    a copy in that folder (created; an existing non-empty folder is refused) is returned.

    Raises :class:`ModelLoadError` when the file is missing or transformers cannot read it."""
    folder = _exported(model, quiet=quiet)
    if out is None:
        return folder
    dest = Path(out).expanduser()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ModelLoadError(f"export-hf: {dest} exists and is not an empty folder; give a new "
                             "folder")
    dest.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.is_file() and f.name != "done":  # the cache's own manifest stays behind
            shutil.copy2(f, dest / f.name)
    return dest


def _exported(model: str | Path | None, *, quiet: bool) -> Path:
    if model is None or str(model) == "default":
        return converted_default_dir(quiet=quiet)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if not path.is_file() or path.suffix != ".gguf":
        raise ModelLoadError(f"export-hf: {str(model)!r} is neither a .gguf file nor a folder")
    if path.resolve() == fetch_default_gguf(quiet=True).resolve():
        return converted_default_dir(quiet=quiet)
    digest = file_digest(path)
    root = cache_dir() / "hf"
    private_mkdir(root)
    return cached_build(root / f"{path.stem}-{digest[:16]}-v{_EXPORT_VERSION}",
                        lambda tmp: _convert(path, tmp, quiet))


def _convert(gguf: Path, tmp: Path, quiet: bool) -> None:
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with tqdm(total=2, desc=f"export {gguf.name} (once)", disable=quiet, file=sys.stderr) as bar:
            tok: Any = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            bar.update(1)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                         dtype=torch.float32)
            bar.update(1)
    except Exception as e:  # transformers raises many kinds: say which file and why
        raise ModelLoadError(f"export-hf: transformers cannot read {gguf}: "
                             f"{type(e).__name__}: {e}") from e
    save_plain_checkpoint(model, tmp)
    tok.save_pretrained(tmp)
