"""Tokenizers of model folders, chat templates, and streaming detokenization.

`tokenizer.json` is run by the `tokenizers` library; a folder with only `tokenizer.model` by
sentencepiece. Special tokens, `add_bos_token` / `add_eos_token` and the chat template come from
`tokenizer_config.json`. Ids, decoded text and rendered chats follow transformers'
`AutoTokenizer` for the same folder, with one deliberate exception: transformers 5 rebuilds
the pipeline of a `LlamaTokenizer` folder from the class, so an old Llama-2-style
tokenizer.json (a normalizer that prepends "▁" to every piece of text) is run its own way
there; pagedq runs the file as written, as transformers 4 and the `tokenizers` library do.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import jinja2
import tokenizers

from pagedq.errors import InvalidRequestError, TokenizerError
from pagedq.loader.chat_template import compile_template, find_chat_template, render_template
from pagedq.loader.hf_config import read_json
from pagedq.loader.spm_backend import REPLACEMENT_CHAR, AddedTokenSpec, SentencePieceBackend

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")


class _Backend(Protocol):
    """What `Tokenizer` needs of a tokenizer implementation."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...
    def vocab_size(self) -> int: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, token_id: int) -> str | None: ...
    def special_ids(self) -> frozenset[int]: ...


class Tokenizer:
    """Text <-> token ids for one model folder, plus its chat template.

    Invariants: `vocab_size` counts every id `decode` accepts (base vocabulary and added
    tokens); `eos_token_ids` lists the id of `eos_token` first, then the other ids of
    `generation_config.json`, without repeats; `encode(text, add_special_tokens=False)` adds no
    id that the text does not spell.
    """

    def __init__(
        self,
        backend: _Backend,
        special_tokens: dict[str, str | None],
        eos_extra: tuple[int, ...],
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self._special_tokens = special_tokens  # "bos_token" etc. -> content or None
        self._template_source = chat_template
        self._template: jinja2.Template | None = None  # compiled on first use
        self.vocab_size: int = backend.vocab_size()
        self.bos_token_id: int | None = self._id_of("bos_token")
        self.pad_token_id: int | None = self._id_of("pad_token")
        eos_id = self._id_of("eos_token")
        first = (eos_id,) if eos_id is not None else ()
        self.eos_token_ids: tuple[int, ...] = first + tuple(
            dict.fromkeys(i for i in eos_extra if i not in first)
        )
        self.special_token_ids: frozenset[int] = backend.special_ids()

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike[str]) -> Tokenizer:
        """Load `tokenizer.json` (else `tokenizer.model`) and `tokenizer_config.json`."""
        folder = Path(model_dir)
        config = _read_json(folder / TOKENIZER_CONFIG)
        added = _added_tokens(config)
        specials = {name: _token_content(config.get(name)) for name in _NAMED_SPECIALS}
        backend: _Backend
        if (folder / TOKENIZER_JSON).is_file():
            backend = _TokenizersBackend(folder / TOKENIZER_JSON, added, specials)
        elif (folder / SENTENCEPIECE_MODEL).is_file():
            sp_backend = SentencePieceBackend(folder / SENTENCEPIECE_MODEL, config)
            specials = sp_backend.fill_specials(specials)
            sp_backend.add_tokens(added, specials)
            backend = sp_backend
        else:
            raise TokenizerError(
                f"no tokenizer in {str(folder)!r}: looked for {TOKENIZER_JSON} and "
                f"{SENTENCEPIECE_MODEL}"
            )
        generation = _read_json(folder / "generation_config.json")
        eos_extra = _ids(generation.get("eos_token_id"))
        return cls(backend, specials, eos_extra, find_chat_template(folder, config))

    @property
    def has_chat_template(self) -> bool:
        return self._template_source is not None

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens["eos_token"]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, bos/eos as the folder asks."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"a prompt must be a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`, as transformers' `decode` (no clean-up of spaces)."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def decode_ints(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """`decode` of a list already holding plain ints (no per-id conversion: the
        incremental detokenizer calls it twice per generated token)."""
        return self._backend.decode(ids, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry or added token; None when there is none."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` as the tokenizer spells it; None when unknown."""
        return self._backend.id_to_token(token_id)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text the chat template makes of `messages`."""
        if self._template_source is None:
            raise TokenizerError(
                "this tokenizer has no chat template (tokenizer_config.json chat_template or "
                "chat_template.jinja)"
            )
        if self._template is None:
            self._template = compile_template(self._template_source)
        specials = {k: v for k, v in self._special_tokens.items() if v is not None}
        return render_template(self._template, messages, add_generation_prompt, specials)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Ids of the rendered chat, encoded without adding special tokens (the template
        writes its own), as transformers' `apply_chat_template(tokenize=True)`."""
        return self.encode(self.render_chat(messages, add_generation_prompt), False)

    def _id_of(self, name: str) -> int | None:
        content = self._special_tokens[name]
        return None if content is None else self._backend.token_to_id(content)


