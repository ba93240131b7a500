"""The files of a batch job: input rows read lazily, and the append-only, resumable output.

Input: JSONL rows `{"id": ..., "prompt": "..."}` or `{"id": ..., "messages": [...]}`, or plain
text with one prompt per line. Blank lines are skipped; every other line yields either an
`InputRow` or a `BadRow` (its error), in file order, so a rerun over the same input sees the
same rows with the same ids and the same errors.

Output: one JSON object per line, written with a single `write` of the whole line. On resume the
file is scanned once: a torn last line (a kill in mid-write) is truncated away, every other
line must be a row this module wrote.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedq.errors import PagedqError

RowId = str | int | float | bool
"""A row id: any JSON scalar except null, kept with its JSON type."""

INPUT_FORMATS = ("auto", "jsonl", "text")
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


class BatchFileError(PagedqError, ValueError):
    """The input or output file of a batch job cannot be used as it is (not one bad row)."""


@dataclass(frozen=True, slots=True)
class InputRow:
    """A well-formed input row; exactly one of `prompt` and `messages` is set."""

    line: int  # 1-based line number in the input file
    id: RowId  # the row's "id", else its line number
    prompt: str | None  # the user text (plain-text lines and "prompt" rows)
    messages: list[dict[str, str]] | None  # a conversation ("messages" rows)


@dataclass(frozen=True, slots=True)
class BadRow:
    """An input line that cannot be served, and why."""

    line: int  # 1-based line number in the input file
    id: RowId | None  # the row's id when it could be read
    error: str  # what is wrong, for the user

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {"line": self.line}
        if self.id is not None:
            row["id"] = self.id
        row["error"] = self.error
        return row


def id_key(row_id: RowId) -> str:
    """A key that tells ids of different JSON types apart (1, 1.0, "1" and true differ)."""
    return json.dumps(row_id)


# --- input -----------------------------------------------------------------------------------


def detect_format(path: Path, fmt: str = "auto") -> str:
    """ "jsonl" or "text": by suffix, else by whether the first non-blank line starts with '{'."""
    if fmt not in INPUT_FORMATS:
        raise BatchFileError(f"input format must be one of {INPUT_FORMATS}, got {fmt!r}")
    if fmt != "auto":
        return fmt
    if path.suffix.lower() in _JSONL_SUFFIXES:
        return "jsonl"
    if path.suffix.lower() == ".txt":
        return "text"
    with path.open("rb") as f:
        for raw in f:
            stripped = raw.strip()
            if stripped:
                return "jsonl" if stripped.startswith((b"{", b"\xef\xbb\xbf{")) else "text"
    return "text"


def read_rows(path: Path, fmt: str, limit: int | None = None) -> Iterator[InputRow | BadRow]:
    """Every non-blank line of `path` (the first `limit` of them), read lazily.

    A later row that repeats an earlier row's id becomes a `BadRow`.
    """
    seen: dict[str, int] = {}  # id key -> line of its first row
    parse = _parse_jsonl if fmt == "jsonl" else _parse_text
    count = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if limit is not None and count >= limit:
                return
            try:
                text = raw.decode("utf-8").removeprefix("\ufeff").rstrip("\r\n")
            except UnicodeDecodeError as e:
                count += 1
                yield BadRow(
                    number, None, f"the line is not valid UTF-8 ({e.reason} at byte {e.start})"
                )
                continue
            if not text.strip():
                continue
            count += 1
            row = parse(number, text)
            if row.id is not None:
                first = seen.setdefault(id_key(row.id), number)
                if first != number:
                    row = BadRow(
                        number, row.id, f"duplicate id {id_key(row.id)} (first on line {first})"
                    )
            yield row


def _parse_text(number: int, text: str) -> InputRow | BadRow:
    return InputRow(number, number, text, None)


def _parse_jsonl(number: int, text: str) -> InputRow | BadRow:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BadRow(number, None, f"not valid JSON: {e.msg} (column {e.colno})")
    if not isinstance(obj, dict):
        return BadRow(number, None, f"a row must be a JSON object, got {_json_type(obj)}")
    row_id, error = _row_id(obj, number)
    if error is not None:
        return BadRow(number, None, error)
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        which = "both" if has_prompt else "neither"
        return BadRow(number, row_id, f'a row needs "prompt" or "messages", this one has {which}')
    if has_prompt:
        prompt = obj["prompt"]
        if not isinstance(prompt, str):
            return BadRow(number, row_id, f'"prompt" must be a string, got {_json_type(prompt)}')
        if not prompt.strip():
            return BadRow(number, row_id, '"prompt" is empty')
        return InputRow(number, row_id, prompt, None)
    error = _messages_error(obj["messages"])
    if error is not None:
        return BadRow(number, row_id, error)
    return InputRow(number, row_id, None, obj["messages"])


def _row_id(obj: dict[str, Any], number: int) -> tuple[RowId, str | None]:
    row_id = obj.get("id")
    if row_id is None:
        return number, None
    if not isinstance(row_id, str | int | float):  # bool is an int
        return number, f'"id" must be a string or a number, got {_json_type(row_id)}'
    if isinstance(row_id, float) and not math.isfinite(row_id):
        return number, f'"id" must be finite, got {row_id}'
    return row_id, None


def _messages_error(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return f'"messages" must be a non-empty list, got {_json_type(messages)}'
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f'"messages"[{i}] must be an object, got {_json_type(message)}'
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = _json_type(message.get(key)) if key in message else "nothing"
                return f'"messages"[{i}].{key} must be a string, got {got}'
    return None


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


# --- output ----------------------------------------------------------------------------------


@dataclass(slots=True)
class DoneRows:
    """What an output file already holds: finished ids and the input lines of error rows."""

    ids: set[str] = field(default_factory=set)  # id_key of every finished row
    error_lines: set[int] = field(default_factory=set)  # input line of every error row

    def has(self, row: InputRow | BadRow) -> bool:
        if row.line in self.error_lines:
            return True
        return isinstance(row, InputRow) and id_key(row.id) in self.ids


class OutputFile:
    """The job's output JSONL, opened for appending after a resume scan.

    Invariants: while open, the file ends with a complete line (a torn tail left by a killed
    run is truncated away by `open`); each row goes out in one `os.write` of a whole line
    (retried on a short write), so a kill can tear at most the line being written; one writer
    at a time (an exclusive `flock` where the platform has it).
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def open(cls, path: Path) -> tuple[OutputFile, DoneRows]:
        """Repair a torn tail, read which rows are done, and open for appending."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            _lock(fd, path)
            done, good_end, needs_newline = scan_output(path)
            if good_end < os.fstat(fd).st_size:
                os.ftruncate(fd, good_end)
            out = cls(path, fd)
            if needs_newline:
                out._write_all(b"\n")
        except BaseException:
            os.close(fd)
            raise
        return out, done

    def write(self, row: dict[str, Any]) -> None:
        """Append one row as one line."""
        # backslashreplace: a lone surrogate becomes a \udXXX escape, still valid JSON.
        data = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8", "backslashreplace")
        self._write_all(data)

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]


def scan_output(path: Path) -> tuple[DoneRows, int, bool]:
    """(done rows, byte length of the valid part, whether the last line lacks its newline).

    A last line that is not JSON is torn and left out of the valid part; a bad line anywhere
    else, or a line that is not a row of a batch job, raises `BatchFileError`.
    """
    done = DoneRows()
    end = 0
    previous: bytes | None = None  # each line is judged once the next one shows it is not last
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if previous is not None:
                end += _take_line(done, previous, path, number - 1, last=False)
            previous = raw
        if previous is None:
            return done, 0, False
        size = _take_line(done, previous, path, number, last=True)
    return done, end + size, size > 0 and not previous.endswith(b"\n")


def _take_line(done: DoneRows, raw: bytes, path: Path, number: int, last: bool) -> int:
    """Record one output line; its length in bytes, or 0 for a torn last line."""
    row = _output_row(raw)
    if row is None and last:
        return 0
    if row is None:
        raise BatchFileError(
            f"{path}: line {number} is not JSON; only a torn last line is repaired"
        )
    _add_done(done, row, path, number)
    return len(raw)


def read_output(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a (repaired) output file."""
    with path.open("rb") as f:
        for raw in f:
            row = _output_row(raw)
            if row is not None:
                yield row


def _output_row(raw: bytes) -> dict[str, Any] | None:
    try:
        row = json.loads(raw)
    except ValueError:  # not JSON, or not UTF-8
        return None
    return row if isinstance(row, dict) else None


def _add_done(done: DoneRows, row: dict[str, Any], path: Path, number: int) -> None:
    if "error" in row and isinstance(row.get("line"), int):
        done.error_lines.add(row["line"])
    elif "id" in row and "token_ids" in row:
        done.ids.add(id_key(row["id"]))
    else:
        raise BatchFileError(
            f"{path}: line {number} is not a row of a pagedq batch job; is it the right file?"
        )


def _lock(fd: int, path: Path) -> None:
    try:
        import fcntl
    except ImportError:  # not on POSIX: no lock
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        raise BatchFileError(f"{path} is being written by another pagedq batch run") from e
