"""The bytes of the media a client attaches to a conversation, in each API's own shape.

The messages reach the renderer as sent (a template writes the model's placeholder for each
media part); the bytes go beside, in the order :func:`mlxrunner.chat.media_parts` lists the
parts (the order a template meets them), to :meth:`mlxrunner.Bundle.place_media`. Accepted:
base64 ``data`` (Ollama's ``images``, Anthropic's base64 ``image`` blocks, converted by their
APIs), OpenAI's ``image_url`` with a ``data:`` URL and ``input_audio``. A URL to fetch is
refused: the server reaches nothing on a client's behalf.
"""


from __future__ import annotations

import base64
import binascii
from typing import Any

from ..chat.formats import media_parts
from ..errors import ConversationError
from ..media import MAX_AUDIO_BYTES, MAX_IMAGE_BYTES
from .engine import RequestError

#: the most bytes of one attachment (each is checked again against its own kind's limit)
MAX_ATTACHMENT_BYTES = max(MAX_IMAGE_BYTES, MAX_AUDIO_BYTES)
#: the longest base64 text of one item
MAX_BASE64_CHARS = (MAX_ATTACHMENT_BYTES + 2) // 3 * 4


def attached_media(messages: list[dict[str, Any]]) -> list[tuple[str, bytes]]:
    """The conversation's media as ``(modality, bytes)``, in render order. One
    :class:`RequestError` line for a malformed conversation or a part whose data is
    missing, not base64, too large, a URL or of a kind this version does not take."""
    try:
        parts = media_parts(messages)
    except ConversationError as exc:
        raise RequestError(str(exc).splitlines()[0], param="messages") from None
    media = []
    for modality, part in parts:
        if modality == "video":
            raise RequestError("video input is not supported", param="messages")
        media.append((modality, _data(part, str(part.get("type")), "messages")))
    return media


def _data(part: dict[str, Any], kind: str, where: str) -> bytes:
    if kind == "image_url":
        url = part.get(kind)
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str):
            raise RequestError(f"{where}: an {kind} part needs a url", param="messages")
        return data_url(url, where)
    if kind == "input_audio":
        audio = part.get("input_audio")
        text = audio.get("data") if isinstance(audio, dict) else None
    else:
        text = part.get("data", part.get(kind))
    if not isinstance(text, str):
        raise RequestError(f"{where}: an {kind} part carries no base64 data",
                           param="messages")
    return from_base64(text, where)


def data_url(url: str, where: str) -> bytes:
    """The bytes of a ``data:...;base64,`` URL; any other URL is refused."""
    head, comma, body = url.partition(",")
    if not url.startswith("data:") or not comma or not head.endswith(";base64"):
        scheme = url.split(":", 1)[0][:16] if ":" in url else "a"
        raise RequestError(f"{where}: {scheme} URLs are not fetched; send the image as a "
                           "data: URL (base64)", param="messages")
    return from_base64(body, where)


def from_base64(text: str, where: str) -> bytes:
    if len(text) > MAX_BASE64_CHARS:
        raise RequestError(f"{where}: an attachment of over {MAX_ATTACHMENT_BYTES >> 20} MiB",
                           status=413, param="messages")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"{where}: the attachment is not valid base64",
                           param="messages") from None
