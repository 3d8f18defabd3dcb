"""Jobs of several processes on this machine over MLX's ring backend (loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlxrunner.distributed import write_local_hostfile

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
#: seconds a whole job may take before its processes are killed
JOB_TIMEOUT = 60


@dataclass
class Job:
    returncodes: list[int]
    outputs: list[str]  # each rank's stdout and stderr, together


def _ring_works(tmp: Path) -> str | None:
    """None if two processes can all_sum over the ring backend here, else why not."""
    code = ("import mlx.core as mx; g = mx.distributed.init(strict=True, backend='ring'); "
            "print(mx.distributed.all_sum(mx.ones(2), group=g).tolist())")
    job = run_job([sys.executable, "-c", code], tmp, size=2, timeout=30)
    if job.returncodes != [0, 0] or any("[2.0, 2.0]" not in out for out in job.outputs):
        return f"MLX's ring backend does not work over loopback here: {job.outputs}"
    return None


def run_job(argv: list[str], tmp: Path, size: int = 2, timeout: float = JOB_TIMEOUT,
            env: dict[str, str] | None = None) -> Job:
    """Run ``argv`` as ranks 0..size-1 of one ring job on 127.0.0.1 (the environment
    ``mlx.launch`` gives its processes), each killed after ``timeout`` seconds."""
    hostfile = tmp / f"hosts-{os.getpid()}-{len(list(tmp.glob('hosts-*')))}.json"
    write_local_hostfile(hostfile, size)
    procs = []
    for rank in range(size):
        rank_env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile),
                    **(env or {})}
        procs.append(subprocess.Popen(argv, cwd=HERE, env=rank_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs, codes = [], []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            out += f"\n(killed after {timeout} s)"
        outputs.append(out)
        codes.append(proc.returncode)
    return Job(codes, outputs)


@pytest.fixture(scope="session")
def ring(tmp_path_factory):
    """``run_job``, once the ring backend has been seen to work (else the test skips)."""
    tmp = tmp_path_factory.mktemp("ring")
    reason = _ring_works(tmp)
    if reason:
        pytest.skip(reason)
    return lambda argv, **kw: run_job(argv, tmp, **kw)