class _TokenizersBackend:
    """`tokenizer.json` through the `tokenizers` library, with transformers' additions.

    Special tokens named in tokenizer_config.json but missing from the file are added; the
    file's post-processor alone decides which special tokens `encode` adds (transformers 5
    ignores `add_bos_token` / `add_eos_token` when there is a tokenizer.json); truncation and
    padding stored in the file are switched off (a prompt is never cut silently).
    """

    def __init__(
        self,
        path: Path,
        added: list[AddedTokenSpec],
        specials: dict[str, str | None],
    ) -> None:
        try:
            self._tk = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exceptions
            raise TokenizerError(f"cannot load {str(path)!r}: {exc}") from exc
        self._tk.no_truncation()
        self._tk.no_padding()
        named = [AddedTokenSpec(c) for c in specials.values() if c is not None]
        known = {t.content for t in self._tk.get_added_tokens_decoder().values()}
        for spec in added + named:
            if spec.content not in known:
                self._add(spec)
                known.add(spec.content)

    def _add(self, spec: AddedTokenSpec) -> None:
        token = tokenizers.AddedToken(
            spec.content,
            lstrip=spec.lstrip,
            rstrip=spec.rstrip,
            normalized=spec.normalized,
            special=spec.special,
        )
        if spec.special:
            self._tk.add_special_tokens([token])
        else:
            self._tk.add_tokens([token])

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tk.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def vocab_size(self) -> int:
        return int(self._tk.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    def special_ids(self) -> frozenset[int]:
        decoder = self._tk.get_added_tokens_decoder()
        return frozenset(i for i, token in decoder.items() if token.special)


# --- tokenizer_config.json -----------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when the optional file is absent."""
    return read_json(path, TokenizerError) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    """A special token given as a string or as {"content": ...} (a serialized AddedToken)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise TokenizerError(f"tokenizer_config.json: bad special token {value!r}")


def _added_tokens(config: dict[str, Any]) -> list[AddedTokenSpec]:
    """`added_tokens_decoder` of tokenizer_config.json, in id order."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict) or not all(str(k).isdigit() for k in decoder):
        raise TokenizerError("tokenizer_config.json: added_tokens_decoder must map ids to tokens")
    specs = []
    for key in sorted(decoder, key=int):
        entry = decoder[key] if isinstance(decoder[key], dict) else {"content": decoder[key]}
        content = _token_content(entry)
        if content is None:
            raise TokenizerError(f"tokenizer_config.json: added token {key} has no content")
        flag = lambda name, default=False: bool(entry.get(name, default))  # noqa: B023
        specs.append(
            AddedTokenSpec(
                content,
                special=flag("special", True),
                token_id=int(key),
                lstrip=flag("lstrip"),
                rstrip=flag("rstrip"),
                normalized=flag("normalized"),
            )
        )
    return specs


def _ids(value: Any) -> tuple[int, ...]:
    items = value if isinstance(value, list) else [value]
    return tuple(i for i in items if isinstance(i, int) and not isinstance(i, bool))


# --- streaming -------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Streams the text of one sequence's output tokens.

    Invariant: after every `add`, `text` equals `decode(ids)` of all tokens added so far (with
    `skip_special_tokens` as given) whenever that decode does not end in U+FFFD; when it does
    (a UTF-8 character spread over tokens is unfinished) that tail is held back until a later
    token completes it, or until `flush()`. Each step decodes only a short window
    `ids[prefix_offset:]`, where `ids[prefix_offset:read_offset]` is the chunk emitted last, so
    the new token is decoded in context (a sentencepiece leading space, a split byte sequence
    come out as in the full decode). The text is that of the output alone, as transformers'
    `decode(output_ids)`; the prompt ids are kept for the caller (`prompt_token_ids`).
    Known limit: a run of byte-fallback pieces that is not valid UTF-8 decodes (in
    transformers too) to one U+FFFD per byte, so a character streamed from the start of such a
    run is not taken back; only malformed output can do this.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.prompt_token_ids = tuple(prompt_token_ids)
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # output token ids so far
        self._prefix_offset = 0  # window start: the chunk emitted last begins here
        self._read_offset = 0  # tokens before this index are fully emitted
        self._text = ""  # emitted text

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return self._text

    @property
    def num_tokens(self) -> int:
        """Output tokens added so far."""
        return len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the new text it completes (may be "")."""
        return self.add_many([int(token_id)])  # plain ints: windows decode without conversion

    def add_many(self, token_ids: Sequence[int]) -> str:
        """Append tokens (plain ints); return the new text they complete (one window decode)."""
        self._ids.extend(token_ids)
        return self._emit(hold_back=True)

    def flush(self) -> str:
        """Emit whatever is held back (call when the sequence ends); returns it."""
        return self._emit(hold_back=False)

    def _emit(self, hold_back: bool) -> str:
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text) or (hold_back and new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._text += delta
        return delta

    def _decode(self, start: int, stop: int) -> str:
        if start >= stop:
            return ""
        return self._tokenizer.decode_ints(self._ids[start:stop], skip_special_tokens=self._skip)
