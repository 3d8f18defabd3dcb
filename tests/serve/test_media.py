"""Images through the server's three APIs: Ollama's ``images``, OpenAI's ``image_url`` (a data
URL), Anthropic's base64 ``image`` block, the Responses API's ``input_image``; each reply is
the one ``mlxrunner.generate`` gives the same conversation with the image placed (greedy).
Bad media (corrupt, oversized, a URL to fetch, an image sent to a text-only model) is one
JSON 4xx.

The model is the example architecture with a toy image encoder (mlxrunner_test_support),
in a folder whose tokenizer has an ``<|image|>`` token and whose chat template writes it
for an image part."""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

import pytest

import mlxrunner
from mlxrunner_test_support import media_bundle, png_bytes, wav_bytes

httpx = pytest.importorskip("httpx")
PIL = pytest.importorskip("PIL.Image", reason="Pillow (the vision extra) is not installed")
pytest.importorskip("mlxrunner_example_architecture",
                    reason="the example-architecture plugin is not installed")



def _png(seed: int, size: tuple[int, int] = (12, 8)) -> bytes:
    return png_bytes(seed, size)


@pytest.fixture(scope="module")
def media_server(tmp_path_factory: Any) -> Any:
    from mlxrunner.serve import Service

    from .conftest import Served

    bundle = media_bundle(tmp_path_factory.mktemp("media-model"))
    server = Served(Service(bundle, name="media"))
    yield server, bundle
    server.close()


def _expected(bundle: Any, image: bytes, text: str, tokens: int = 8) -> str:
    """What generate gives the conversation [image, text] alone, greedy."""
    content = [{"type": "image"}, {"type": "text", "text": text}]
    prompt = bundle.renderer.render([{"role": "user", "content": content}], None,
                                    add_generation_prompt=True)
    ids = bundle.place_media(bundle.tokenizer.encode(prompt, add_special_tokens=False),
                             [("image", image)])
    assert isinstance(ids, mlxrunner.MediaPrompt)
    out = mlxrunner.generate(bundle.model, ids, max_tokens=tokens,
                             options=mlxrunner.SamplerOptions(temperature=0.0),
                             eos_ids=bundle.stop_token_ids())
    return bundle.tokenizer.decode(out.tokens)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_every_api_answers_an_image_as_generate_does(media_server):
    server, bundle = media_server
    image = _png(1)
    want = _expected(bundle, image, "what is it?")
    other = _expected(bundle, _png(2), "what is it?")
    assert want != other  # the image decides the reply
    options = {"temperature": 0, "num_predict": 8}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        ollama = client.post("/api/chat", json={
            "model": "media", "stream": False, "options": options,
            "messages": [{"role": "user", "content": "what is it?", "images": [_b64(image)]}]})
        assert ollama.status_code == 200, ollama.text
        assert ollama.json()["message"]["content"] == want
        generated = client.post("/api/generate", json={
            "model": "media", "stream": False, "options": options, "prompt": "what is it?",
            "images": [_b64(image)]})
        assert generated.status_code == 200, generated.text
        assert generated.json()["response"] == want
        openai = client.post("/v1/chat/completions", json={
            "model": "media", "temperature": 0, "max_tokens": 8, "messages": [{
                "role": "user", "content": [
                    {"type": "image_url",
                     "image_url": {"url": "data:image/png;base64," + _b64(image)}},
                    {"type": "text", "text": "what is it?"}]}]})
        assert openai.status_code == 200, openai.text
        assert openai.json()["choices"][0]["message"]["content"] == want
        anthropic = client.post("/v1/messages", json={
            "model": "media", "temperature": 0, "max_tokens": 8, "messages": [{
                "role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": _b64(image)}},
                    {"type": "text", "text": "what is it?"}]}]})
        assert anthropic.status_code == 200, anthropic.text
        assert "".join(b.get("text", "") for b in anthropic.json()["content"]) == want
        responses = client.post("/v1/responses", json={
            "model": "media", "temperature": 0, "max_output_tokens": 8, "input": [{
                "role": "user", "content": [
                    {"type": "input_image", "image_url": "data:image/png;base64," + _b64(image)},
                    {"type": "input_text", "text": "what is it?"}]}]})
        assert responses.status_code == 200, responses.text
        texts = [part["text"] for item in responses.json()["output"]
                 for part in item.get("content", []) if part.get("type") == "output_text"]
        assert "".join(texts) == want


def _error(response: Any) -> str:
    body = response.json()
    return json.dumps(body)


