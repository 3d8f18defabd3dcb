"""Media content parts in the native renderers: the placeholders the published templates write.

Conversations holding images (``image``, ``image_url``, Ollama's ``images``), audio
(``audio``, ``input_audio``) and video parts render with the native ``qwen3.5`` and
``gemma4-*`` renderers exactly as the published templates render them, run three ways: by
the core's ``jinja`` renderer, by a plain jinja2 sandbox set up here (an independent
reading), and, under the ``reference`` marker, by transformers' ``apply_chat_template``.
Where a template raises (Qwen: media in the system message, audio), the native renderer
raises a one-line ``ConversationError``. Each placeholder is one token of the model's
tokenizer, and a prompt holds one placeholder per part that ``media_parts`` lists.
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path

import jinja2
import jinja2.sandbox
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlxrunner
from mlxrunner import ConversationError
from mlxrunner.chat import JinjaRenderer, media_parts
from mlxrunner.plugin import RenderContext

pytest.importorskip("mlxrunner_renderer_qwen3_5", reason="mlxrunner-renderer-qwen3-5 not installed")
pytest.importorskip("mlxrunner_renderer_gemma4", reason="mlxrunner-renderer-gemma4 not installed")

REPO = Path(__file__).resolve().parent.parent
NEMOTRON_FIXTURE = REPO / "renderers" / "gemma4" / "tests" / "fixtures" / "gemma4-nemotron.jinja"
TEMPLATE_OF = {"qwen3.5": "qwen3_5.jinja", "gemma4-small": "gemma4-small.jinja",
               "gemma4-large": "gemma4-large.jinja", "gemma4-nemotron": None}
RENDERERS = list(TEMPLATE_OF)
GEMMAS = [name for name in RENDERERS if name.startswith("gemma4")]

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
#: each renderer's placeholder text per modality (Qwen3.5 has none for audio: it raises)
PLACEHOLDERS = {"qwen3.5": {"image": IMAGE, "video": VIDEO}}
PLACEHOLDERS.update({name: {"image": "<|image|>", "audio": "<|audio|>", "video": "<|video|>"}
                     for name in GEMMAS})
PNG = "iVBORw0KGgo="  # base64 stand-ins: renderers never read the media itself
WAV = "UklGRg=="


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def url(value: str) -> dict:
    return {"type": "image_url", "image_url": {"url": value}}


# Conversations with media in user (and tool) messages; ``images`` is Ollama's form.
CASES: dict[str, list[dict]] = {
    "one image": [{"role": "user", "content": [text("What is in this picture?"),
                                               {"type": "image"}]}],
    "image first": [{"role": "user", "content": [{"type": "image"}, text(" Describe it. ")]}],
    "two images": [{"role": "user", "content": [url(f"data:image/png;base64,{PNG}"),
                                                url("https://example.com/b.png"),
                                                text("Which one is bigger?")]}],
    "image between texts": [{"role": "user", "content": [text("Before "), {"type": "image"},
                                                         text(" after")]}],
    "image part forms": [{"role": "user", "content": [
        {"type": "image", "image": "https://example.com/a.png"}, {"type": "image", "data": PNG},
        {"type": "image_url", "image_url": "https://example.com/c.png"}, text("Three.")]}],
    "multi-turn": [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": [{"type": "image"}, text("What is this?")]},
        {"role": "assistant", "content": "A cat.", "reasoning_content": "Fur, whiskers."},
        {"role": "user", "content": [text("And these?"), {"type": "image"}, {"type": "image"}]},
        {"role": "assistant", "content": "Two dogs."},
        {"role": "user", "content": "Thanks. One more:"}],
    "tool result image": [
        {"role": "user", "content": [{"type": "image"}, text("Zoom into the corner.")]},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "zoom", "arguments": {"corner": "top left"}}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "zoom",
         "content": [text("zoomed"), {"type": "image"}]},
        {"role": "user", "content": "What do you see now?"}],
    "video": [{"role": "user", "content": [{"type": "video"}, text("Summarise the clip.")]}],
    "audio": [{"role": "user", "content": [{"type": "audio"}, text("Transcribe this.")]}],
    "input audio": [{"role": "user", "content": [
        text("Two clips: "), {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}},
        {"type": "audio", "audio": "clip.wav"}]}],
    "every modality": [{"role": "user", "content": [
        {"type": "image"}, {"type": "audio"}, {"type": "video"}, text("All three.")]}],
    "image_url without its url": [{"role": "user", "content": [{"type": "image_url"},
                                                               text("Bare.")]}],
    "system image": [{"role": "system", "content": [text("Style guide:"), {"type": "image"}]},
                     {"role": "user", "content": "Hi"}],
    "system video": [{"role": "system", "content": [{"type": "video"}]},
                     {"role": "user", "content": "Hi"}],
    "ollama images": [{"role": "user", "content": "What differs?", "images": [PNG, PNG]}],
}
#: the conversation each Ollama-style case means: its images' parts before its text
AS_PARTS = {"ollama images": [{"role": "user", "content": [
    {"type": "image", "data": PNG}, {"type": "image", "data": PNG}, text("What differs?")]}]}
#: where the published template raises (and so must the native renderer)
RAISES = {"qwen3.5": {"audio", "input audio", "every modality", "image_url without its url",
                      "system image", "system video"}}
TOOLS = [{"type": "function", "function": {
    "name": "zoom", "description": "Zoom into a corner of the last image.",
    "parameters": {"type": "object", "required": ["corner"],
                   "properties": {"corner": {"type": "string"}}}}}]


def _template(shared: Path, name: str) -> str:
    file = TEMPLATE_OF[name]
    return (NEMOTRON_FIXTURE if file is None else shared / "templates" / file).read_text()


def _context(shared: Path, name: str, **template_kwargs) -> RenderContext:
    return RenderContext(chat_template=_template(shared, name),
                         bos_token=None if name == "qwen3.5" else "<bos>",
                         extra={"template_kwargs": template_kwargs} if template_kwargs else {})


@functools.cache
def _renderers(shared: Path, name: str, vision_id: bool = False):
    """(native, core jinja, plain jinja2 template), compiled once."""
    context = _context(shared, name, **({"add_vision_id": True} if vision_id else {}))
    return (mlxrunner.get_renderer(name, context), JinjaRenderer.from_context(context),
            _plain_environment().from_string(context.chat_template))


class _TemplateRaised(Exception):
    pass


def _raise(message: str) -> None:
    raise _TemplateRaised(message)


def _plain_environment() -> jinja2.Environment:
    """jinja2 as transformers sets it up, without the core's renderer in the way."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = lambda value, ensure_ascii=False, indent=None, separators=None, \
        sort_keys=False: json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                                    separators=separators, sort_keys=sort_keys)
    return env


