"""``serve`` over the ranks of a distributed job: rank 0 serves, the others follow.

Rank 0 runs the HTTP server and one request at a time (no batch): before each generation it
sends the others its prompt ids and sampler options (a seed drawn for a sampled request
without one, so every rank draws the same tokens), and at each token every rank learns
whether rank 0 ends there (a stop string, a client gone, the deadline). The other ranks
loop in :func:`follow`, running the same generation on their part of the model, until rank
0 closes. Structured output (a grammar) is refused: its constraint lives on rank 0; so are
images and audio (the other ranks would prefill the ids without them).
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import asdict, replace
from typing import Any

import mlx.core as mx

from ..batch.generation import generate
from ..bundle import Bundle
from ..decode.options import SamplerOptions
from ..distributed.ranks import broadcast_text
from ..media import MediaPrompt
from .engine import Engine, Reply, RequestError, _Job

#: what rank 0 sends when it closes
_CLOSED = ""


def _agreed(stop: bool, group: Any) -> bool:
    """Rank 0's ``stop``, on every rank (each rank calls this once per token)."""
    flag = mx.distributed.all_sum(mx.array([1 if stop else 0], dtype=mx.int32), group=group)
    return bool(flag.item())


class LockstepEngine(Engine):
    """Rank 0's engine: every job alone, announced to the other ranks (see the module)."""

    def __init__(self, bundle: Bundle, group: Any, **kwargs: Any) -> None:
        self.group = group
        #: set once the other ranks were told that rank 0 closes
        self.closed = threading.Event()
        super().__init__(bundle, **{**kwargs, "max_batch": 1})
        self.prefix_cache = None  # (the followers keep none)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                broadcast_text(_CLOSED, self.group)
                self.closed.set()
                return
            if job.cancel.is_set() or not job.future.set_running_or_notify_cancel():
                self.counts["skipped"] += 1
                continue
            self._run_alone(job, 0)

    def _run(self, job: _Job) -> Reply:
        generation = job.generation
        if generation.grammar is not None:
            raise RequestError("structured output is not served over several processes yet")
        if isinstance(generation.ids, MediaPrompt):  # (the other ranks get the ids alone)
            raise RequestError("images and audio are not served over several processes yet")
        options = generation.options
        if options.temperature > 0 and options.seed is None:
            options = replace(options, seed=random.randrange(2**31))
        job.generation = replace(generation, options=options)
        broadcast_text(json.dumps({"ids": list(generation.ids), "options": asdict(options),
                                   "max_tokens": generation.max_tokens}), self.group)
        return super()._run(job)

    def _agree(self, stop: bool) -> bool:
        return _agreed(stop, self.group)


def follow(bundle: Bundle, group: Any) -> int:
    """A rank other than 0: run each generation rank 0 announces, until it closes."""
    stop_ids = bundle.stop_token_ids()
    while True:
        text = broadcast_text("", group)
        if text == _CLOSED:
            return 0
        spec = json.loads(text)
        generate(bundle.model, [int(t) for t in spec["ids"]],
                 options=SamplerOptions(**spec["options"]), max_tokens=int(spec["max_tokens"]),
                 eos_ids=stop_ids, on_token=lambda _: _agreed(False, group),
                 draft=bundle.draft)
