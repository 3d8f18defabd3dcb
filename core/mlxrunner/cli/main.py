"""The ``mlxrunner`` command line.

Heavy imports (MLX, plugins' models) happen inside the commands that need
them, so ``mlxrunner --help`` stays fast. Every user error is one line on
stderr and a non-zero exit; ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..errors import MLXRunnerError, PluginError
from ..host import manager as plugins
from . import bench, client, store, streamed
from .arguments import at_least, count, output_format, port

DEFAULT_PROMPT = "What is the capital of France?"


class CommandRegistry:
    """Handed to ``register_commands(cli)``: plugins add subcommands through it."""

    def __init__(self, subparsers: Any) -> None:
        self._subparsers = subparsers
        self.handlers: dict[str, Callable[[argparse.Namespace], int | None]] = {}
        self.owners: dict[str, str] = {}

    def command(self, name: str, help: str,
                add_arguments: Callable[[argparse.ArgumentParser], None],
                run: Callable[[argparse.Namespace], int | None], *,
                plugin: str = "mlxrunner", aliases: Sequence[str] = ()) -> None:
        """Add command ``name`` (and its ``aliases``, other names of it); ``plugin`` (the
        plugin host passes it) names who adds it. A name already taken is a PluginError
        naming both; nothing is added. Should ``add_arguments`` raise, the half-built
        command is taken out again."""
        for taken in (name, *aliases):
            if taken in self.handlers:
                owner = self.owners[taken]
                raise PluginError(f"command {taken!r} is registered by both {owner} and "
                                  f"{plugin}; the name stays with {owner} (the later "
                                  "registration is skipped)")
        parser = self._subparsers.add_parser(name, help=help, description=help,
                                             aliases=list(aliases))
        try:
            add_arguments(parser)
        except BaseException:
            for added in (name, *aliases):
                self._remove_parser(added)
            raise
        for added in (name, *aliases):
            self.handlers[added] = run
            self.owners[added] = plugin

    def _remove_parser(self, name: str) -> None:
        """Undo ``add_parser(name)`` (argparse has no public way to)."""
        self._subparsers._name_parser_map.pop(name, None)
        self._subparsers._choices_actions[:] = [
            action for action in self._subparsers._choices_actions if action.dest != name]


# -- listing commands --------------------------------------------------------
def cmd_plugins(args: argparse.Namespace) -> int:
    host = plugins.host()
    items = [{"plugin": p.name, "distribution": p.distribution, "version": p.version,
              "hooks": p.hooks} for p in host.plugin_list()]
    print(json.dumps(items, indent=2))
    return 0


def _list_kind(kind: str, as_json: bool) -> int:
    regs = sorted(plugins.iter_registrations(kind), key=lambda r: r.name)
    if as_json:
        print(json.dumps([{"name": r.name, "plugin": r.plugin} for r in regs], indent=2))
        return 0
    if not regs:
        print(f"no {kind} installed")
        return 0
    width = max(len(r.name) for r in regs)
    for r in regs:
        print(f"{r.name.ljust(width)}  {r.plugin}")
    return 0


# -- show ------------------------------------------------------------------
def cmd_show(args: argparse.Namespace) -> int:
    from ..bundle import load, parameter_count, stored_precision
    from ..model.builtin_draft import describe_checkpoint_draft

    bundle = load(args.model, draft=args.draft, renderer=args.renderer, dtype=args.dtype)
    model = bundle.model
    arch = (bundle.config.get("architectures") or [bundle.config.get("model_type")])[0]
    info: dict[str, Any] = {
        "model": model_label(args.model, bundle),
        "architecture": arch,
        "parameters": parameter_count(model),
        "layers": model.num_layers,
        "vocab_size": model.vocab_size,
        "target_precision": model.weight_precision,
        "target_stored_precision": stored_precision(bundle, "target"),
        "target_compute_dtype": _dtype_name(model.dtype),
        "draft": str(bundle.draft_path) if bundle.draft_path else
        describe_checkpoint_draft(bundle.draft) or
        ("bundled" if bundle.draft is not None else None),
        "draft_precision": getattr(bundle.draft, "weight_precision", None)
        if bundle.draft is not None else None,
        "draft_stored_precision": stored_precision(bundle, "draft"),
        "draft_compute_dtype": _dtype_name(bundle.draft.dtype)
        if bundle.draft is not None else None,
        "renderer": bundle.renderer_name,
        "parser": bundle.parser_name,
        "taps": bool(getattr(model, "supports_taps", False)),
        "capabilities": bundle.capabilities(),
        "defaults": {k: v for k, v in vars(bundle.defaults).items() if v is not None},
    }
    info["folder"] = str(Path(bundle.path).expanduser().resolve())
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key in ("model", "folder", "architecture", "parameters", "layers", "vocab_size",
                "target_precision", "draft", "draft_precision", "renderer", "parser", "taps",
                "capabilities"):
        if key == "folder" and info["folder"] == info["model"]:
            continue  # (a folder was named)
        value = info[key]
        if key == "parameters":
            value = _human_count(value)
        elif key == "capabilities":
            value = ", ".join(value)
        elif key.endswith("_precision") and value is not None:
            part = key.removesuffix("_precision")
            value = (f"{info[part + '_stored_precision']} (stored), computed in "
                     f"{info[part + '_compute_dtype']}")
        print(f"{key.replace('_', ' '):17} {value if value is not None else '-'}")
    return 0


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("mlx.core.", "")


def _human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit} ({n})"
    return str(n)


# -- run -------------------------------------------------------------------
def _sampler_flags() -> dict[str, type]:
    """Every sampler option but the boolean ``logprobs``, with the type its flag parses."""
    from dataclasses import fields

    from ..decode.options import SamplerOptions

    kinds = {}
    for f in fields(SamplerOptions):
        default = f.default if f.default is not None else 0
        if not isinstance(default, bool):
            kinds[f.name] = type(default)
    return kinds


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("args", nargs="*", metavar="[MODEL] [PROMPT]",
                   help="model folder, Modelfile or registered name (default: the model "
                        "registered as 'default'), then the prompt ('-' reads stdin; none: "
                        "a conversation at a terminal, else the piped input)")
    p.add_argument("--max-tokens", "-n", "--num-predict", dest="max_tokens", type=count(1),
                   default=None, help="tokens to generate (256)")
    from ..decode.options import OPTION_HELP

    for name, kind in _sampler_flags().items():
        # the bounds the server's APIs take (the temperature: 0 is greedy, as there)
        parse = at_least(0.0) if name == "temperature" else kind
        p.add_argument("--" + name.replace("_", "-"), type=parse, default=None,
                       help=OPTION_HELP.get(name))
    p.add_argument("--logprobs", action="store_true", default=None,
                   help=OPTION_HELP["logprobs"] + " (decodes without drafting)")
    _add_model_arguments(p)
    p.add_argument("--format", type=output_format, metavar="json|SCHEMA_FILE",
                   help="structured output: any JSON object, or JSON matching a JSON Schema "
                        "file")
    p.add_argument("--think", choices=["on", "off"], help="thinking on or off (template default)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image the prompt shows the model (repeat for more; PNG, JPEG, "
                        "WebP, GIF or BMP; needs a model with an image encoder)")
    p.add_argument("--audio", action="append", default=[], metavar="PATH",
                   help="an audio clip the prompt has the model hear (repeat for more; WAV, "
                        "or FLAC, Ogg, MP3 with mlxrunner[audio]; needs a model with an "
                        "audio encoder)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is (no chat format)")
    p.add_argument("--stats", action="store_true", help="print statistics to stderr")
    p.add_argument("--verbose", action="store_true",
                   help="statistics with what each figure means (in a conversation: after "
                        "each reply)")
    p.add_argument("--compare", action="store_true",
                   help="also decode without the draft and print both statistics")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--chat", action="store_true",
                   help="a multi-turn conversation even when input is piped, one message per "
                        "line (the default at a terminal when no prompt is given; /? there "
                        "lists its commands)")


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """How `run` and `serve` load a model: its chat format, draft and dtype."""
    p.add_argument("--renderer", help="chat-format renderer by name")
    p.add_argument("--parser", help="output parser by name")
    p.add_argument("--draft", help="draft folder (DFlash/DFlash2) for speculative decoding")
    p.add_argument("--no-draft", action="store_true", help="decode without the model's draft")
    p.add_argument("--dtype", help="cast weights: float32, float16, bfloat16")
    p.add_argument("--distributed", choices=["tensor", "pipeline"],
                   help="one rank of a job of several processes (mlx.launch, or --ranks): "
                        "the target split by heads (tensor) or by layers (pipeline); rank 0 "
                        "alone talks (docs/distributed.md)")
    p.add_argument("--ranks", type=count(2), default=None,
                   help="with --distributed: start that many ranks on this machine")


def _load_model_arguments(model: str, args: argparse.Namespace) -> Any:
    """The bundle of ``model`` as the options of :func:`_add_model_arguments` ask."""
    from ..bundle import load

    return load(model, draft=args.draft, renderer=args.renderer, parser=args.parser,
                dtype=args.dtype, use_draft=not args.no_draft,
                distributed=getattr(args, "distributed", None))


def _join_job(args: argparse.Namespace) -> Any:
    """With ``--distributed``: join the job's group, rank 0 alone talking (None without)."""
    if getattr(args, "distributed", None) is None:
        if getattr(args, "ranks", None) is not None:
            raise MLXRunnerError("--ranks starts ranks of a distributed job: add "
                                 "--distributed tensor or --distributed pipeline")
        return None
    from ..distributed import world
    from ..distributed.ranks import speak_only_on_rank_0

    group = world()
    speak_only_on_rank_0(group)
    return group


