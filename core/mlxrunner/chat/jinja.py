"""The ``jinja`` renderer: a model folder's own chat template, rendered as transformers does.

The environment matches transformers' ``apply_chat_template``:
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with
the ``loopcontrols`` extension and a no-op ``{% generation %}`` block,
``tojson`` as ``json.dumps(ensure_ascii=False)`` (with its ``indent``,
``separators`` and ``sort_keys`` options), the globals ``raise_exception``,
``strftime_now``, ``dict`` and a ``namespace`` that refuses underscore names,
and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as
variables. Messages get transformers' preparation too: null-valued keys are
dropped and the reasoning is offered under ``reasoning_content`` and
``thinking`` whichever name it came under.

A template is untrusted input: the sandbox keeps it away from Python
internals (``__class__``, ``__globals__``, mutating the messages); an attempt
is a ``ModelFolderError``. It renders under a time and size limit
(:mod:`mlxrunner.chat.limits`); going past one is a ``TemplateError``. A
template's own ``raise_exception`` is a ``ConversationError`` carrying its
message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils

from ..errors import ConversationError, ModelFolderError, TemplateError
from .formats import RenderContext, reasoning_of, validate_conversation
from .limits import (
    LimitedEnvironment,
    LimitExceeded,
    RenderLimits,
    RenderTimedOut,
    limited_render,
)


class _TemplateRaised(jinja2.TemplateError):
    """A template called ``raise_exception``: the conversation does not fit it."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; templates are written against json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _make_dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses attribute names starting with ``_``."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's own signature
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for key in attrs:
            _SafeNamespace._check(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, key: str, value: Any) -> None:
        _SafeNamespace._check(key)
        jinja2.utils.Namespace.__setitem__(self, key, value)

    @staticmethod
    def _check(key: Any) -> None:
        if isinstance(key, str) and key.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"namespace attribute {key!r} starts with an underscore")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def make_environment() -> LimitedEnvironment:
    env = LimitedEnvironment(trim_blocks=True, lstrip_blocks=True,
                             extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _make_dict
    env.globals["namespace"] = _SafeNamespace
    return env


#: the longest chat template compiled: the longest published ones are tens of kilobytes; a
#: template of 40 MB (a GGUF file's metadata) took minutes to compile
MAX_TEMPLATE_CHARS = 1 << 20


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template; a syntax error or an oversized template is a one-line
    ``ModelFolderError``."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise ModelFolderError(f"chat template is {len(source)} characters, past the limit of "
                               f"{MAX_TEMPLATE_CHARS}")
    try:
        return make_environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelFolderError(f"chat template has a syntax error at line {exc.lineno}: "
                               f"{exc.message}") from None
    except RecursionError:
        raise ModelFolderError("chat template is nested too deeply to compile") from None


def _text_content(message: dict[str, Any]) -> dict[str, Any]:
    """Content as a template written for strings reads it: text parts joined by a line
    (OpenAI's content parts, Anthropic's blocks, as Ollama joins them), none at all (an
    assistant turn of tool calls only) as empty. A list holding other parts (an image) stays
    a list. (Tried only where the conversation as transformers passes it fails.)"""
    content = message.get("content")
    if content is None:
        return {**message, "content": ""}
    if isinstance(content, list) and all(
            isinstance(part, Mapping) and part.get("type") == "text"
            and isinstance(part.get("text"), str) for part in content):
        return {**message, "content": "\n".join(part["text"] for part in content)}
    return message


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = reasoning_of(message)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class JinjaRenderer:
    """Renders with a chat template (see the module docstring for the environment)."""

    def __init__(self, chat_template: str, *, special_tokens: Mapping[str, Any] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None,
                 limits: RenderLimits | None = None) -> None:
        self.source = chat_template
        self.limits = limits or RenderLimits()
        self.template = compile_template(chat_template)
        variables: dict[str, Any] = {
            key: value for key, value in (special_tokens or {}).items()
            if isinstance(key, str) and isinstance(value, (str, list))}
        variables.update(template_kwargs or {})
        self.variables = variables

    @classmethod
    def from_context(cls, context: RenderContext | None) -> JinjaRenderer:
        """The factory registered as ``jinja``: the template and tokens of ``context``."""
        if context is None or not context.chat_template:
            name = f" {context.model_name}" if context and context.model_name else ""
            raise ModelFolderError(f"the model folder{name} has no chat template "
                                   "(chat_template.jinja or tokenizer_config.json); "
                                   "pick a renderer by name")
        tokens = dict(context.special_tokens)
        if context.bos_token is not None:
            tokens["bos_token"] = context.bos_token
        if context.eos_token is not None:
            tokens["eos_token"] = context.eos_token
        return cls(context.chat_template, special_tokens=tokens,
                   template_kwargs=context.extra.get("template_kwargs"))

    def render(self, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None, *,
               think: bool | None = None, add_generation_prompt: bool = True) -> str:
        checked, checked_tools = validate_conversation(messages, tools)
        variables = dict(self.variables)
        if think is not None:
            variables["enable_thinking"] = bool(think)
        variables.update(tools=checked_tools, documents=None,
                         add_generation_prompt=add_generation_prompt)
        prepared = [_alias_reasoning(m) for m in checked]
        try:
            return self._render_checked({**variables, "messages": prepared})
        except ConversationError:
            # a template written for string content: the messages as it reads them, if
            # that differs (text parts joined, absent content empty)
            plain = [_alias_reasoning(_text_content(m)) for m in checked]
            if plain == prepared:
                raise
            return self._render_checked({**variables, "messages": plain})

    def _render_checked(self, variables: dict[str, Any]) -> str:
        try:
            return self._render_limited(variables)
        except LimitExceeded as exc:
            raise TemplateError(f"the chat template {exc}") from None
        except RenderTimedOut:  # the watchdog's, landing as the render ended
            raise TemplateError(f"the chat template ran longer than "
                                f"{self.limits.seconds:g} s") from None
        except (RecursionError, MemoryError, OverflowError) as exc:
            raise TemplateError(f"the chat template went past its limits "
                                f"({type(exc).__name__}: {str(exc)[:200]})") from None
        except _TemplateRaised as exc:
            raise ConversationError(f"the chat template rejects this conversation: "
                                    f"{exc.message}") from None
        except jinja2.exceptions.SecurityError as exc:
            raise ModelFolderError(f"the chat template tried something the sandbox forbids: "
                                   f"{exc}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError,
                AttributeError, ZeroDivisionError) as exc:
            raise ConversationError(f"the chat template failed on this conversation: "
                                    f"{type(exc).__name__}: {exc}") from None

    def _render_limited(self, variables: dict[str, Any]) -> str:
        chunks: list[str] = []
        pieces: list[str] = []
        size, limit = 0, self.limits.max_chars
        with limited_render(self.limits):
            for piece in self.template.generate(**variables):
                size += len(piece)
                if size > limit:
                    raise LimitExceeded(f"went past its output limit of {limit} characters")
                pieces.append(piece)
                if len(pieces) >= 4096:  # many tiny pieces would cost more than their text
                    chunks.append("".join(pieces))
                    pieces.clear()
        return "".join(chunks) + "".join(pieces)

