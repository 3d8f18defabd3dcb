"""The model side of the server: checked requests in, replies (or streamed text) out.

Generation is blocking MLX work. It runs on one worker thread, fed by a bounded queue: MLX's
streams belong to the thread that made them, so a forward traced on one thread cannot be
replayed on another. The worker drives one :class:`mlxrunner.batch.Scheduler`: requests join
the running batch between its steps (up to ``max_batch`` at once), each decoded exactly as
:func:`mlxrunner.generate` decodes it alone: drafts, grammars and the prefix cache included.
The event loop only waits for it (``asyncio`` futures), and a request whose client has gone
is cancelled between two tokens.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from ..batch import BatchRequest, Scheduler, batch_budget
from ..batch.generation import generate
from ..bundle import Bundle, context_length, weights_bytes
from ..cache import prefix_cache_for
from ..chat.streaming import TextStream
from ..decode.grammar import Format, Grammar, GrammarError, Vocabulary, compile_format, vocabulary
from ..decode.options import SamplerOptionError, SamplerOptions
from ..errors import MediaError, MLXRunnerError

log = logging.getLogger("mlxrunner.serve")

#: seconds between two returns of freed heap memory to the system (see _return_freed_memory)
TRIM_EVERY = 10.0


def _malloc_trim() -> Callable[[int], Any] | None:
    """glibc's ``malloc_trim``, where the C library has it (Linux with glibc)."""
    try:
        import ctypes

        trim: Callable[[int], Any] = ctypes.CDLL("libc.so.6").malloc_trim
        return trim
    except (OSError, AttributeError):
        return None


_trim = _malloc_trim()


def _return_freed_memory() -> None:
    """Give the heap's freed pages back to the system. A server's host-side buffers
    (numpy's attention scores and products on the CPU, a prompt's temporaries) are freed
    after each step, but glibc keeps their pages: a 30-minute soak of the default model
    plateaued 450 MiB above what it held (bench/serve_soak.py)."""
    if _trim is not None:
        _trim(0)

DEFAULT_MAX_TOKENS = 1024
#: the most tokens one request may generate, whatever it asks (``--max-tokens-limit``)
MAX_TOKENS_LIMIT = 32768
DEFAULT_QUEUE_SIZE = 64
#: requests decoded together at most (``--max-batch``; 1: one at a time)
DEFAULT_MAX_BATCH = 16
#: seconds one request may generate before it is ended (``--request-timeout``)
DEFAULT_REQUEST_TIMEOUT = 600.0


class RequestError(MLXRunnerError):
    """A request the server cannot take: ``status`` (400 unless given) and the field at fault
    (``param``), reported in the API's own error shape."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST,
                 param: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.param = param
        self.headers = dict(headers or {})


class ShuttingDownError(RequestError):
    """The server is stopping (Ctrl-C): open replies end with this, new requests get it."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down", status=HTTPStatus.SERVICE_UNAVAILABLE)


#: what an open stream's queue receives when the server stops
_CLOSING = object()


class BusyError(RequestError):
    """The queue is full: 503 with ``Retry-After``."""

    def __init__(self, waiting: int) -> None:
        super().__init__(f"the server is busy ({waiting} requests waiting); retry later",
                         HTTPStatus.SERVICE_UNAVAILABLE, headers={"Retry-After": "1"})


@dataclass
class Generation:
    """A checked request: prompt ids (a :class:`mlxrunner.MediaPrompt` where media came
    with it) and how to decode them."""

    ids: Sequence[int]
    options: SamplerOptions
    max_tokens: int
    stops: list[str] = field(default_factory=list)
    #: structured output: each run starts its own constraint on it
    grammar: Grammar | None = None


@dataclass
class Reply:
    """What one request produced. ``finish_reason``: "stop", "length" or "cancelled";
    ``stop_string``: the stop string that ended it, if one did."""

    text: str = ""
    stop_string: str | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    prompt_tokens: int = 0
    #: prompt tokens the model's prefix cache held (not prefilled again)
    cached_tokens: int = 0
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    queued_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    total_seconds: float = 0.0


class _Job:
    def __init__(self, generation: Generation, on_text: Callable[[str], None] | None,
                 deadline: float) -> None:
        self.generation = generation
        self.on_text = on_text
        self.deadline = deadline
        self.cancel = threading.Event()
        self.future: Future[Reply] = Future()
        self.submitted = time.monotonic()
        #: in the batch: its request, its reply so far, its text stream
        self.request: BatchRequest | None = None
        self.reply = Reply(prompt_tokens=len(generation.ids))
        self.text: TextStream | None = None
        self.ended_early = False