def _read_piped_line(prompt: str) -> str:
    """A line of piped input (no prompt echoed); EOFError at the end."""
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def _split_model_and_prompt(args: Sequence[str]) -> tuple[str | None, str | None]:
    if not args:
        return None, None
    if len(args) >= 2:
        return args[0], " ".join(args[1:])
    only = args[0]
    # One word is a model name, as with `ollama run NAME` (an unknown one is an error, never
    # a prompt); a prompt of one argument has a space in it (or is "-": standard input).
    looks_like_model = Path(only).expanduser().exists() or \
        (only != "-" and only.strip() != "" and not any(c.isspace() for c in only))
    return (only, None) if looks_like_model else (None, only)


def model_label(given: str, bundle: Any) -> str:
    """How output names the model: what the user gave, a store or registered name as it is
    (not the store's folder), a folder or GGUF file as its path."""
    path = Path(given).expanduser()
    return str(path.resolve()) if path.exists() else given


def cap_notice(max_tokens: int) -> str:
    """What a reply cut at the token cap says after its text."""
    return f"(the reply reached the {max_tokens}-token cap; --max-tokens or -n raises it)"


def _sampler_overrides(args: argparse.Namespace) -> dict[str, Any]:
    out = {name: getattr(args, name) for name in _sampler_flags()
           if getattr(args, name) is not None}
    if args.logprobs:
        out["logprobs"] = True
    return out


