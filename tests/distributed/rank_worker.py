"""One rank of a distributed test job (or, with no MLX_RANK, the single process it is
compared with): loads a tiny target sharded, decodes greedily with and without a random
draft, and (rank 0) writes the tokens and the prompt's last logits (whole, and prefilled in
chunks) as JSON.

    python rank_worker.py FOLDER MODE OUT.json [--tokens N] [--draft ARCH]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys

import mlx.core as mx

mx.set_default_device(mx.cpu)

from mlx.utils import tree_flatten  # noqa: E402

from mlxrunner import distributed  # noqa: E402
from mlxrunner.decode import prefill  # noqa: E402
from mlxrunner.testing.speculative import (  # noqa: E402
    ScriptedDraft,
    plain_tokens,
    random_draft,
    speculative_tokens,
)

PROMPT = [3, 17, 42, 5, 9, 11, 2, 30, 7, 21, 14, 8]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("mode")
    parser.add_argument("out")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--draft", action="append", default=[])
    args = parser.parse_args()
    # a rank stuck in a collective says where before the job is killed
    faulthandler.dump_traceback_later(float(os.environ.get("RANK_WORKER_TIMEOUT", "45")),
                                      exit=True)
    group = distributed.world()
    model = distributed.load_sharded(args.folder, args.mode, group, dtype="float32")
    logits = model(mx.array([PROMPT]))[0, -1]
    # chunks before the last fill the caches alone (caches_only: Gemma 4 skips the layers
    # after its last cache write, every rank alike, hand-overs in them included)
    chunked, _ = prefill(model, PROMPT, model.make_cache(), chunk=5)
    plain = plain_tokens(model, PROMPT, args.tokens)
    result: dict = {"rank": group.rank(), "size": group.size(), "logits": logits.tolist(),
                    "chunked": chunked[0].tolist(),
                    "parameters": sum(v.size for _, v in tree_flatten(model.parameters())),
                    "plain": plain}
    # a draft that knows the answer but errs at a moving place: every accepted length, so
    # every rollback length of the sharded caches, occurs
    scripted = ScriptedDraft.for_script(model, PROMPT + plain)
    result["scripted"] = speculative_tokens(model, scripted, PROMPT, args.tokens)[0]
    for architecture in args.draft:
        draft = random_draft(model, architecture, seed=5)
        tokens, _ = speculative_tokens(model, draft, PROMPT, args.tokens)
        result[architecture] = tokens
    out = args.out if group.rank() == 0 else f"{args.out}.rank{group.rank()}"
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
