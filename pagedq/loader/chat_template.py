"""Chat templates: find, compile in a jinja2 sandbox, render, and validate messages.

The environment is the one transformers gives templates (trim_blocks, lstrip_blocks,
loopcontrols, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, the
`{% generation %}` tag), inside `ImmutableSandboxedEnvironment` so a template cannot reach
Python internals or mutate its inputs.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from pagedq.errors import InvalidRequestError, TokenizerError


def find_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """`chat_template.jinja` if the folder has one (it wins, as in transformers), else
    tokenizer_config.json's `chat_template`: a string, or [{name, template}] of which
    "default" is taken."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"chat_template must be a string, got {type(template).__name__}")
    return template


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant mask): renders the body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_template(source: str) -> jinja2.Template:
    """Compile in an immutable sandbox with the environment transformers gives templates."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"chat template does not compile: {exc}") from exc


def validate_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise InvalidRequestError(
            f"messages must be a list of dicts, got {type(messages).__name__}"
        )
    for index, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise InvalidRequestError(
                f"messages[{index}] must be a dict with str 'role' and 'content', got {message!r}"
            )


def render_template(
    template: jinja2.Template,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
) -> str:
    """Render after checking `messages`; every template failure becomes a TokenizerError."""
    validate_messages(messages)
    try:
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens
        )
    except jinja2.TemplateError as exc:  # raise_exception, SecurityError, undefined calls
        raise TokenizerError(f"chat template error: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # a template can fail in plain Python operations too
        raise TokenizerError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