def build_prompt(bundle: Any, prompt: str, *, raw: bool, system: str | None,
                 think: bool | None, images: Sequence[str] = (),
                 audio: Sequence[str] = ()) -> tuple[str, Sequence[int]]:
    """The prompt text the model sees and its token ids (with ``images`` and ``audio``,
    files read with the core's limits: the ids with them at their placeholders; they come
    before the text, images first, as ``ollama run`` sends images)."""
    from ..media import MAX_AUDIO_BYTES, read_image
    from ..media.files import read_media_file

    tok = bundle.tokenizer
    # (a clip's bytes: place_media decodes them at its encoder's sample rate)
    media = [("image", read_image(path)) for path in images] + \
        [("audio", read_media_file(path, MAX_AUDIO_BYTES, "audio")) for path in audio]
    if raw or bundle.renderer is None:
        return prompt, bundle.place_media(tok.encode(prompt, add_special_tokens=True), media)
    messages: list[dict[str, Any]] = []
    system = system if system is not None else bundle.extra.get("system")
    if system:
        messages.append({"role": "system", "content": system})
    content: Any = prompt
    if media:
        content = [*({"type": kind} for kind, _ in media), {"type": "text", "text": prompt}]
    messages.append({"role": "user", "content": content})
    with plugins.plugin_code("renderers", bundle.renderer_name):
        text = bundle.renderer.render(messages, None, think=think, add_generation_prompt=True)
    return text, bundle.place_media(tok.encode(text, add_special_tokens=False), media)


