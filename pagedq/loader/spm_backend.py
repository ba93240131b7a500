"""Sentencepiece `tokenizer.model` backend of `pagedq.loader.tokenizer.Tokenizer`.

Sentencepiece does the segmentation; transformers' (5.x) conventions for special tokens, the
dummy prefix and decoding are added on top so that ids and text match `AutoTokenizer`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sentencepiece

from pagedq.errors import TokenizerError

REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True, slots=True)
class AddedTokenSpec:
    """One entry of `added_tokens_decoder` (or a named special token) of tokenizer_config.json."""

    content: str  # the token's text
    special: bool = True  # skipped by decode(skip_special_tokens=True)
    token_id: int | None = None  # id given by added_tokens_decoder; None: look it up
    lstrip: bool = False  # swallows whitespace on its left when matched in text
    rstrip: bool = False  # swallows whitespace on its right
    normalized: bool = False  # matched after normalization (tokenizers backend only)


class SentencePieceBackend:
    """`tokenizer.model` through sentencepiece, with transformers' (5.x) conventions on top.

    - Special and added tokens are cut out of the text first and map to their ids.
    - The dummy prefix space goes only before the text at the very start of the input
      (`legacy: false`, transformers' default for Llama), or before every piece of text
      between special tokens (`legacy: true`); never before text that already starts with a
      space, and never when the model or `add_prefix_space: false` turns it off.
    - decode: pieces with "▁" as space, byte pieces joined into UTF-8 (a run that is not valid
      UTF-8 gives one U+FFFD per byte), one leading space dropped when prefixes are on.
    - `add_bos_token` defaults to true, the sentencepiece Llama convention (transformers 5
      adds no bos when tokenizer_config.json does not say; real Llama folders always say).
    """

    def __init__(self, path: Path, config: dict[str, Any]) -> None:
        try:
            proto = path.read_bytes()
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
            self._sp_bare = sentencepiece.SentencePieceProcessor(
                model_proto=_no_dummy_prefix(proto)
            )
        except Exception as exc:  # sentencepiece raises RuntimeError/OSError on bad files
            raise TokenizerError(f"cannot load sentencepiece model {str(path)!r}: {exc}") from exc
        self._add_prefix = _dummy_prefix_of(proto) and config.get("add_prefix_space") is not False
        self._legacy = bool(config.get("legacy", False))
        self._add_bos = bool(config.get("add_bos_token", True))
        self._add_eos = bool(config.get("add_eos_token", False))
        self._size = self._sp.get_piece_size()
        self._added: dict[str, int] = {}  # added token content -> id
        self._id_to_added: dict[int, str] = {}  # ids past the base vocabulary -> content
        self._special: set[int] = {i for i in range(self._size) if self._sp.is_control(i)}
        self._split: re.Pattern[str] | None = None  # matches any added token
        self._order: list[str] = []  # content of the token of each group of `_split`
        self._bos: int | None = None
        self._eos: int | None = None

    def fill_specials(self, specials: dict[str, str | None]) -> dict[str, str | None]:
        """Named special tokens, taking the model's own bos/eos/unk where the config has none."""
        own = {"bos_token": self._sp.bos_id(), "eos_token": self._sp.eos_id()}
        own["unk_token"], own["pad_token"] = self._sp.unk_id(), self._sp.pad_id()
        filled = dict(specials)
        for name, piece_id in own.items():
            if filled.get(name) is None and piece_id >= 0 and name != "pad_token":
                filled[name] = self._sp.id_to_piece(piece_id)
        return filled

    def add_tokens(self, added: list[AddedTokenSpec], specials: dict[str, str | None]) -> None:
        """Register added tokens and named specials so that they are cut out of text."""
        named = [AddedTokenSpec(c) for c in specials.values() if c is not None]
        specs: list[AddedTokenSpec] = []
        for spec in added + named:
            if spec.content in self._added:
                continue
            token_id = spec.token_id if spec.token_id is not None else self._piece_id(spec.content)
            if token_id is None:
                raise TokenizerError(f"special token {spec.content!r} is not in the vocabulary")
            self._added[spec.content] = token_id
            specs.append(spec)
            if token_id >= self._size:
                self._id_to_added[token_id] = spec.content
            if spec.special:
                self._special.add(token_id)
        longest_first = sorted(specs, key=lambda s: -len(s.content))
        alternatives = [
            ("\\s*" if s.lstrip else "")
            + f"({re.escape(s.content)})"
            + ("\\s*" if s.rstrip else "")
            for s in longest_first
        ]
        self._split = re.compile("|".join(alternatives)) if alternatives else None
        self._order = [s.content for s in longest_first]  # group i+1 -> content
        bos, eos = specials["bos_token"], specials["eos_token"]
        self._bos = None if bos is None else self.token_to_id(bos)
        self._eos = None if eos is None else self.token_to_id(eos)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = []
        start = 0
        for match in self._split.finditer(text) if self._split is not None else ():
            ids += self._encode_text(text[start : match.start()], start)
            ids.append(self._added[self._order[(match.lastindex or 1) - 1]])
            start = match.end()
        ids += self._encode_text(text[start:], start)
        if add_special_tokens:
            ids = ([self._bos] if self._add_bos and self._bos is not None else []) + ids
            ids += [self._eos] if self._add_eos and self._eos is not None else []
        return ids

    def _encode_text(self, text: str, offset: int) -> list[int]:
        if not text:
            return []
        prefixed = self._add_prefix and (self._legacy or offset == 0) and not text.startswith(" ")
        processor = self._sp if prefixed else self._sp_bare
        return list(processor.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        parts: list[str] = []
        pending = bytearray()  # a run of byte pieces
        for token_id in ids:
            if skip_special_tokens and token_id in self._special:
                continue
            if 0 <= token_id < self._size and self._sp.is_byte(token_id):
                pending.append(int(self._sp.id_to_piece(token_id)[3:5], 16))
                continue
            if pending:
                parts.append(_utf8_or_replacements(bytes(pending)))
                pending.clear()
            parts.append((self.id_to_token(token_id) or "").replace("\u2581", " "))
        if pending:
            parts.append(_utf8_or_replacements(bytes(pending)))
        text = "".join(parts)
        return text[1:] if self._add_prefix and text.startswith(" ") else text

    def vocab_size(self) -> int:
        return max([self._size, *(i + 1 for i in self._id_to_added)])

    def token_to_id(self, token: str) -> int | None:
        if token in self._added:
            return self._added[token]
        return self._piece_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._id_to_added:
            return self._id_to_added[token_id]
        return self._sp.id_to_piece(token_id) if 0 <= token_id < self._size else None

    def special_ids(self) -> frozenset[int]:
        return frozenset(self._special)

    def _piece_id(self, piece: str) -> int | None:
        piece_id = self._sp.piece_to_id(piece)
        return piece_id if self._sp.id_to_piece(piece_id) == piece else None


def _utf8_or_replacements(data: bytes) -> str:
    """A run of byte pieces as text; invalid UTF-8 gives one U+FFFD per byte (as tokenizers)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return REPLACEMENT_CHAR * len(data)


# --- sentencepiece model proto: turn the dummy prefix off ---------------------------------
# ModelProto field 3 is normalizer_spec; NormalizerSpec field 3 is add_dummy_prefix (bool).


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _fields(data: bytes) -> list[tuple[int, bytes, bytes]]:
    """(field number, raw field bytes, payload of a length-delimited field) in order."""
    out, pos = [], 0
    while pos < len(data):
        start = pos
        key, pos = _varint(data, pos)
        wire = key & 7
        payload = b""
        if wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1 or wire == 5:
            pos += 8 if wire == 1 else 4
        elif wire == 2:
            length, pos = _varint(data, pos)
            payload, pos = data[pos : pos + length], pos + length
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.append((key >> 3, data[start:pos], payload))
    return out


def _normalizer_spec(proto: bytes) -> bytes:
    specs = [payload for number, _, payload in _fields(proto) if number == 3]
    return specs[-1] if specs else b""


def _dummy_prefix_of(proto: bytes) -> bool:
    flags = [raw for number, raw, _ in _fields(_normalizer_spec(proto)) if number == 3]
    return not flags or _varint(flags[-1], 1)[0] != 0


def _no_dummy_prefix(proto: bytes) -> bytes:
    """The same model with `normalizer_spec.add_dummy_prefix = false`."""
    spec = _normalizer_spec(proto)
    kept = b"".join(raw for number, raw, _ in _fields(spec) if number != 3) + b"\x18\x00"
    rest = b"".join(raw for number, raw, _ in _fields(proto) if number != 3)
    return rest + b"\x1a" + _encode_varint(len(kept)) + kept
