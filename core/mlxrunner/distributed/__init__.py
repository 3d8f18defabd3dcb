"""Beyond one process: tensor and pipeline parallelism on MLX's ``mx.distributed``.

- :func:`world` joins the job's group (launched by ``mlx.launch`` or with its environment);
- :func:`load_sharded` loads a folder's target as this rank's part (``tensor``: every
  layer, its share of the heads; ``pipeline``: a range of the layers);
- :mod:`.ranks`: rank 0 alone talks to the user; a rank that is gone ends the job with one
  line on rank 0.

Every rank then runs the same generation (plain or speculative, the draft replicated) on
the same inputs and chooses the same tokens. See docs/distributed.md.
"""

from __future__ import annotations

from .group import MODES, DistributedError, launched, world
from .loading import load_sharded
from .pipeline import CountingCache, stage_cuts
from .ranks import write_local_hostfile

__all__ = ["MODES", "CountingCache", "DistributedError", "launched", "load_sharded",
           "stage_cuts", "world", "write_local_hostfile"]