class Engine:
    """One worker thread and its bounded queue of jobs; one engine per loaded model (its
    traced forwards replay only on the thread that traced them). A daemon thread: with MLX
    0.32.4 a joined worker that ran traced forwards aborted the process at exit."""

    def __init__(self, bundle: Bundle, *, queue_size: int = DEFAULT_QUEUE_SIZE,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
                 max_batch: int = DEFAULT_MAX_BATCH) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.bundle = bundle
        self.max_batch = max_batch
        #: the worker's scheduler (made on the worker thread, whose streams its forwards use)
        self.scheduler: Scheduler | None = None
        self.stop_ids = bundle.stop_token_ids()
        #: state kept across requests (None: off, or a model whose caches it cannot keep)
        self.prefix_cache = prefix_cache_for(bundle.model.make_cache, weights_bytes(bundle.model))
        #: bytes the batch's caches may take (requests past it wait for rows to end)
        self.batch_budget = batch_budget(weights_bytes(bundle.model))
        self.request_timeout = request_timeout
        self.queue_size = queue_size
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        #: set once the server stops: open replies end, new ones are refused
        self.closing = threading.Event()
        #: open streams' event loops and piece queues (each told when the server stops)
        self._open: set[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = set()
        self.running = 0  # jobs in the batch or decoding alone
        #: jobs so far: submitted, done, cancelled (their client left midway), skipped (their
        #: client left before they began), failed
        self.counts = dict.fromkeys(("submitted", "done", "cancelled", "skipped", "failed"), 0)
        #: structured output's token table for this model, built in the background from the
        #: start (250k tokens take seconds), not at the first request that asks for a format
        self.grammar_vocabulary: Future[Vocabulary | None] = Future()
        threading.Thread(target=self._prepare_vocabulary, name="mlxrunner-vocabulary",
                         daemon=True).start()
        threading.Thread(target=self._serve, name="mlxrunner-model", daemon=True).start()

    def _prepare_vocabulary(self) -> None:
        bundle = self.bundle
        try:
            made = None if bundle.tokenizer is None else vocabulary(
                bundle.tokenizer, bundle.model.vocab_size, self.stop_ids)
        except Exception as exc:  # a request that asks for a format reports it
            log.debug("no structured-output vocabulary for this model: %s", exc)
            made = None
        self.grammar_vocabulary.set_result(made)

    @property
    def waiting(self) -> int:
        """Jobs not decoding yet: queued for the worker or waiting for a row."""
        scheduler = self.scheduler
        return self._jobs.qsize() + (scheduler.waiting if scheduler is not None else 0)

    @property
    def busy(self) -> bool:
        """Whether a job is queued or running (counted, so no gap between the two)."""
        counts = self.counts
        ended = counts["done"] + counts["cancelled"] + counts["skipped"] + counts["failed"]
        return counts["submitted"] > ended

    def submit(self, generation: Generation,
               on_text: Callable[[str], None] | None = None) -> _Job:
        """Queue ``generation``; :class:`BusyError` when the queue is full. ``on_text`` is
        called on the worker thread with each decided piece of text."""
        job = _Job(generation, on_text, time.monotonic() + self.request_timeout)
        with self._lock:
            if self.closing.is_set():
                raise ShuttingDownError()
            waiting = self.waiting
            if waiting >= self.queue_size:
                raise BusyError(waiting)
            self._jobs.put_nowait(job)
            self.counts["submitted"] += 1
        return job

    def _serve(self) -> None:
        scheduler = self.scheduler = Scheduler(self.bundle.model, max_sequences=self.max_batch,
                                               memory_budget=self.batch_budget)
        active: list[_Job] = []  # in the batch
        closing = False
        trimmed = time.monotonic()
        while True:
            jobs: list[_Job | None] = []
            if time.monotonic() - trimmed > TRIM_EVERY:
                _return_freed_memory()
                trimmed = time.monotonic()
            if scheduler.idle:
                if closing:
                    return
                _return_freed_memory()
                jobs.append(self._jobs.get())  # nothing to step: wait for work
            while True:
                try:
                    jobs.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            for job in jobs:
                if job is None:  # closed: the jobs queued before still run
                    closing = True
                elif job.cancel.is_set() or not job.future.set_running_or_notify_cancel():
                    self.counts["skipped"] += 1
                else:
                    try:
                        job.request = self._batch_request(job)
                        scheduler.submit(job.request)
                    except Exception as exc:  # this request's own (a prompt it cannot take)
                        self.counts["failed"] += 1
                        job.future.set_exception(RequestError(str(exc))
                                                 if isinstance(exc, ValueError) else exc)
                        continue
                    active.append(job)
            for job in active:
                if job.cancel.is_set():
                    assert job.request is not None
                    job.request.cancel()
            self.running = len(active)
            if scheduler.idle:
                continue
            try:
                scheduler.step()
            except BaseException as exc:  # the batch's state is lost: its requests fail
                log.exception("mlxrunner: a batched step failed")
                for job in active:
                    self.counts["failed"] += 1
                    job.future.set_exception(exc)
                active.clear()
                scheduler = self.scheduler = Scheduler(self.bundle.model,
                                                       max_sequences=self.max_batch,
                                                       memory_budget=self.batch_budget)
                continue
            for job in [j for j in active if j.request is not None and j.request.done]:
                active.remove(job)
                self._end(job)
            self.running = len(active)

    def _batch_request(self, job: _Job) -> BatchRequest:
        request = job.generation
        job.reply.queued_seconds = time.monotonic() - job.submitted
        job.text = text = TextStream(self.bundle.tokenizer, self.stop_ids, request.stops,
                                     job.on_text)
        reply = job.reply

        def on_token(token: int, _: Any) -> bool:
            reply.tokens.append(token)
            if job.cancel.is_set() or time.monotonic() > job.deadline:
                job.ended_early = True
                return True
            return text.add(token)  # True at a stop string: generation ends, logprobs kept

        options = request.options
        drafted = self.bundle.draft is not None and not (options.logprobs or
                                                         options.top_logprobs)
        return BatchRequest(request.ids, options, request.max_tokens,
                            frozenset(self.stop_ids), on_token,
                            draft=self.bundle.draft if drafted else None,
                            constraint=request.grammar.constraint()
                            if request.grammar is not None else None,
                            prefix_cache=self.prefix_cache)

    def _end(self, job: _Job) -> None:
        """A batched job's reply, from its finished request."""
        request, reply, text = job.request, job.reply, job.text
        assert request is not None and text is not None
        if request.error is not None:  # this request's own failure (the batch went on)
            self.counts["failed"] += 1
            job.future.set_exception(request.error)
            return
        reply.text = text.finish()
        reply.finish_reason = "cancelled" if request.finish_reason == "cancel" \
            else str(request.finish_reason)
        if text.stopped:
            reply.stop_string = _first_stop(self.bundle.tokenizer.decode(reply.tokens),
                                            job.generation.stops)
        if job.ended_early:
            reply.finish_reason = "cancelled" if job.cancel.is_set() else "length"
        if reply.finish_reason == "cancelled" or job.ended_early:
            log.info("mlxrunner: generation %s after %d tokens", "cancelled (the client "
                     "went away)" if job.cancel.is_set() else "timed out", len(reply.tokens))
        self._fill(reply, request.logprobs, request.stats, job)
        self.counts["cancelled" if reply.finish_reason == "cancelled" else "done"] += 1
        job.future.set_result(reply)

    def _run_alone(self, job: _Job, batched: int) -> None:
        """Run ``job`` through ``generate`` on this thread (a distributed engine's jobs)."""
        self.running = batched + 1
        try:
            reply = self._run(job)
            self.counts["cancelled" if reply.finish_reason == "cancelled" else "done"] += 1
            job.future.set_result(reply)
        except BaseException as exc:  # the request's side raises it
            self.counts["failed"] += 1
            job.future.set_exception(exc)
        finally:
            self.running = batched

    def close(self) -> None:
        """End the worker thread once the jobs queued before have run."""
        self._jobs.put(None)

    def shut_down(self) -> None:
        """The server is stopping (from any thread): every open stream ends with a
        :class:`ShuttingDownError` event, every waiting reply with that error, their
        generations are cancelled, and new requests are refused."""
        with self._lock:
            self.closing.set()
            opened = list(self._open)
        for loop, pieces in opened:
            try:
                loop.call_soon_threadsafe(pieces.put_nowait, _CLOSING)
            except RuntimeError:  # that loop is closed: nothing waits there
                pass

    def _run(self, job: _Job) -> Reply:
        bundle, request = self.bundle, job.generation
        started = time.monotonic()
        reply = Reply(prompt_tokens=len(request.ids), queued_seconds=started - job.submitted)
        text = TextStream(bundle.tokenizer, self.stop_ids, request.stops, job.on_text)
        ended_early = False

        def on_token(token: int) -> bool:
            nonlocal ended_early
            reply.tokens.append(token)
            if job.cancel.is_set() or time.monotonic() > job.deadline:
                ended_early = True
                return self._agree(True)
            # True at a stop string: generation ends, logprobs kept
            return self._agree(text.add(token))

        constraint = request.grammar.constraint() if request.grammar is not None else None
        result = generate(bundle.model, request.ids, options=request.options,
                          max_tokens=request.max_tokens, eos_ids=self.stop_ids,
                          on_token=on_token, draft=bundle.draft, constraint=constraint,
                          prefix_cache=self.prefix_cache)
        reply.text = text.finish()
        reply.finish_reason = result.finish_reason
        if text.stopped:
            reply.stop_string = _first_stop(bundle.tokenizer.decode(reply.tokens),
                                            request.stops)
        if ended_early:
            reply.finish_reason = "cancelled" if job.cancel.is_set() else "length"
            log.info("mlxrunner: generation %s after %d tokens", "cancelled (the client "
                     "went away)" if job.cancel.is_set() else "timed out", len(reply.tokens))
        self._fill(reply, result.logprobs, result.stats, job)
        return reply

    def _agree(self, stop: bool) -> bool:
        """Whether a generation running alone ends at this token (a distributed engine's
        ranks agree on it: mlxrunner.serve.distributed)."""
        return stop

    @staticmethod
    def _fill(reply: Reply, logprobs: list[dict[str, Any]], stats: Any, job: _Job) -> None:
        reply.logprobs = logprobs[:len(reply.tokens)]
        reply.stats = stats.as_dict()
        reply.cached_tokens = int(getattr(stats, "cached_tokens", 0))
        reply.prefill_seconds = float(getattr(stats, "prefill_seconds", 0.0))
        reply.decode_seconds = float(getattr(stats, "decode_seconds", 0.0))
        reply.total_seconds = time.monotonic() - job.submitted

    # -- the event loop's side ---------------------------------------------------------
    async def complete(self, generation: Generation,
                       disconnected: Callable[[], Awaitable[Any]] | None = None
                       ) -> Reply | None:
        """The whole reply, or None when the awaitable ``disconnected()`` finishes first (the
        client has gone): the generation is cancelled then."""
        loop = asyncio.get_running_loop()
        closing: asyncio.Queue[Any] = asyncio.Queue()
        job = self.submit(generation)
        waiting = asyncio.wrap_future(job.future)
        watcher = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        stopper = asyncio.ensure_future(closing.get())
        with self._lock:
            self._open.add((loop, closing))
        try:
            if self.closing.is_set():
                raise ShuttingDownError()
            done, _ = await asyncio.wait({waiting, stopper} | ({watcher} if watcher else set()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if waiting in done:
                return waiting.result()
            if stopper in done:
                raise ShuttingDownError()
            return None
        finally:
            job.cancel.set()  # a no-op once it is done
            with self._lock:
                self._open.discard((loop, closing))
            for task in (watcher, stopper):
                if task is not None:
                    task.cancel()

    def stream(self, generation: Generation) -> AsyncIterator[str | Reply]:
        """Queue ``generation`` now (:class:`BusyError` before any byte is sent) and give
        its text pieces as they are decided, then the :class:`Reply`. Closing the iterator
        (the client has gone) cancels the generation."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[Any] = asyncio.Queue()

        def on_text(piece: str) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, piece)

        job = self.submit(generation, on_text)
        job.future.add_done_callback(
            lambda _: loop.call_soon_threadsafe(pieces.put_nowait, None))

        async def items() -> AsyncIterator[str | Reply]:
            with self._lock:  # told when the server stops (from here to the finally below)
                self._open.add((loop, pieces))
                if self.closing.is_set():
                    pieces.put_nowait(_CLOSING)
            try:
                while (piece := await pieces.get()) is not None:
                    if piece is _CLOSING:
                        raise ShuttingDownError()
                    yield piece
                yield job.future.result()
            finally:
                job.cancel.set()
                with self._lock:
                    self._open.discard((loop, pieces))

        return items()


def _first_stop(text: str, stops: list[str]) -> str | None:
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found)[1] if found else None


@dataclass
class Limits:
    """Server-wide bounds on what one request may ask for."""

    max_tokens_limit: int = MAX_TOKENS_LIMIT
    default_max_tokens: int = DEFAULT_MAX_TOKENS


class Service:
    """One loaded model: its name, its engine, and the checks every API shares."""

    def __init__(self, bundle: Bundle, name: str | None = None, *,
                 limits: Limits | None = None, queue_size: int = DEFAULT_QUEUE_SIZE,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
                 max_batch: int = DEFAULT_MAX_BATCH,
                 engine: Engine | None = None) -> None:
        """``engine``: one already running for this bundle's model (another service over the
        same model must share it)."""
        self.bundle = bundle
        self.name = name or bundle.path.name
        self.limits = limits or Limits()
        self.context = context_length(bundle)
        self.default_max_tokens = int(bundle.extra.get("max_tokens")
                                      or self.limits.default_max_tokens)
        self.engine = engine or Engine(bundle, queue_size=queue_size,
                                       request_timeout=request_timeout, max_batch=max_batch)
        self.loaded_at = time.time()

    def encode(self, prompt_text: str, *, rendered: bool) -> list[int]:
        """Prompt ids (``rendered``: a chat prompt whose special tokens are in the text)."""
        try:
            prompt_text.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError("the prompt holds a lone surrogate (not valid Unicode text)"
                               ) from None
        ids = self.bundle.tokenizer.encode(prompt_text, add_special_tokens=not rendered)
        if not ids:
            raise RequestError("the prompt is empty")
        if self.context is not None and len(ids) >= self.context:
            raise RequestError(f"the prompt is {len(ids)} tokens; the model's context is "
                               f"{self.context}", param="messages")
        return ids

    def place_media(self, ids: Sequence[int], media: Sequence[tuple[str, bytes]],
                    where: str = "messages") -> Sequence[int]:
        """``ids`` with the attached ``media`` at their placeholders
        (:meth:`mlxrunner.Bundle.place_media`); a model without an encoder for a modality,
        media that does not decode or placeholders that do not match: a 400 naming it."""
        if not media:
            return ids
        try:
            placed = self.bundle.place_media(ids, media, self.name)
        except MediaError as exc:
            raise RequestError(str(exc).splitlines()[0], param=where) from None
        if self.context is not None and len(placed) >= self.context:
            raise RequestError(f"the prompt is {len(placed)} tokens with its media; the "
                               f"model's context is {self.context}", param=where)
        return placed

    def generation(self, ids: Sequence[int], sampler: Mapping[str, Any], *,
                   max_tokens: int | None, stops: list[str] | None = None,
                   output_format: Format | None = None,
                   format_field: str = "format") -> Generation:
        """A checked :class:`Generation`: ``sampler`` (the request's options by our names)
        over the model's defaults, ``max_tokens`` capped by the context and the server's
        limit, ``stops`` (none given: the Modelfile's), ``output_format`` compiled for the
        model (a schema it cannot take is a 400 naming ``format_field``)."""
        grammar = None
        if output_format is not None:
            bundle = self.bundle
            try:
                grammar = compile_format(output_format, bundle.tokenizer,
                                         bundle.model.vocab_size, self.engine.stop_ids,
                                         field=format_field)
            except GrammarError as exc:
                raise RequestError(str(exc), param=format_field) from None
        try:
            options = self.bundle.defaults.merged(
                {k: v for k, v in sampler.items() if v is not None})
        except SamplerOptionError as exc:
            name = next((k for k in sampler if f" {k} " in f" {exc} "), None)
            raise RequestError(str(exc), param=name) from None
        wanted = self.default_max_tokens if max_tokens is None else max_tokens
        room = self.limits.max_tokens_limit
        if self.context is not None:
            room = min(room, self.context - len(ids))
        # A request's stop strings replace the Modelfile's, as its options replace defaults.
        return Generation(ids=ids, options=options, max_tokens=max(1, min(wanted, room)),
                          stops=list(stops or self.bundle.stop_strings()), grammar=grammar)

    def logprobs_content(self, reply: Reply) -> list[dict[str, Any]] | None:
        """OpenAI's per-token logprobs, or None when none were asked for."""
        if not reply.logprobs:
            return None
        tok = self.bundle.tokenizer
        return [{"token": tok.decode([token]), "logprob": info["logprob"],
                 "top_logprobs": [{"token": tok.decode([i]), "logprob": lp}
                                  for i, lp in info["top_logprobs"]]}
                for token, info in zip(reply.tokens, reply.logprobs)]
