"""``mlxrunner ARGS...`` as one rank of a job, where rank 1 dies (``os._exit(3)``) at its
third forward: rank 0 must end with one line and a non-zero status."""

from __future__ import annotations

import faulthandler
import os
import sys

import mlxrunner.distributed as distributed
from mlxrunner.cli import main

load_sharded = distributed.load_sharded


def dying_load(*args, **kwargs):
    model = load_sharded(*args, **kwargs)
    if distributed.world().rank() == 1:
        base = type(model)
        calls = [0]

        def __call__(self, *a, **k):
            calls[0] += 1
            if calls[0] == 3:
                os._exit(3)
            return base.__call__(self, *a, **k)

        model.__class__ = type(base.__name__, (base,), {"__call__": __call__})
    return model


distributed.load_sharded = dying_load
# a rank 0 that never notices says where it waits before the test's job is killed
faulthandler.dump_traceback_later(30, exit=True)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
