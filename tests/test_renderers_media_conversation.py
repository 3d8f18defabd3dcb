"""Media parts in a conversation: what ``validate_conversation`` accepts and refuses, the
order ``media_parts`` lists them in, and the ``jinja`` renderer handing them to a folder's
template untouched. No shared data needed."""

from __future__ import annotations

import copy
import json

import pytest

import mlxrunner
from mlxrunner import ConversationError
from mlxrunner.chat import JinjaRenderer, media_parts, validate_conversation
from mlxrunner.plugin import RenderContext

PNG = "iVBORw0KGgo="
WAV = "UklGRg=="
# every shape of media part a client may send (the media's data is not checked here)
MEDIA_PARTS = [
    {"type": "image"},
    {"type": "image", "image": "https://example.com/a.png"},
    {"type": "image", "data": PNG},
    {"type": "image", "url": "https://example.com/a.png"},  # transformers' processor form
    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}", "detail": "low"}},
    {"type": "image_url", "image_url": "https://example.com/b.png"},
    {"type": "image_url", "image_url": {}},
    {"type": "image_url"},
    {"type": "image_url", "image_url": {"url": "x"}, "image": "x"},  # one modality, two keys
    {"type": "audio"},
    {"type": "audio", "audio": "clip.wav"},
    {"type": "audio", "data": WAV},
    {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}},
    {"type": "input_audio", "input_audio": {}},
    {"type": "video"},
    {"type": "video", "video": "clip.mp4"},
    {"type": "video", "video": ["f1.jpg", "f2.jpg"]},
]
MODALITY = ["image"] * 9 + ["audio"] * 5 + ["video"] * 3


def url(value: str) -> dict:
    return {"type": "image_url", "image_url": {"url": value}}


def _error(messages) -> str:
    with pytest.raises(ConversationError) as info:
        validate_conversation(messages)
    message = str(info.value)
    assert "\n" not in message, "errors are one line"
    return message


def test_validation_accepts_media_parts_unchanged():
    content = [{"type": "text", "text": "Look:"}, *MEDIA_PARTS]
    messages = [{"role": "user", "content": content}]
    original = copy.deepcopy(messages)
    checked, _ = validate_conversation(messages)
    assert checked == original
    checked[0]["content"][2]["image"] = "changed"  # a copy: the caller's parts stay as sent
    assert messages == original


@pytest.mark.parametrize(("part", "expected"), [
    ({"type": "picture"}, "content part 0 has type 'picture' (expected one of text, image,"),
    ({"image": "a.png"}, "content part 0 has type None"),
    ({"type": "text", "text": "hi", "image": "a.png"},
     "content part 0 (text): carries image data ('image'); give each image, audio or video "
     "its own part"),
    ({"type": "text", "text": "hi", "image_url": None}, "(text): carries image data"),
    ({"type": "video", "image": "a.png"}, "content part 0 (video): carries image data"),
    ({"type": "image", "input_audio": {"data": WAV}}, "(image): carries audio data"),
    ({"type": "audio", "video": "v.mp4"}, "(audio): carries video data"),
    ({"type": "image_url", "image_url": 5},
     "content part 0 (image_url): 'image_url' must be a URL string or an object with a "
     "string 'url'"),
    ({"type": "image_url", "image_url": {"url": ["x"]}}, "'image_url' must be a URL string"),
    ({"type": "input_audio", "input_audio": WAV},
     "(input_audio): 'input_audio' must be an object with string 'data' and 'format'"),
    ({"type": "input_audio", "input_audio": {"data": WAV, "format": 3}}, "string 'data' and"),
    ({"type": "image", "image": {"url": "x"}},
     "(image): 'image' must be a string (a URL, a path or base64), not object"),
    ({"type": "image", "data": 12}, "'data' must be a string"),
    ({"type": "audio", "audio": True}, "'audio' must be a string"),
    ({"type": "video", "video": ["f1.jpg", 2]}, "'video' must be a string or a list of frames"),
])
def test_malformed_media_parts_are_one_line(part, expected):
    assert expected in _error([{"role": "user", "content": [part]}])
    where = _error([{"role": "user", "content": "x"},
                    {"role": "tool", "content": [{"type": "text", "text": "ok"}, part]}])
    assert where.startswith("message 1 (tool): content part 1")


# -- Ollama's images -----------------------------------------------------------------------


