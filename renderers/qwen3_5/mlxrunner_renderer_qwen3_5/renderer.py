"""The ``qwen3.5`` renderer: Qwen3.5's published chat template, in plain Python.

It reproduces the template byte for byte (rendered as transformers renders it)
on every conversation ``mlxrunner.validate_conversation`` accepts, and raises
``ConversationError`` where the template raises. There are no intentional
differences; the points where the template is strict are kept:

- ``developer`` messages, images or videos in the system message, a system
  message after the first, audio content parts and a conversation without a
  user query (only tool results) are errors, as in the template; an ``image_url``
  part without its ``image_url`` is an error too (the template tests keys first);
- a thinking block is written only for assistant turns after the last user
  query; earlier turns keep their content alone;
- tool-call argument values that are objects or arrays are JSON, other values
  are written as Python's ``str`` writes them (``True``, ``None``), as the
  template's ``string`` filter does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from mlxrunner.plugin import ConversationError, RenderContext, validate_conversation

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
TOOLS_HEADER = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_FOOTER = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
    "value_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\n- If there is "
    "no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>"
)


def reasoning_of(message: Mapping[str, Any]) -> str | None:
    for key in ("reasoning_content", "thinking", "reasoning"):
        if isinstance(message.get(key), str):
            return message[key]
    return None


class _VisionIds:
    """The template's ``add_vision_id``: "Picture N: " / "Video N: " before each image /
    video, numbered through the conversation (the counts are the template's namespaces)."""

    def __init__(self) -> None:
        self.images = 0
        self.videos = 0

    def image(self) -> str:
        self.images += 1
        return f"Picture {self.images}: "

    def video(self) -> str:
        self.videos += 1
        return f"Video {self.videos}: "


def _text_of(content: Any, where: str, *, system: bool = False,
             vision_ids: _VisionIds | None = None) -> str:
    """A message's content as the template writes it (before trimming). ``vision_ids``:
    number the media (only the template's main pass counts; its other passes test text
    that a "Picture N: " before a placeholder cannot change)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces = []
    for j, part in enumerate(content):
        # The template tests keys before the type, in this order.
        if "image" in part or "image_url" in part or part.get("type") == "image":
            if system:
                raise ConversationError(f"{where}: a system message cannot contain images "
                                        "in the qwen3.5 format")
            pieces.append(IMAGE if vision_ids is None else vision_ids.image() + IMAGE)
        elif "video" in part or part.get("type") == "video":
            if system:
                raise ConversationError(f"{where}: a system message cannot contain videos "
                                        "in the qwen3.5 format")
            pieces.append(VIDEO if vision_ids is None else vision_ids.video() + VIDEO)
        elif "text" in part:
            pieces.append(str(part["text"]))
        else:
            raise ConversationError(f"{where}: content part {j} of type {part.get('type')!r} "
                                    "is not supported by the qwen3.5 format")
    return "".join(pieces)


def _argument_text(value: Any) -> str:
    if isinstance(value, (Mapping, list, tuple)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


class Qwen35Renderer:
    """Renders conversations in the Qwen3.5 chat format (thinking on by default).

    ``add_vision_id`` (the template's variable, also read from the context's
    ``extra["template_kwargs"]`` as the ``jinja`` renderer reads it) writes "Picture N: "
    before the N-th image and "Video N: " before the N-th video.
    """

    name = "qwen3.5"
    stop_markers = ("<|im_end|>",)

    def __init__(self, context: RenderContext | None = None, *,
                 add_vision_id: bool | None = None) -> None:
        self.context = context
        if add_vision_id is None:
            kwargs = context.extra.get("template_kwargs") if context is not None else None
            add_vision_id = isinstance(kwargs, Mapping) and bool(kwargs.get("add_vision_id"))
        self.add_vision_id = add_vision_id

    def render(self, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None, *,
               think: bool | None = None, add_generation_prompt: bool = True) -> str:
        messages, tools = validate_conversation(messages, tools)
        out: list[str] = []
        first = messages[0]
        if tools:
            out.append("<|im_start|>system\n" + TOOLS_HEADER)
            for tool in tools:
                out.append("\n" + json.dumps(tool, ensure_ascii=False))
            out.append(TOOLS_FOOTER)
            if first["role"] == "system":
                system = _text_of(first.get("content"), "message 0", system=True).strip()
                if system:
                    out.append("\n\n" + system)
            out.append("<|im_end|>\n")
        elif first["role"] == "system":
            system = _text_of(first.get("content"), "message 0", system=True).strip()
            out.append("<|im_start|>system\n" + system + "<|im_end|>\n")

        last_query = -1
        for index in range(len(messages) - 1, -1, -1):
            message = messages[index]
            if message["role"] == "user":
                text = _text_of(message.get("content"), f"message {index}").strip()
                if not (text.startswith("<tool_response>") and text.endswith("</tool_response>")):
                    last_query = index
                    break
        if last_query < 0:
            raise ConversationError("the qwen3.5 format needs a user message that is not "
                                    "only tool results")

        count = len(messages)
        vision_ids = _VisionIds() if self.add_vision_id else None
        for index, message in enumerate(messages):
            role = message["role"]
            where = f"message {index} ({role})"
            content = _text_of(message.get("content"), where, vision_ids=vision_ids).strip()
            if role == "system":
                if index != 0:
                    raise ConversationError(f"{where}: the qwen3.5 format allows a system "
                                            "message only at the beginning")
            elif role == "user":
                out.append("<|im_start|>user\n" + content + "<|im_end|>\n")
            elif role == "assistant":
                out.append(self._assistant(message, content, after_query=index > last_query))
            elif role == "tool":
                if index > 0 and messages[index - 1]["role"] != "tool":
                    out.append("<|im_start|>user")
                out.append("\n<tool_response>\n" + content + "\n</tool_response>")
                if index == count - 1 or messages[index + 1]["role"] != "tool":
                    out.append("<|im_end|>\n")
            else:
                raise ConversationError(f"{where}: the qwen3.5 format has no {role!r} role "
                                        "(use 'system')")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
            out.append("<think>\n\n</think>\n\n" if think is False else "<think>\n")
        return "".join(out)

    @staticmethod
    def _assistant(message: Mapping[str, Any], content: str, *, after_query: bool) -> str:
        reasoning = reasoning_of(message)
        if reasoning is None:
            reasoning = ""
            if "</think>" in content:
                # Reasoning written inline in the content, as older Qwen replies are.
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1]
                reasoning = reasoning.lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
        reasoning = reasoning.strip()
        if after_query:
            out = ["<|im_start|>assistant\n<think>\n" + reasoning + "\n</think>\n\n" + content]
        else:
            out = ["<|im_start|>assistant\n" + content]
        for j, call in enumerate(message.get("tool_calls") or ()):
            function = call["function"]
            if j > 0:
                out.append("\n<tool_call>\n")
            elif content.strip():
                out.append("\n\n<tool_call>\n")
            else:
                out.append("<tool_call>\n")
            out.append("<function=" + function["name"] + ">\n")
            for key, value in function["arguments"].items():
                out.append("<parameter=" + key + ">\n" + _argument_text(value) + "\n</parameter>\n")
            out.append("</function>\n</tool_call>")
        out.append("<|im_end|>\n")
        return "".join(out)