def cmd_run(args: argparse.Namespace) -> int:
    group = _join_job(args)
    model_arg, prompt = _split_model_and_prompt(args.args)
    if model_arg is None:
        if "default" not in plugins.host().registry("models"):
            raise MLXRunnerError(
                "no model given and none is registered as 'default': pass a model folder "
                "(mlxrunner run ./model \"prompt\") or install the demo plugin "
                "(pip install ./plugins/demo)")
        model_arg = "default"
    if prompt == "-":
        prompt = sys.stdin.read()
    # No prompt at a terminal (or --chat): a conversation, as `ollama run` does; piped in,
    # the input is the prompt (nothing piped: the default prompt).
    interactive = sys.stdin.isatty()
    chat = args.chat or (prompt is None and interactive and not args.json)
    if prompt is None and not chat:
        piped = sys.stdin.read().rstrip("\n") if not interactive else ""
        prompt = piped if piped.strip() else DEFAULT_PROMPT
    prompt = prompt if prompt is not None else DEFAULT_PROMPT
    if group is not None:
        if chat:
            raise MLXRunnerError("--distributed runs one prompt, not a conversation: give "
                                 "the prompt on the command line or pipe it in")
        from ..distributed.ranks import broadcast_text

        prompt = broadcast_text(prompt, group)  # what rank 0 was given, on every rank
    from ..batch.generation import generate
    from ..chat.streaming import TextStream

    started = time.perf_counter()
    bundle = _load_model_arguments(model_arg, args)
    load_seconds = time.perf_counter() - started
    options = bundle.defaults.merged(_sampler_overrides(args))
    if group is not None and options.seed is None:
        # every rank must draw the same tokens: rank 0's seed for all
        from ..distributed.ranks import broadcast_text

        seed = broadcast_text(str(int.from_bytes(os.urandom(4), "little")), group)
        options = options.merged({"seed": int(seed)})
    max_tokens = args.max_tokens or bundle.extra.get("max_tokens") or 256
    think = None if args.think is None else args.think == "on"
    if chat and (args.image or args.audio):
        raise MLXRunnerError("--image and --audio apply to one prompt, not to a conversation "
                             "(there: /image PATH): give the prompt on the command line")
    if chat and args.format is not None:
        raise MLXRunnerError("--format applies to one prompt, not to a conversation: give "
                             "the prompt on the command line or pipe it in")
    if chat:
        from .chat import COMPLETIONS, chat_loop
        from .history import LineEditor, conversations_folder, history_path

        system = args.system if args.system is not None else bundle.extra.get("system")
        editor = LineEditor(history_path(), completions=COMPLETIONS) if interactive else None
        try:
            chat_loop(bundle, options, max_tokens=max_tokens, think=think, system=system,
                      read=editor.read if editor is not None else _read_piped_line,
                      color=sys.stdout.isatty(), verbose=args.verbose,
                      conversations=conversations_folder(),
                      name=model_label(model_arg, bundle))
        finally:
            if editor is not None:
                editor.save()
        return 0
    prompt_text, prompt_ids = build_prompt(bundle, prompt, raw=args.raw, system=args.system,
                                           think=think, images=args.image, audio=args.audio)
    from ..bundle import context_length

    context = context_length(bundle)
    if context is not None and len(prompt_ids) >= context:
        raise MLXRunnerError(f"the prompt is {len(prompt_ids)} tokens; {model_arg}'s context is "
                             f"{context} positions")
    tok = bundle.tokenizer
    stop_ids = bundle.stop_token_ids()
    stream = not args.json
    from ..decode.grammar import compile_format

    grammar = compile_format(args.format, tok, bundle.model.vocab_size, stop_ids,
                             field="--format")

    def constraint() -> Any:
        """A fresh constraint for each generation (None without --format)."""
        return grammar.constraint() if grammar is not None else None

    if stream:
        _show_prompt(prompt)
    stops = bundle.stop_strings()
    text = TextStream(tok, stop_ids, stops, on_text=streamed.write if stream else None)

    def until_stop_string() -> Any:
        """An ``on_token`` that ends a run where the Modelfile's stop strings end the text."""
        return TextStream(tok, stop_ids, stops).add if stops else None

    if args.compare and bundle.draft is None:
        print(f"({model_label(model_arg, bundle)} has no draft, so --compare has nothing to "
              "compare: this is plain decoding; --draft attaches one)", file=sys.stderr,
              flush=True)
    if args.compare and bundle.draft is not None:
        # Warm both paths over the whole run first (first calls trace and compile each
        # shape: every verify length and commit size a run meets), so the comparison
        # measures decoding, not compilation.
        for warm_draft in (bundle.draft, None):
            generate(bundle.model, prompt_ids, options=options, max_tokens=max_tokens,
                     eos_ids=stop_ids, on_token=until_stop_string(), draft=warm_draft,
                     constraint=constraint())
    result = generate(bundle.model, prompt_ids, options=options, max_tokens=max_tokens,
                      eos_ids=stop_ids, on_token=text.add if stream or stops else None,
                      draft=bundle.draft, constraint=constraint())
    if stream:  # --json decodes the whole reply once, at the end
        text.finish()
        streamed.write("\n")
        if result.finish_reason == "length":
            print(cap_notice(max_tokens), file=sys.stderr, flush=True)
    stats = {"run": result.stats.as_dict()}
    stats["run"]["load_seconds"] = round(load_seconds, 3)
    if args.compare and bundle.draft is not None:
        plain = generate(bundle.model, prompt_ids, options=options, max_tokens=max_tokens,
                         eos_ids=stop_ids, on_token=until_stop_string(),
                         constraint=constraint())
        stats["plain"] = plain.stats.as_dict()
        same = plain.tokens == result.tokens
        stats["identical_to_plain"] = same
        run_tps = stats["run"].get("tokens_per_second") or 0.0
        plain_tps = stats["plain"].get("tokens_per_second") or 0.0
        stats["speedup"] = round(run_tps / plain_tps, 3) if plain_tps else None
    if args.json:
        # the text of the reply: an end-of-turn token that ended it is not part of it
        shown = result.tokens[:-1] if result.tokens and result.tokens[-1] in stop_ids \
            else result.tokens
        reply = text.finish() if text.stopped else tok.decode(shown)
        out: dict[str, Any] = {"model": model_label(model_arg, bundle),
                               "folder": str(Path(bundle.path).expanduser().resolve()),
                               "prompt_tokens": len(prompt_ids),
                               "tokens": result.tokens, "text": reply,
                               "finish_reason": result.finish_reason, "statistics": stats}
        if bundle.parser is not None:
            with plugins.plugin_code("parsers", bundle.parser_name):
                bundle.parser.reset(prompt_text)
                parsed = bundle.parser.parse(reply)
            out["message"] = {"content": parsed.content, "thinking": parsed.thinking,
                              "tool_calls": [{"name": c.name, "arguments": c.arguments}
                                             for c in parsed.tool_calls]}
        if result.logprobs:
            out["logprobs"] = result.logprobs
        print(json.dumps(out, ensure_ascii=False))
        return 0
    if result.logprobs:
        print(format_logprobs(tok, result.tokens, result.logprobs))
    if args.stats or args.compare or args.verbose:
        from .statistics import describe_comparison, describe_run

        lines = describe_run(stats["run"], explain=args.verbose)
        if "plain" in stats:
            lines += describe_comparison(stats["run"], stats["plain"], stats["speedup"],
                                         stats["identical_to_plain"], explain=args.verbose)
        lines.append(f"load: {load_seconds:.2f} s; total: "
                     f"{time.perf_counter() - started:.2f} s (load, then every generation "
                     "above)")
        print("\n".join(lines), file=sys.stderr)
    return 0


