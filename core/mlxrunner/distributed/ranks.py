"""One job, one voice: rank 0 talks to the user, every rank computes, a lost rank ends it.

- :func:`speak_only_on_rank_0`: the other ranks' standard output and error go nowhere
  (their exit status still counts) and they never read standard input (``mlx.launch``
  leaves it open and empty), so :func:`broadcast_text` gives them rank 0's prompt;
- :func:`lost_rank`: the one-line :class:`DistributedError` a collective's failure becomes
  (MLX's ring reports a peer that went away as ``[ring] connection to a peer was lost``);
  MLX's own per-socket complaints, printed by its C++ side, are muted on rank 0;
- :func:`launch_local`: ``--ranks N``, the job's processes on this machine over loopback,
  for which ``mlx.launch --hosts 127.0.0.1,...`` is the general form.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .group import DistributedError

#: what MLX's collectives raise, and its ring prints, when a peer is gone
_LOST = ("connection to a peer was lost", "closed by the peer", "Too many send/recv errors",
         "failed with errno")


def speak_only_on_rank_0(group: Any) -> None:
    """Silence this process unless it is rank 0 (see the module)."""
    if group.size() <= 1:
        return
    if group.rank() != 0:
        sys.stdin = io.StringIO("")
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the process's lifetime)
        sys.stderr = sys.stdout
        return
    _mute_native_stderr()


def _mute_native_stderr() -> None:
    """Read file descriptor 2 (where MLX's C++ side writes) through a pipe, keeping Python's
    ``sys.stderr`` on a copy of the original: MLX's lines pass on, except the ring's
    complaints about a lost peer, which become our one line. A collective that was already
    queued when the peer went can wait forever instead of raising; so once the ring has
    said a peer is gone, a process that has not ended by itself within ``LOST_GRACE``
    seconds prints the line and exits with status 1."""
    try:
        sys.stderr.flush()
        kept = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        sys.stderr = os.fdopen(kept, "w", buffering=1, encoding="utf-8", errors="replace")
    except (OSError, ValueError, AttributeError):  # no real stderr (captured): leave it
        return
    threading.Thread(target=_watch_native_stderr, args=(read,), daemon=True,
                     name="mlxrunner-ranks").start()


#: seconds a rank waits for its own error after MLX's ring said a peer is gone
LOST_GRACE = 3.0
_said = threading.Lock()
_said_once: list[str] = []


def say_once(line: str) -> None:
    """Print the job's one line about its end on stderr (a second call prints nothing)."""
    with _said:
        if _said_once:
            return
        _said_once.append(line)
        print(line, file=sys.stderr, flush=True)


def _watch_native_stderr(fd: int) -> None:
    with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if not any(s in line for s in _LOST):
                sys.stderr.write(line)
                continue
            threading.Timer(LOST_GRACE, _end_lost).start()
            for _ in lines:  # the rest of the ring's complaints
                pass
            return


def _end_lost() -> None:
    from .group import world

    say_once(f"mlxrunner: error: {lost_rank(world())}")
    os._exit(1)


def broadcast_text(text: str, group: Any) -> str:
    """Rank 0's ``text`` on every rank (the others' is ignored)."""
    if group.size() <= 1:
        return text
    mine = text.encode("utf-8") if group.rank() == 0 else b""
    length = mx.distributed.all_sum(mx.array([len(mine)], dtype=mx.int32), group=group)
    n = int(np.array(length)[0])
    data = mx.array(list(mine), dtype=mx.int32) if mine else mx.zeros((n,), dtype=mx.int32)
    if n == 0:
        return ""
    total = mx.distributed.all_sum(data, group=group)
    return bytes(np.array(total).astype(np.uint8)).decode("utf-8")


def is_lost_rank(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _LOST)


def lost_rank(group: Any) -> DistributedError:
    return DistributedError(f"another rank of this {group.size()}-rank job stopped (MLX lost "
                            "its connection to it): ending the job")


def write_local_hostfile(path: Path, ranks: int) -> None:
    """An ``MLX_HOSTFILE`` for ``ranks`` processes of one ring job on 127.0.0.1, each on a
    port free now."""
    sockets = [socket.socket() for _ in range(ranks)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
    path.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))


def launch_local(ranks: int, argv: Sequence[str]) -> int:
    """Run ``argv`` (an ``mlxrunner`` command line) as ``ranks`` processes of one ring job on
    127.0.0.1: rank 0 keeps this terminal (input and output), the others are silent. When one
    ends with an error, the others are stopped; the exit status is the first error's."""
    if ranks < 2:
        raise DistributedError("--ranks needs at least 2 processes")
    with tempfile.TemporaryDirectory(prefix="mlxrunner-ranks-") as tmp:
        hostfile = Path(tmp) / "hosts.json"
        write_local_hostfile(hostfile, ranks)
        procs = []
        for rank in range(ranks):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile),
                   "MLX_WORLD_SIZE": str(ranks)}
            quiet = subprocess.DEVNULL if rank else None
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "mlxrunner.cli", *argv], env=env,
                stdin=subprocess.DEVNULL if rank else None, stdout=quiet, stderr=quiet))
        try:
            return _wait(procs)
        except KeyboardInterrupt:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait()
            return 130


def _wait(procs: list[subprocess.Popen[bytes]], grace: float = 10.0) -> int:
    """Wait for the job; after a rank's error the others get ``grace`` seconds to end on
    their own (rank 0 notices at its next collective and says so), then are stopped."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
        if failed or all(c is not None for c in codes):
            break
        time.sleep(0.05)
    if not failed:
        return 0
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
            p.wait()
    rank, code = failed[0]
    if procs[0].returncode in (0, None) or procs[0].returncode < 0:
        # rank 0 did not say it: say it here, once
        print(f"mlxrunner: error: rank {rank} of {len(procs)} exited with status {code}: "
              "ending the job", file=sys.stderr)
    return code if code > 0 else 1
