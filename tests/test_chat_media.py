"""Images in the conversation of ``mlxrunner run MODEL``: ``/image PATH`` and a path to an
image file in a message attach it to the message (as ``ollama run`` does); each reply is the
one ``mlxrunner.generate`` gives the conversation so far with its images placed; a later turn
reuses the prefix cache; ``/save`` and ``/load`` keep the images by path; a text-only model
says it takes no images and the conversation goes on.

The model: the example architecture with a toy image encoder (mlxrunner_test_support)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import mlxrunner
from mlxrunner.cli import chat_loop
from mlxrunner_test_support import media_bundle, png_bytes, wav_bytes

pytest.importorskip("PIL", reason="Pillow (the vision extra) is not installed")
pytest.importorskip("mlxrunner_example_architecture",
                    reason="the example-architecture plugin is not installed")
GREEDY = mlxrunner.SamplerOptions(temperature=0)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: Any) -> Any:
    return media_bundle(tmp_path_factory.mktemp("media-chat-model"))


def lines_of(*lines: str):
    items = iter(lines)

    def read(prompt: str) -> str:
        item = next(items, None)
        if item is None:
            raise EOFError
        return item

    return read


def _reply(bundle: Any, messages: list[dict[str, Any]], images: list[bytes]) -> str:
    prompt = bundle.renderer.render(messages, None, add_generation_prompt=True)
    ids = bundle.place_media(bundle.tokenizer.encode(prompt, add_special_tokens=False),
                             [("image", data) for data in images])
    stop = bundle.stop_token_ids()
    result = mlxrunner.generate(bundle.model, ids, options=GREEDY, max_tokens=6, eos_ids=stop)
    return bundle.tokenizer.decode([t for t in result.tokens if t not in stop])


def test_images_by_command_and_by_path_reach_the_model(bundle, tmp_path):
    first, second = tmp_path / "a.png", tmp_path / "b b.png"
    first.write_bytes(png_bytes(1))
    second.write_bytes(png_bytes(2, (8, 8)))
    out: list[str] = []
    messages = chat_loop(bundle, GREEDY, max_tokens=6, write=out.append, read=lines_of(
        f"/image {first}", "what is it?", f"and '{second}' next to it?"),
        conversations=tmp_path)
    said = "".join(out)
    assert f"Added image '{first}'" in said and f"Added image '{second}'" in said
    user = [m for m in messages if m["role"] == "user"]
    assert user[0]["content"][0] == {"type": "image", "data": str(first.resolve())}
    assert user[1]["content"][1] == {"type": "text", "text": "and next to it?"}
    # each reply: generate over the conversation so far, its images placed
    plain = [{"type": "image"}, {"type": "text", "text": "what is it?"}]
    want1 = _reply(bundle, [{"role": "user", "content": plain}], [png_bytes(1)])
    assert messages[1]["content"] == want1
    second_turn = [{"role": "user", "content": plain},
                   {"role": "assistant", "content": want1},
                   {"role": "user", "content": [{"type": "image"},
                                                {"type": "text", "text": "and next to it?"}]}]
    assert messages[3]["content"] == _reply(bundle, second_turn,
                                            [png_bytes(1), png_bytes(2, (8, 8))])


def test_a_saved_conversation_keeps_its_images(bundle, tmp_path):
    image = tmp_path / "c.png"
    image.write_bytes(png_bytes(4))
    chat_loop(bundle, GREEDY, max_tokens=6, write=lambda _: None, conversations=tmp_path,
              read=lines_of(f"what is {image}", "/save pics"))
    out: list[str] = []
    messages = chat_loop(bundle, GREEDY, max_tokens=6, write=out.append,
                         conversations=tmp_path, read=lines_of("/load pics", "more?"))
    assert "Loaded conversation 'pics' (2 messages)" in "".join(out)
    assert messages[0]["content"][0]["type"] == "image" and len(messages) == 4


def test_a_bad_image_or_a_text_only_model_is_one_line_and_the_chat_goes_on(bundle, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 20)
    out: list[str] = []
    messages = chat_loop(bundle, GREEDY, max_tokens=4, write=out.append, read=lines_of(
        f"/image {broken}", "/image", "hello"), conversations=tmp_path)
    said = "".join(out)
    assert "not an image" in said and "Usage: /image PATH" in said
    assert [m["content"] for m in messages if m["role"] == "user"] == ["hello"]
    from mlxrunner import host as plugins

    if "demo-qwen3.5" not in plugins.host().registry("models"):
        pytest.skip("the demo plugin (mlxrunner-demo) is not installed")
    text_only = mlxrunner.load("demo-qwen3.5")
    image = tmp_path / "d.png"
    image.write_bytes(png_bytes(5))
    out = []
    messages = chat_loop(text_only, GREEDY, max_tokens=3, write=out.append, read=lines_of(
        f"/image {image}", "what is it?", "hi"), conversations=tmp_path)
    assert "takes no image input (the message was not sent)" in "".join(out)
    assert [m["content"] for m in messages if m["role"] == "user"] == ["hi"]


def test_a_path_is_attached_only_where_an_image_file_is(bundle, tmp_path: Path):
    (tmp_path / "x.JPG").write_bytes(png_bytes(6))  # (a PNG named .JPG: its bytes decide)
    text = f"see {tmp_path}/x.JPG and {tmp_path}/missing.png or 'notes.txt'"
    messages = chat_loop(bundle, GREEDY, max_tokens=2, write=lambda _: None,
                         conversations=tmp_path, read=lines_of(text))
    assert messages[0]["content"] == [
        {"type": "image", "data": str((tmp_path / "x.JPG").resolve())},
        {"type": "text", "text": f"see and {tmp_path}/missing.png or 'notes.txt'"}]


def test_an_audio_clip_by_command_reaches_the_model(bundle, tmp_path):
    clip = tmp_path / "a.wav"
    clip.write_bytes(wav_bytes(2))
    out: list[str] = []
    messages = chat_loop(bundle, GREEDY, max_tokens=6, write=out.append, conversations=tmp_path,
                         read=lines_of(f"/audio {clip}", "what was that?"))
    assert f"Added audio '{clip}'" in "".join(out)
    assert messages[0]["content"][0] == {"type": "audio", "data": str(clip.resolve())}
    content = [{"type": "audio"}, {"type": "text", "text": "what was that?"}]
    prompt = bundle.renderer.render([{"role": "user", "content": content}], None,
                                    add_generation_prompt=True)
    ids = bundle.place_media(bundle.tokenizer.encode(prompt, add_special_tokens=False),
                             [("audio", wav_bytes(2))])
    stop = bundle.stop_token_ids()
    result = mlxrunner.generate(bundle.model, ids, options=GREEDY, max_tokens=6, eos_ids=stop)
    want = bundle.tokenizer.decode([t for t in result.tokens if t not in stop])
    assert messages[1]["content"] == want