def _show_prompt(prompt: str) -> None:
    """The prompt a one-shot run answers, dimmed before the reply at a terminal (on stderr
    when only that is one, so piped output stays the reply alone)."""
    for stream in (sys.stdout, sys.stderr):
        if stream.isatty():
            lines = prompt.splitlines() or [""]
            quoted = "\n".join((">>> " if i == 0 else "... ") + line
                               for i, line in enumerate(lines))
            stream.write(f"\x1b[2m{quoted}\x1b[0m\n")
            stream.flush()
            return


def format_logprobs(tokenizer: Any, tokens: Sequence[int],
                    logprobs: Sequence[dict[str, Any]]) -> str:
    """One line per generated token: the token, its log-probability, then the most likely
    tokens at that step with theirs (``--top-logprobs``)."""
    alternatives_asked = any(info.get("top_logprobs") for info in logprobs)
    lines = ["logprobs (token, log-probability" + (", most likely tokens):" if
                                                  alternatives_asked else "):")]
    for token, info in zip(tokens, logprobs):
        alternatives = "  ".join(f"{tokenizer.decode([i])!r} {lp:.4f}"
                                 for i, lp in info.get("top_logprobs") or ())
        line = f"{tokenizer.decode([token])!r:<16} {info['logprob']:9.4f}"
        lines.append(f"{line}  {alternatives}" if alternatives else line)
    return "\n".join(lines)


# -- render ----------------------------------------------------------------
def _read_tools_file(path: str) -> list[Any]:
    from ..errors import ConversationError

    try:
        tools = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConversationError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConversationError(f"{path}: invalid JSON ({exc})") from None
    if isinstance(tools, dict) and isinstance(tools.get("tools"), list):
        tools = tools["tools"]
    if not isinstance(tools, list):
        raise ConversationError(f"{path}: expected a list of tools")
    return tools


def cmd_render(args: argparse.Namespace) -> int:
    from ..chat.formats import RenderContext, get_renderer, load_conversation_file

    messages, tools = load_conversation_file(args.file)
    if args.tools:
        tools = _read_tools_file(args.tools)
    context = RenderContext()
    if args.template:
        try:
            context.chat_template = Path(args.template).read_text(encoding="utf-8")
        except OSError as exc:
            raise MLXRunnerError(f"{args.template}: cannot read template ({exc.strerror})") \
                from None
    if args.model_name:
        context.model_name = args.model_name
    if args.model is not None:
        # the renderer the model runs with (its Modelfile's, its architecture's or its
        # template through jinja), unless --renderer names another
        from ..bundle import load

        bundle = load(args.model, renderer=args.renderer, use_draft=False)
        if bundle.renderer is None:
            raise MLXRunnerError(f"{args.model}: the model has no chat format (no renderer "
                                 "and no chat template): name one with --renderer")
        renderer, name = bundle.renderer, str(bundle.renderer_name)
    elif args.renderer is None:
        raise MLXRunnerError("render needs --renderer NAME or --model MODEL")
    elif args.renderer == "jinja" and context.chat_template is None:
        raise MLXRunnerError("the jinja renderer renders a model's own template: name the "
                             "model (--model MODEL) or the template (--template FILE)")
    else:
        renderer, name = get_renderer(args.renderer, context), args.renderer
    think = None if args.think is None else args.think == "on"
    with plugins.plugin_code("renderers", name):
        text = renderer.render(messages, tools, think=think,
                               add_generation_prompt=not args.no_generation_prompt)
    sys.stdout.write(text)
    return 0