def test_ollama_images_become_image_parts_before_the_content():
    image = [{"type": "image", "data": PNG}]
    cases = [
        ("What is it?", [*image, *image, {"type": "text", "text": "What is it?"}]),
        (None, [*image, *image]),
        ([{"type": "text", "text": "a"}, {"type": "audio"}],
         [*image, *image, {"type": "text", "text": "a"}, {"type": "audio"}]),
    ]
    for content, expected in cases:
        message = {"role": "user", "content": content, "images": [PNG, PNG]}
        checked, _ = validate_conversation([message])
        assert checked == [{"role": "user", "content": expected}]
        assert validate_conversation(checked)[0] == checked  # normalising twice changes nothing
    # no images: nothing to add
    assert validate_conversation([{"role": "user", "content": "x", "images": []}])[0] == \
        [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(("images", "expected"), [
    (PNG, "message 0 (user): 'images' must be a list of base64 strings, not string"),
    ({"a": PNG}, "'images' must be a list of base64 strings, not object"),
    ([PNG, 3], "message 0 (user): image 1 must be a base64 string, not number"),
    ([{"data": PNG}], "image 0 must be a base64 string, not object"),
])
def test_malformed_ollama_images_are_one_line(images, expected):
    assert expected in _error([{"role": "user", "content": "x", "images": images}])


# -- media_parts ---------------------------------------------------------------------------


def test_media_parts_lists_every_media_part_with_its_modality():
    messages = [{"role": "user", "content": [{"type": "text", "text": "all"}, *MEDIA_PARTS]}]
    found = media_parts(messages)
    assert [modality for modality, _ in found] == MODALITY
    assert [part for _, part in found] == MEDIA_PARTS


def test_media_parts_in_render_order():
    a, b, c = (url(f"https://example.com/{n}.png") for n in "abc")
    clip = {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [a, {"type": "text", "text": "and"}, clip],
         "images": [PNG]},
        {"role": "assistant", "content": "Seen.",
         "tool_calls": [{"function": {"name": "zoom", "arguments": "{}"}}]},
        {"role": "tool", "content": [{"type": "text", "text": "zoomed"}, b]},
        {"role": "user", "content": [{"type": "video"}, c]},
    ]
    assert media_parts(messages) == [
        ("image", {"type": "image", "data": PNG}),  # Ollama's images go first in a message
        ("image", a), ("audio", clip), ("image", b), ("video", {"type": "video"}),
        ("image", c)]


def test_media_parts_of_text_only_conversations_is_empty():
    assert media_parts([{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": [{"type": "text", "text": "yo"}]},
                        {"role": "user"}]) == []


def test_media_parts_refuses_what_validation_refuses():
    with pytest.raises(ConversationError, match="message 0 \\(user\\): content part 0 \\(text\\)"):
        media_parts([{"role": "user", "content": [{"type": "text", "text": "x", "video": "v"}]}])
    with pytest.raises(ConversationError, match="messages must be a list"):
        media_parts({"role": "user", "content": "x"})


def test_media_parts_is_public_in_the_chat_api():
    import mlxrunner.chat

    assert "media_parts" in mlxrunner.chat.__all__
    assert media_parts.__doc__ and "render order" in media_parts.__doc__


# -- the jinja renderer passes parts through -----------------------------------------------

# A folder template that writes each part exactly as it receives it.
ECHO = ("{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}"
        "{% else %}{% for p in m.content %}[{{ p | tojson }}]{% endfor %}{% endif %}{{ '\\n' }}"
        "{% endfor %}")
# One that writes its own placeholders, as a model folder's template does.
PLACEHOLDING = ("{% for m in messages %}<{{ m.role }}>{% for p in m.content %}"
                "{% if p.type in ['image', 'image_url'] %}<image:{{ loop.index }}>"
                "{% elif p.type in ['audio', 'input_audio'] %}<audio>"
                "{% elif p.type == 'video' %}<video>{% else %}{{ p.text }}{% endif %}"
                "{% endfor %}</{{ m.role }}>{% endfor %}")


def test_jinja_renderer_hands_parts_to_the_template_unchanged():
    parts = [{"type": "text", "text": "Look: é"}, *MEDIA_PARTS]
    messages = [{"role": "user", "content": parts},
                {"role": "assistant", "content": "ok"}]
    renderer = mlxrunner.get_renderer("jinja", RenderContext(chat_template=ECHO))
    expected = ("user:" + "".join(f"[{json.dumps(p, ensure_ascii=False)}]" for p in parts)
                + "\nassistant:ok\n")
    assert renderer.render(messages) == expected


def test_jinja_renderer_media_placeholders_are_the_templates():
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "A"}, url("https://example.com/a.png"),
        {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}},
        {"type": "video"}, {"type": "image"}]},
        {"role": "user", "content": "Two:", "images": [PNG, PNG]}]
    renderer = JinjaRenderer(PLACEHOLDING)
    assert renderer.render(messages) == (
        "<user>A<image:2><audio><video><image:5></user>"
        "<user><image:1><image:2>Two:</user>")
    # as many placeholders as media_parts lists
    assert len(media_parts(messages)) == 6