def _plain_render(template, name: str, messages, tools=None, think=None, **variables) -> str:
    if think is not None:
        variables["enable_thinking"] = think
    if name != "qwen3.5":
        variables["bos_token"] = "<bos>"
    return template.render(messages=messages, tools=tools, add_generation_prompt=True,
                           **variables)


def _one_line_error(render, *args, **kwargs) -> str:
    with pytest.raises(ConversationError) as info:
        render(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


# -- byte-identical to the templates -------------------------------------------------------


@pytest.mark.parametrize("name", RENDERERS)
@pytest.mark.parametrize("case", list(CASES))
def test_media_renders_as_the_published_template(shared_data_dir, name, case):
    native, core, plain = _renderers(shared_data_dir, name)
    messages = CASES[case]
    meant = AS_PARTS.get(case, messages)  # what a template written for parts is given
    for think in (None, True, False):
        for tools in (None, TOOLS):
            where = f"{name} {case} think={think} tools={bool(tools)}"
            if case in RAISES.get(name, ()):
                with pytest.raises(_TemplateRaised):
                    _plain_render(plain, name, meant, tools, think)
                error = _one_line_error(native.render, messages, tools, think=think)
                assert name in error, where  # names the format that refuses it
                with pytest.raises(ConversationError):
                    core.render(messages, tools, think=think)
                continue
            expected = _plain_render(plain, name, meant, tools, think)
            assert native.render(messages, tools, think=think) == expected, where
            assert core.render(meant, tools, think=think) == expected, where
            assert core.render(messages, tools, think=think) == expected, where


def test_qwen_placeholders_written_out(shared_data_dir):
    native, _, _ = _renderers(shared_data_dir, "qwen3.5")
    assert native.render(CASES["one image"]) == (
        f"<|im_start|>user\nWhat is in this picture?{IMAGE}<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    assert native.render(CASES["image between texts"], think=False) == (
        f"<|im_start|>user\nBefore {IMAGE} after<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Ollama's images: one placeholder each, before the text
    assert native.render(CASES["ollama images"], add_generation_prompt=False) == (
        f"<|im_start|>user\n{IMAGE}{IMAGE}What differs?<|im_end|>\n")


def test_gemma_placeholders_written_out(shared_data_dir):
    small, _, _ = _renderers(shared_data_dir, "gemma4-small")
    assert small.render(CASES["every modality"]) == \
        "<bos><|turn>user\n<|image|><|audio|><|video|>All three.<turn|>\n<|turn>model\n"
    assert small.render(CASES["image first"]) == \
        "<bos><|turn>user\n<|image|>Describe it.<turn|>\n<|turn>model\n"
    # a tool's image follows its response block, inside the model turn that called it
    assert ('<|tool_response>response:zoom{value:<|"|>zoomed<|"|>}<tool_response|><|image|>'
            in small.render(CASES["tool result image"]))


def test_qwen_refuses_system_media_and_audio_in_one_line(shared_data_dir):
    native, _, _ = _renderers(shared_data_dir, "qwen3.5")
    for tools in (None, TOOLS):
        assert "message 0: a system message cannot contain images in the qwen3.5 format" == \
            _one_line_error(native.render, CASES["system image"], tools)
        assert "cannot contain videos" in \
            _one_line_error(native.render, CASES["system video"], tools)
    assert "content part 0 of type 'audio' is not supported by the qwen3.5 format" in \
        _one_line_error(native.render, CASES["audio"])


def test_gemma_drops_system_media_as_its_template_does(shared_data_dir):
    """Gemma 4's template writes a system message's parts as their text alone: the image
    gets no placeholder, so ``media_parts`` (one entry) and the prompt (none) disagree,
    which is how the core notices media it cannot place."""
    for name in GEMMAS:
        native, _, _ = _renderers(shared_data_dir, name)
        out = native.render(CASES["system image"])
        assert out.startswith("<bos><|turn>system\nStyle guide:  <turn|>\n"), name
        assert "<|image|>" not in out
    assert [modality for modality, _ in media_parts(CASES["system image"])] == ["image"]


def test_gemma_writes_an_assistant_turns_media_after_its_tool_results(shared_data_dir):
    """The one place a Gemma 4 prompt's order differs from ``media_parts``' (documented
    there): the template folds tool results in before the assistant's own content;
    ``gemma4-nemotron`` writes the content first, so its order is the messages'."""
    chat = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": [text("mine"), {"type": "video"}],
             "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
            {"role": "tool", "content": [{"type": "image"}]},
            {"role": "user", "content": "ok"}]
    assert [modality for modality, _ in media_parts(chat)] == ["video", "image"]
    for name, first, second in [("gemma4-small", "<|image|>", "<|video|>"),
                                ("gemma4-nemotron", "<|video|>", "<|image|>")]:
        native, _, plain = _renderers(shared_data_dir, name)
        out = native.render(chat)
        assert out == _plain_render(plain, name, chat)
        assert out.index(first) < out.index(second), name


# -- add_vision_id -------------------------------------------------------------------------

VISION_ID_CHAT = [
    {"role": "user", "content": [{"type": "image"}, url("https://example.com/b.png"),
                                 {"type": "video"}, text("Compare.")]},
    {"role": "assistant", "content": "Done."},
    {"role": "user", "content": [text("Now"), {"type": "video"}, {"type": "image"}]}]


def test_qwen_add_vision_id_numbers_pictures_and_videos(shared_data_dir):
    native, core, plain = _renderers(shared_data_dir, "qwen3.5", vision_id=True)
    expected = (f"<|im_start|>user\nPicture 1: {IMAGE}Picture 2: {IMAGE}Video 1: {VIDEO}"
                "Compare.<|im_end|>\n<|im_start|>assistant\nDone.<|im_end|>\n"
                f"<|im_start|>user\nNowVideo 2: {VIDEO}Picture 3: {IMAGE}<|im_end|>\n"
                "<|im_start|>assistant\n<think>\n")
    assert _plain_render(plain, "qwen3.5", VISION_ID_CHAT, add_vision_id=True) == expected
    assert core.render(VISION_ID_CHAT) == expected
    assert native.render(VISION_ID_CHAT) == expected
    # the keyword, and off by default or when false
    from mlxrunner_renderer_qwen3_5 import Qwen35Renderer
    assert Qwen35Renderer(add_vision_id=True).render(VISION_ID_CHAT) == expected
    for context in (None, RenderContext(extra={"template_kwargs": {"add_vision_id": False}})):
        assert "Picture" not in mlxrunner.get_renderer("qwen3.5", context).render(VISION_ID_CHAT)


@pytest.mark.parametrize("case", sorted(set(CASES) - RAISES["qwen3.5"]))
def test_qwen_add_vision_id_matches_the_template(shared_data_dir, case):
    native, core, plain = _renderers(shared_data_dir, "qwen3.5", vision_id=True)
    meant = AS_PARTS.get(case, CASES[case])
    for tools in (None, TOOLS):
        expected = _plain_render(plain, "qwen3.5", meant, tools, add_vision_id=True)
        assert native.render(CASES[case], tools) == expected
        assert core.render(CASES[case], tools) == expected
        if any(modality == "image" for modality, _ in media_parts(CASES[case])):
            assert "Picture 1: " + IMAGE in expected


# -- placeholders, media_parts and tokens --------------------------------------------------


@pytest.mark.parametrize("name", RENDERERS)
def test_one_placeholder_per_listed_part(shared_data_dir, name):
    native, _, _ = _renderers(shared_data_dir, name)
    checked = 0
    for case, messages in CASES.items():
        if case in RAISES.get(name, ()) or case.startswith("system"):
            continue
        out = native.render(messages, TOOLS, think=True)
        listed = [modality for modality, _ in media_parts(messages)]
        assert listed, case
        for modality, placeholder in PLACEHOLDERS[name].items():
            assert out.count(placeholder) == listed.count(modality), (case, modality)
        checked += 1
    assert checked >= 9


def _tokenizer(shared: Path, name: str):
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers not installed")
    path = shared / "tokenizers" / f"{name}-tokenizer.json.gz"
    if not path.is_file():
        pytest.skip(f"tokenizer not found: {path}")
    with gzip.open(path) as f:
        return tokenizers.Tokenizer.from_str(f.read().decode("utf-8"))


# ids from shared/data/tokenizers/special_tokens.json
MEDIA_IDS = {"qwen3_5": {"<|vision_start|>": 248053, "<|vision_end|>": 248054,
                         "<|image_pad|>": 248056, "<|video_pad|>": 248057},
             "gemma4": {"<|image|>": 258880, "<|audio|>": 258881, "<|video|>": 258884}}


@pytest.mark.parametrize("tokenizer_name", list(MEDIA_IDS))
def test_every_placeholder_is_one_token(shared_data_dir, tokenizer_name):
    tokenizer = _tokenizer(shared_data_dir, tokenizer_name)
    ids_of = MEDIA_IDS[tokenizer_name]
    names = ["qwen3.5"] if tokenizer_name == "qwen3_5" else GEMMAS
    seen = set()
    for name in names:
        native, _, _ = _renderers(shared_data_dir, name)
        for case, messages in CASES.items():
            if case in RAISES.get(name, ()):
                continue
            prompt = native.render(messages)
            ids = tokenizer.encode(prompt, add_special_tokens=False).ids
            for marker, marker_id in ids_of.items():
                assert tokenizer.token_to_id(marker) == marker_id
                assert ids.count(marker_id) == prompt.count(marker), (name, case, marker)
                if marker in prompt:
                    seen.add(marker)
            assert tokenizer.decode(ids, skip_special_tokens=False) == prompt
    assert seen == set(ids_of)


# -- generated media conversations ---------------------------------------------------------

media_part = st.sampled_from([
    {"type": "image"}, {"type": "image", "data": PNG}, url("https://example.com/x.png"),
    {"type": "image_url"}, {"type": "video"}, {"type": "audio"},
    {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}}])
