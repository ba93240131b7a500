"""Random access to the tensors of a model folder's safetensors files.

A folder holds either one `model.safetensors`, shards listed by `model.safetensors.index.json`,
or a set of `*.safetensors` files. Weights are never unpickled: a folder with only `*.bin` /
`*.pt` files is refused with a message saying so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from pagedq.errors import CheckpointError, ModelLoadError, ModelNotFoundError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class Checkpoint:
    """The tensors of one model folder, read on demand.

    Invariants: every name in `names()` maps to exactly one file of the folder; a file is
    opened (header parsed and validated, data memory-mapped) the first time one of its tensors
    is asked for, and a file that fails validation raises `CheckpointError` naming it. Tensors
    come back as stored: on the CPU, in the dtype of the file.
    """

    def __init__(self, folder: Path, file_of: dict[str, Path]) -> None:
        self.folder = folder
        self._file_of = file_of  # tensor name -> the file holding it
        self._handles: dict[Path, Any] = {}  # file -> open safe_open handle

    @classmethod
    def open(cls, model_dir: str | os.PathLike[str]) -> Checkpoint:
        """Index the safetensors files of `model_dir` (sharded with an index, or not)."""
        folder = Path(model_dir)
        if not folder.is_dir():
            raise ModelNotFoundError(f"model folder {str(folder)!r} does not exist")
        index = folder / INDEX_FILE
        if index.is_file():
            return cls(folder, _read_index(index))
        files = _safetensors_files(folder)
        checkpoint = cls(folder, {})
        for path in files:
            for name in checkpoint._handle(path).keys():  # noqa: SIM118 (a handle, not a dict)
                if name in checkpoint._file_of:
                    raise CheckpointError(
                        f"tensor {name!r} is in both {checkpoint._file_of[name].name!r} and "
                        f"{path.name!r} of {str(folder)!r}"
                    )
                checkpoint._file_of[name] = path
        return checkpoint

    def names(self) -> list[str]:
        """Every tensor name, sorted."""
        return sorted(self._file_of)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def __len__(self) -> int:
        return len(self._file_of)

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` as stored (dtype preserved), on the CPU."""
        path = self._path_of(name)
        try:
            return self._handle(path).get_tensor(name)
        except Exception as exc:  # safetensors raises its own untyped errors
            raise CheckpointError(f"cannot read tensor {name!r} from {str(path)!r}: {exc}") from exc

    def dtype_of(self, name: str) -> torch.dtype:
        """The stored dtype of `name`, without reading its data."""
        code = self._slice(name).get_dtype()
        if code not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {code!r}, which pagedq cannot read")
        return _DTYPES[code]

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The stored shape of `name`, without reading its data."""
        return tuple(int(d) for d in self._slice(name).get_shape())

    def close(self) -> None:
        """Drop every open file handle (they are reopened on demand)."""
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _path_of(self, name: str) -> Path:
        if name not in self._file_of:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint {str(self.folder)!r}")
        return self._file_of[name]

    def _slice(self, name: str) -> Any:
        path = self._path_of(name)
        handle = self._handle(path)
        try:
            return handle.get_slice(name)
        except Exception as exc:
            raise CheckpointError(f"tensor {name!r} is not in {str(path)!r}: {exc}") from exc

    def _handle(self, path: Path) -> Any:
        handle = self._handles.get(path)
        if handle is None:
            if not path.is_file():
                raise ModelNotFoundError(f"weight file {str(path)!r} does not exist")
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # bad header, truncated or padded file
                raise CheckpointError(f"corrupt safetensors file {str(path)!r}: {exc}") from exc
            self._handles[path] = handle
        return handle


def _read_index(index: Path) -> dict[str, Path]:
    """tensor name -> shard path from `model.safetensors.index.json`; every shard must exist."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read the weight_map of {str(index)!r}: {exc}") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{str(index)!r}: weight_map must be a non-empty object")
    file_of: dict[str, Path] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise ModelLoadError(f"{str(index)!r}: tensor {name!r} names a bad shard {shard!r}")
        file_of[name] = index.parent / shard
    for shard_path in sorted(set(file_of.values())):
        if not shard_path.is_file():
            raise ModelNotFoundError(
                f"shard {shard_path.name!r} named in {str(index)!r} does not exist"
            )
    return file_of


def _safetensors_files(folder: Path) -> list[Path]:
    """`model.safetensors` if present, else every `*.safetensors`; refuses pickle-only folders."""
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for pattern in _PICKLE_PATTERNS for p in folder.glob(pattern))
    if pickles:
        raise ModelLoadError(
            f"{str(folder)!r} holds only pickle weight files ({', '.join(pickles[:4])}); pagedq "
            "never unpickles weights: convert them to safetensors first"
        )
    raise ModelNotFoundError(f"no *.safetensors weight files in {str(folder)!r}")