# -- serve -----------------------------------------------------------------
def _serve_logging(verbose: bool) -> None:
    """The server's lines on stderr with their tracebacks; access lines with ``--verbose``."""
    logger = logging.getLogger("mlxrunner.serve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False  # the core's line handler would print them twice
    logger.setLevel(logging.INFO if verbose else logging.WARNING)


def cmd_serve(args: argparse.Namespace) -> int:
    from .. import settings
    from ..bundle import weights_bytes
    from ..serve import Limits, Listener, ServeConfig, Service, bind, create_app, is_loopback
    from ..serve.models import Models, keep_alive_seconds

    model_arg = args.model or "default"
    group = _join_job(args)
    if group is not None and group.rank() != 0:  # rank 0 serves; this rank follows it
        from ..serve.distributed import follow

        return follow(_load_model_arguments(model_arg, args), group)
    keep_alive = keep_alive_seconds(args.keep_alive, 300.0)  # a bad value: before any work
    # Bind first: a taken port is reported before a long model load.
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        raise MLXRunnerError(f"cannot listen on {args.host}:{args.port} "
                             f"({exc.strerror or exc})") from None
    try:
        bundle = _load_model_arguments(model_arg, args)
    except BaseException:
        sock.close()
        raise
    _serve_logging(args.verbose)
    current = settings.current()
    api_key = args.api_key or current.api_key
    # DNS rebinding reaches servers on loopback; bound beyond it, any name may reach it (the
    # API key guards it there), as Ollama does.
    if args.allowed_hosts is not None:
        hosts = tuple(h.strip().lower() for h in args.allowed_hosts.split(",") if h.strip())
    else:
        hosts = ("localhost", "127.0.0.1", "::1") if is_loopback(args.host) else ("*",)
    config = ServeConfig(allowed_hosts=hosts, api_key=api_key,
                         origins=tuple(o.strip() for o in (args.origins or "").split(",")
                                       if o.strip()) or current.origins)
    given = {k: v for k, v in (("queue_size", args.max_queue),
                               ("request_timeout", args.request_timeout),
                               ("max_batch", args.max_batch)) if v is not None}
    limits = Limits() if args.max_tokens_limit is None else Limits(
        max_tokens_limit=args.max_tokens_limit)
    engine = None
    if group is not None:
        from ..serve.distributed import LockstepEngine

        engine = LockstepEngine(bundle, group, **{k: v for k, v in given.items()
                                                  if k != "max_batch"})
    service = Service(bundle, name=args.name or model_arg, limits=limits, engine=engine,
                      **given)
    models = Models(service, models_dir=args.models_dir, max_loaded=args.max_loaded,
                    keep_alive=keep_alive,
                    make_service=lambda loaded, name: Service(loaded, name, limits=limits,
                                                              **given))
    listener = Listener(create_app(service, config, models), sock, **(
        {} if args.keep_alive_timeout is None
        else {"keep_alive_timeout": args.keep_alive_timeout}))
    if not is_loopback(args.host) and api_key is None:
        print(f"mlxrunner: warning: listening on {args.host} beyond this machine without an "
              "API key: anyone who reaches it can use the model (--api-key or "
              "MLXRUNNER_API_KEY)", file=sys.stderr)
    draft = f", draft {type(bundle.draft).__name__}" if bundle.draft is not None else ""
    if args.verbose:
        kept = service.engine.prefix_cache
        print("mlxrunner: prefix cache " + (f"up to {kept.budget_bytes >> 20} MiB of model "
                                            "state (MLXRUNNER_PREFIX_CACHE_MIB)" if kept is not
                                            None else "off"), file=sys.stderr, flush=True)
        print(f"mlxrunner: batch caches up to {service.engine.batch_budget >> 20} MiB "
              "(MLXRUNNER_BATCH_MIB); weights "
              f"{(weights_bytes(bundle.model) or 0) >> 20} MiB", file=sys.stderr, flush=True)
    print(f"mlxrunner: serving {service.name}{draft} on {listener.url} (OpenAI /v1, Ollama "
          "/api, Anthropic /v1/messages; Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        listener.serve()
    finally:
        sock.close()
        if engine is not None:  # the other ranks end when rank 0 says it closes
            engine.close()
            engine.closed.wait(10)
    return 0


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    # Defaults (None here) are the server's own: importing it would slow every --help.
    p.add_argument("model", nargs="?", help="model folder, store name or registered name "
                                            "(default: the default model, as `run`); every "
                                            "stored and registered model answers too")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port, default=8080, help="port (0: any free one)")
    p.add_argument("--name", help="the model name the API reports")
    _add_model_arguments(p)
    p.add_argument("--api-key", help="require this bearer token (default: MLXRUNNER_API_KEY; "
                                     "unset: none)")
    p.add_argument("--allowed-hosts",
                   help="Host header names accepted, comma-separated (*: any; default: "
                        "localhost, 127.0.0.1, ::1 on loopback, any beyond it); refuses DNS "
                        "rebinding")
    p.add_argument("--origins", help="browser origins accepted beyond this machine's, "
                                     "comma-separated globs (default: MLXRUNNER_ORIGINS)")
    p.add_argument("--max-queue", type=count(1),
                   help="requests waiting beyond those decoding; more get status 503 "
                        "(default 64)")
    p.add_argument("--max-batch", type=count(1),
                   help="requests decoded together at most, joining and leaving between "
                        "steps (default 16; 1: one at a time)")
    p.add_argument("--max-tokens-limit", type=count(1),
                   help="the most tokens one request may generate (default 32768; the "
                        "context caps it too)")
    p.add_argument("--request-timeout", type=count(1),
                   help="seconds one request may generate before it is ended (default 600)")
    p.add_argument("--keep-alive-timeout", type=count(1),
                   help="seconds an idle connection stays open (default 5)")
    p.add_argument("--models-dir", help="a folder of model folders, each served by its name "
                                        "on demand (registered models are too)")
    p.add_argument("--max-loaded", type=count(0), default=1,
                   help="models loaded on demand that stay loaded at once (default 1; the "
                        "served model always stays)")
    p.add_argument("--keep-alive", default="5m",
                   help="how long a model loaded on demand stays after its last request "
                        "(Ollama's keep_alive: 5m, 30s, -1 for ever; default 5m)")
    p.add_argument("--verbose", action="store_true", help="log each request (one line)")


class _Parser(argparse.ArgumentParser):
    """argparse with a usage error as one line, like every other bad input (``--help``
    shows the usage); the subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("mlxrunner").strip()  # "run" for `mlxrunner run`
        where = f"{command}: " if command else ""
        self.exit(2, f"mlxrunner: error: {where}{message}\n")


def _version() -> str:
    """The installed distribution's version (the package's own when run from a checkout)."""
    from importlib import metadata

    try:
        return metadata.version("mlxrunner")
    except metadata.PackageNotFoundError:
        from .. import __version__

        return __version__


def build_parser() -> tuple[argparse.ArgumentParser, CommandRegistry]:
    parser = _Parser(
        prog="mlxrunner",
        description="Run language models on MLX; architectures, chat formats and drafts "
                    "come from plugins.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action="version", version=f"mlxrunner {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    registry = CommandRegistry(sub)

    def simple(name: str, help: str, run: Callable[[argparse.Namespace], int],
               add: Callable[[argparse.ArgumentParser], None] = lambda p: None) -> None:
        registry.command(name, help, add, run)

    def add_json(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print JSON")

    def lister(kind: str) -> Callable[[argparse.Namespace], int]:
        return lambda a: _list_kind(kind, a.json)

    simple("plugins", "list loaded plugins (JSON)", cmd_plugins)
    for kind in ("architectures", "renderers", "parsers", "drafts", "models"):
        simple(kind, f"list installed {kind} and the plugin behind each", lister(kind),
               add_json)

    def add_show(p: argparse.ArgumentParser) -> None:
        p.add_argument("model")
        p.add_argument("--draft")
        p.add_argument("--renderer")
        p.add_argument("--dtype")
        add_json(p)

    simple("show", "describe a model folder", cmd_show, add_show)
    simple("run", "generate text", cmd_run, _add_run_arguments)

    def add_render(p: argparse.ArgumentParser) -> None:
        p.add_argument("file", help="conversation JSON: a list of messages or "
                                    "{\"messages\": [...], \"tools\": [...]}")
        p.add_argument("--renderer", help="a renderer by name (`mlxrunner renderers`)")
        p.add_argument("--model", help="render as this model would (a folder, store name or "
                                       "registered name): its renderer and template")
        p.add_argument("--tools", help="tools JSON (a list)")
        p.add_argument("--think", choices=["on", "off"])
        p.add_argument("--template", help="template file for the jinja renderer")
        p.add_argument("--model-name", help="model name for renderers that depend on it")
        p.add_argument("--no-generation-prompt", action="store_true")

    simple("render", "print the prompt a conversation becomes", cmd_render, add_render)
    simple("bench", "measure prefill and decode speed, plain and speculative", bench.run,
           bench.add_arguments)
    simple("serve", "serve a model over OpenAI's, Ollama's and Anthropic's HTTP APIs", cmd_serve,
           _add_serve_arguments)
    store.register(registry.command)  # pull, list, rm, cp, create
    client.register(registry.command)  # ps, stop
    return parser, registry


class _StderrLines(logging.Handler):
    """The core's warnings on stderr, as the lines it printed before it logged: the plugin
    host's as ``mlxrunner: warning: ...``, the others (a kernel's fallback) as they are.
    The stream is looked up per line, so a replaced ``sys.stderr`` gets them."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = record.getMessage()
            if record.name == "mlxrunner.host":
                line = f"mlxrunner: warning: {line}"
            print(line, file=sys.stderr)
        except Exception:  # a logging handler must not raise
            self.handleError(record)