words = st.text("ab é\n <>|", max_size=6)
parts = st.lists(st.one_of(media_part, words.map(text)), min_size=1, max_size=4)


@st.composite
def media_chat(draw):
    chat = []
    if draw(st.booleans()):
        chat.append({"role": "system", "content": draw(st.one_of(words, parts))})
    for _ in range(draw(st.integers(1, 3))):
        user = {"role": "user", "content": draw(st.one_of(words, parts))}
        if draw(st.integers(0, 3)) == 0:
            user["images"] = draw(st.lists(st.just(PNG), min_size=1, max_size=2))
        chat.append(user)
        if draw(st.booleans()):
            chat.append({"role": "assistant", "content": draw(words)})
    return chat


@pytest.mark.parametrize("name", RENDERERS)
def test_generated_media_conversations_match_the_template(shared_data_dir, name):
    rendered = []

    @settings(max_examples=80, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(media_chat(), st.booleans(), st.sampled_from([None, True, False]))
    def check(chat, vision_id, think):
        native, core, _ = _renderers(shared_data_dir, name, vision_id and name == "qwen3.5")
        try:
            expected = core.render(chat, think=think)
        except ConversationError:
            with pytest.raises(ConversationError):
                native.render(chat, think=think)
            return
        assert native.render(chat, think=think) == expected
        rendered.append(1)

    check()
    assert len(rendered) >= 20  # most examples render rather than raise


# -- transformers itself -------------------------------------------------------------------


@pytest.mark.reference
@pytest.mark.parametrize("name", RENDERERS)
def test_native_media_renders_match_transformers(shared_data_dir, name):
    transformers = pytest.importorskip("transformers", reason="transformers not installed")
    from tokenizers import Tokenizer, models

    backend = Tokenizer(models.WordLevel({"<bos>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    tokens = {"eos_token": "<eos>", "unk_token": "<unk>"}
    if name != "qwen3.5":
        tokens["bos_token"] = "<bos>"
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **tokens)
    tokenizer.chat_template = _template(shared_data_dir, name)
    native, _, _ = _renderers(shared_data_dir, name)
    for case, messages in CASES.items():
        if case in RAISES.get(name, ()):
            continue
        expected = tokenizer.apply_chat_template(AS_PARTS.get(case, messages), tokenize=False,
                                                 add_generation_prompt=True)
        assert native.render(messages) == expected, case
