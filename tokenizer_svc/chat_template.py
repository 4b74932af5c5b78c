"""Chat templates rendered the way Hugging Face `apply_chat_template` renders them:
a sandboxed Jinja2 environment with trim_blocks/lstrip_blocks, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text, and the special tokens as
variables (`bos_token`, `eos_token`, ...).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the messages (raise_exception) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """A compiled template (cached: templates are long and compiling them is slow)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def render(source: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
           special_tokens: dict[str, Any]) -> str:
    """The prompt text for `messages`.

    Args:
        source: the Jinja2 chat template.
        messages: [{"role": ..., "content": ...}, ...].
        add_generation_prompt: append the header of the assistant's turn.
        special_tokens: bos_token, eos_token, ... exposed to the template (and `tools`, when given).
    Returns:
        The rendered prompt (special tokens as text; encode it without adding more).
    """
    template = compile_template(source)
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    except (TypeError, KeyError, IndexError, AttributeError) as exc:
        raise ChatTemplateError(f"chat template failed on these messages: {exc!r}") from exc