class _PullLines(logging.Handler):
    """A pull's lines on stderr (what it fetches, from where, how big), its progress as one
    bar redrawn in place where stderr is a terminal (nothing where it is not)."""

    WIDTH = 30

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.open = False  # a bar is on the line

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            if not hasattr(record, "progress"):
                self._close(stream)
                print(record.getMessage(), file=stream, flush=True)
                return
            progress = record.progress
            if progress is None or progress[0] is None or not stream.isatty():
                self._close(stream)
                return
            done, total = progress
            from ..store import human_size

            if total:
                filled = min(self.WIDTH, self.WIDTH * done // total)
                line = (f"  [{'#' * filled}{'.' * (self.WIDTH - filled)}] "
                        f"{human_size(done)} of {human_size(total)}")
            else:
                line = f"  {human_size(done)}"
            stream.write(f"\r{line}\x1b[K")
            stream.flush()
            self.open = True
            if total and done >= total:
                self._close(stream)
        except Exception:  # a logging handler must not raise
            self.handleError(record)

    def _close(self, stream: Any) -> None:
        if self.open:
            stream.write("\n")
            stream.flush()
            self.open = False


def log_to_stderr() -> None:
    """Send the core's warnings (loggers ``mlxrunner.*``) to stderr, and a pull's lines and
    progress (logger ``mlxrunner.pull``), once per process."""
    logger = logging.getLogger("mlxrunner")
    if not any(isinstance(h, _StderrLines) for h in logger.handlers):
        logger.addHandler(_StderrLines(logging.WARNING))
    pulling = logging.getLogger("mlxrunner.pull")
    if not any(isinstance(h, _PullLines) for h in pulling.handlers):
        pulling.addHandler(_PullLines())
        pulling.setLevel(logging.INFO)


def _lost_rank(exc: BaseException) -> Exception | None:
    """The one-line error of a distributed job whose other rank is gone (None: not that)."""
    if "mlxrunner.distributed" not in sys.modules:
        return None
    from ..distributed import world
    from ..distributed.ranks import is_lost_rank, lost_rank

    return lost_rank(world()) if is_lost_rank(exc) else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    log_to_stderr()
    try:
        parser, registry = build_parser()
        plugins.host().call_commands_hook(registry)
        args = parser.parse_args(argv)
        from ..nn.attention import mode
        mode()  # a bad MLXRUNNER_ATTENTION is refused before any work
        if not args.command:
            parser.print_help()
            return 0
        if getattr(args, "ranks", None) and getattr(args, "distributed", None):
            from ..distributed import launched
            from ..distributed.ranks import launch_local

            if not launched():  # the launcher: each rank runs this same command line
                return launch_local(args.ranks, argv)
        return int(registry.handlers[args.command](args) or 0)
    except MLXRunnerError as exc:
        if debug:
            raise
        streamed.end_line()
        print(f"mlxrunner: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        streamed.end_line()
        return 130
    except BrokenPipeError:
        streamed.end_line()  # (fails on the closed pipe: forgets the open line)
        return 0
    except Exception as exc:  # a bug, not a user error: still one line unless --debug
        if debug:
            raise
        streamed.end_line()
        lost = _lost_rank(exc)
        if lost is not None:
            from ..distributed.ranks import say_once

            say_once(f"mlxrunner: error: {lost}")
            return 1
        print(f"mlxrunner: internal error: {type(exc).__name__}: {exc} "
              "(rerun with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