@pytest.mark.parametrize("case", ["corrupt", "oversized", "url", "not base64", "count"])
def test_bad_media_is_one_json_4xx(media_server, case):
    server, _ = media_server
    image = _png(1)
    url = "data:image/png;base64," + _b64(image)
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}}]
    if case == "corrupt":
        parts[0]["image_url"]["url"] = "data:image/png;base64," + _b64(image[:40] + b"\0" * 60)
    elif case == "oversized":  # a PNG header that claims 30000 x 30000 pixels
        header = bytearray(image[:33])
        header[16:24] = (30000).to_bytes(4, "big") * 2
        header[29:33] = zlib.crc32(bytes(header[12:29])).to_bytes(4, "big")
        parts[0]["image_url"]["url"] = "data:image/png;base64," + _b64(bytes(header) + image[33:])
    elif case == "url":
        parts[0]["image_url"]["url"] = "https://example.com/cat.png"
    elif case == "not base64":
        parts[0]["image_url"]["url"] = "data:image/png;base64,%%%"
    else:  # two placeholders written for one image
        parts.append({"type": "text", "text": "<|image|>"})
    with httpx.Client(base_url=server.url, timeout=60) as client:
        got = client.post("/v1/chat/completions", json={
            "model": "media", "max_tokens": 4,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}]})
    assert 400 <= got.status_code < 500, got.text
    assert got.headers["content-type"].startswith("application/json")
    message = _error(got)
    assert {"corrupt": "image", "oversized": "pixels", "url": "not fetched",
            "not base64": "base64", "count": "placeholder"}[case] in message


def test_show_lists_vision_for_a_model_with_an_image_encoder(media_server, served):
    server, _ = media_server
    with httpx.Client(timeout=60) as client:
        media = client.post(server.url + "/api/show", json={"model": "media"}).json()
        text = client.post(served.url + "/api/show", json={"model": "demo"}).json()
    assert "vision" in media["capabilities"] and "completion" in media["capabilities"]
    assert "vision" not in text["capabilities"] and "audio" not in text["capabilities"]


def test_an_image_sent_to_a_text_only_model_is_a_400_naming_it(served):
    with httpx.Client(base_url=served.url, timeout=60) as client:
        got = client.post("/api/chat", json={
            "model": "demo", "stream": False,
            "messages": [{"role": "user", "content": "hi", "images": [_b64(_png(1))]}]})
    assert got.status_code == 400, got.text
    assert "takes no image input" in got.text


def test_the_official_clients_send_an_image(media_server):
    server, bundle = media_server
    image = _png(3)
    want = _expected(bundle, image, "and this?")
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    reply = client.chat.completions.create(model="media", temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(image)}},
            {"type": "text", "text": "and this?"}]}])
    assert reply.choices[0].message.content == want
    anthropic = pytest.importorskip("anthropic")
    reply2 = anthropic.Anthropic(base_url=server.url, api_key="none").messages.create(
        model="media", max_tokens=8, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": _b64(image)}},
            {"type": "text", "text": "and this?"}]}])
    assert "".join(getattr(b, "text", "") for b in reply2.content) == want
    ollama = pytest.importorskip("ollama")
    reply3 = ollama.Client(host=server.url).chat(
        model="media", options={"temperature": 0, "num_predict": 8},
        messages=[{"role": "user", "content": "and this?", "images": [image]}])
    assert reply3["message"]["content"] == want



def test_openai_input_audio_reaches_an_audio_encoder(media_server):
    server, bundle = media_server
    clip = wav_bytes(1)
    content = [{"type": "input_audio"}, {"type": "text", "text": "what is it?"}]
    prompt = bundle.renderer.render([{"role": "user", "content": content}], None,
                                    add_generation_prompt=True)
    ids = bundle.place_media(bundle.tokenizer.encode(prompt, add_special_tokens=False),
                             [("audio", clip)])
    out = mlxrunner.generate(bundle.model, ids, max_tokens=8, eos_ids=bundle.stop_token_ids(),
                             options=mlxrunner.SamplerOptions(temperature=0.0))
    want = bundle.tokenizer.decode(out.tokens)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        got = client.post("/v1/chat/completions", json={
            "model": "media", "temperature": 0, "max_tokens": 8, "messages": [{
                "role": "user", "content": [
                    {"type": "input_audio", "input_audio": {"data": _b64(clip),
                                                            "format": "wav"}},
                    {"type": "text", "text": "what is it?"}]}]})
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["message"]["content"] == want
        broken = client.post("/v1/chat/completions", json={
            "model": "media", "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": _b64(b"RIFF" + b"\0" * 40),
                                                        "format": "wav"}}]}]})
    assert broken.status_code == 400 and "audio" in broken.text
