"""The ``train-draft`` command's options and settings: what the CLI needs to build its
parser, apart from the trainer (``train``), which imports its numerical dependencies only
when the command runs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

HELP = "train a DFlash / DFlash2 draft for a target (target frozen, taps on the fly)"
#: the draft kinds ``--kind`` takes
KIND_NAMES = ("dflash", "dflash2")


@dataclass
class TrainSettings:
    """Everything a run depends on (saved with checkpoints; resume checks it)."""

    target: str
    corpus: list[str]
    out: str
    kind: str = "dflash2"
    heldout: list[str] = field(default_factory=list)
    glob: str = "*"
    steps: int = 2000
    batch: int = 8
    seq_len: int = 256
    anchors: int = 16
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup: int = 0  # 0: 5% of the steps
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    block_size: int = 8
    layers: int = 2
    heads: int = 0  # 0: from the target's hidden size
    kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    taps: str = "auto"
    mask_token_id: int | None = None
    decay_gamma: float = 0.0  # 0: block_size / 2
    labels: str = "target"
    # where blocks are anchored: anywhere, or only in text the target wrote (needs target labels)
    anchor_on: str = "all"
    self_distill: int = 0
    distill_mix: float = 0.5
    distill_batch: int = 64  # sequences generated together (one forward per token for all)
    # share of the pool prompted like a user: a document's first 4-32 tokens, not a window
    distill_openings: float = 0.5
    distill_time_s: float = 0.0  # 0: at most 40% of --time-budget-s (no limit without one)
    prompt_len: int = 0  # 0: seq_len // 4
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 64
    selector_top_k: int = 16
    selector_weight: float = 1.0
    heldout_fraction: float = 0.02
    eval_blocks: int = 512
    # the held-out text blocks are measured on: the target's continuations of held-out
    # windows, or the held-out documents themselves (a corpus of the target's own replies)
    eval_text: str = "generated"
    eval_prompts: int = 4
    eval_tokens: int = 96
    eval_every: int = 0
    keep_best: bool = False  # save the evaluated step of the best tau estimate, not the last
    save_every: int = 500
    save_dtype: str = "auto"
    target_dtype: str = "auto"  # what the target computes in while training: auto (declared)
    time_budget_s: float = 0.0
    compile: str = "auto"  # mx.compile the training step: auto (on except on the CPU), on, off
    stop_at: int = 0  # stop (checkpointed) at this step; --resume continues the schedule
    log: str | None = None
    seed: int = 0
    resume: bool = False
    quiet: bool = False

    # Settings a resumed run must share with the checkpoint it continues.
    FIXED = ("target", "kind", "block_size", "layers", "heads", "kv_heads", "head_dim",
             "intermediate_size", "taps", "conv_kernel_size", "conv_group_size",
             "selector_rank", "selector_top_k", "seq_len", "batch", "anchors")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train-draft`` options (``mlxrunner train-draft --help``)."""
    d = TrainSettings(target="", corpus=[], out="")
    parser.add_argument("target", help="target model folder or registered name")
    parser.add_argument("--corpus", nargs="+", default=[], metavar="FILE",
                        help="text files or folders (folders: every file matching --glob)")
    parser.add_argument("--corpus-list", metavar="FILE",
                        help="a file naming corpus files, one per line")
    parser.add_argument("--heldout", nargs="+", default=[], metavar="FILE",
                        help="held-out files for the acceptance report (default: a seeded "
                             f"{d.heldout_fraction:.0%}% of the corpus documents)")
    parser.add_argument("--heldout-list", metavar="FILE", help="held-out files, one per line")
    parser.add_argument("--glob", default=d.glob, help="file pattern inside corpus folders")
    parser.add_argument("--out", required=True, help="the draft folder to write")
    parser.add_argument("--kind", choices=KIND_NAMES, default=d.kind)
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch", type=int, default=d.batch, help="windows per step")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per window")
    parser.add_argument("--anchors", type=int, default=d.anchors,
                        help="blocks trained per window")
    parser.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    parser.add_argument("--warmup", type=int, default=d.warmup, help="warm-up steps (0: 5%%)")
    parser.add_argument("--weight-decay", type=float, default=d.weight_decay)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--layers", type=int, default=d.layers, help="draft layers")
    parser.add_argument("--heads", type=int, default=d.heads, help="attention heads (0: auto)")
    parser.add_argument("--kv-heads", type=int, default=d.kv_heads, help="0: heads / 2")
    parser.add_argument("--head-dim", type=int, default=d.head_dim, help="0: auto")
    parser.add_argument("--intermediate-size", type=int, default=d.intermediate_size,
                        help="MLP width (0: 3 x hidden)")
    parser.add_argument("--taps", default=d.taps,
                        help="target layers feeding the context: auto or i,j,...")
    parser.add_argument("--mask-token-id", type=int, default=None,
                        help="id of the block's mask token (default: the tokenizer's <|mask|>)")
    parser.add_argument("--decay-gamma", type=float, default=d.decay_gamma,
                        help="loss weight exp(-(k-1)/gamma) of block row k (0: block / 2)")
    parser.add_argument("--labels", choices=["target", "corpus"], default=d.labels,
                        help="train on the target's greedy tokens (default) or corpus tokens")
    parser.add_argument("--anchor-on", choices=["all", "target"], default=d.anchor_on,
                        help="where training blocks are anchored: anywhere in a window, or "
                             "only on tokens the target writes itself (with --labels target: "
                             "in a corpus of its replies, the replies, not the prompts)")
    parser.add_argument("--self-distill", type=int, default=d.self_distill, metavar="N",
                        help="first generate N greedy sequences with the target and mix them in")
    parser.add_argument("--distill-mix", type=float, default=d.distill_mix,
                        help="share of each batch drawn from the self-distilled sequences")
    parser.add_argument("--distill-batch", type=int, default=d.distill_batch,
                        help="self-distilled sequences generated together")
    parser.add_argument("--distill-openings", type=float, default=d.distill_openings,
                        help="share of self-distilled sequences prompted with a document's "
                             "first 4-32 tokens (the rest: a window of --seq-len / 4 tokens)")
    parser.add_argument("--conv-kernel-size", type=int, default=d.conv_kernel_size)
    parser.add_argument("--conv-group-size", type=int, default=d.conv_group_size)
    parser.add_argument("--selector-rank", type=int, default=d.selector_rank)
    parser.add_argument("--selector-top-k", type=int, default=d.selector_top_k)
    parser.add_argument("--eval-text", choices=["generated", "corpus"], default=d.eval_text,
                        help="held-out text of the tau estimate: the target's continuations "
                             "of held-out windows (to their first EOS), or the held-out "
                             "documents as they are, one per row (a corpus of the target's "
                             "own replies)")
    parser.add_argument("--eval-blocks", type=int, default=d.eval_blocks,
                        help="held-out blocks of the tau estimate (one row per --anchors "
                             "blocks)")
    parser.add_argument("--eval-prompts", type=int, default=d.eval_prompts,
                        help="held-out prompts for the real speculative loop (0: skip)")
    parser.add_argument("--eval-tokens", type=int, default=d.eval_tokens,
                        help="tokens generated per held-out prompt")
    parser.add_argument("--eval-every", type=int, default=d.eval_every,
                        help="held-out estimate every N steps (0: at the end only)")
    parser.add_argument("--keep-best", action="store_true",
                        help="with --eval-every: save the draft of the evaluated step with "
                             "the best held-out tau estimate (a draft that overfits a small "
                             "corpus peaks before its last step); checkpoints stay the last")
    parser.add_argument("--save-every", type=int, default=d.save_every,
                        help="checkpoint every N steps")
    parser.add_argument("--save-dtype", default=d.save_dtype,
                        help="dtype of the saved draft: auto (the target's), float32, bfloat16")
    parser.add_argument("--target-dtype", default=d.target_dtype,
                        help="what the frozen target computes in while training: auto (what "
                             "its folder declares), float32, bfloat16, float16 (bfloat16 on "
                             "a GPU: a float32 target makes each step several times slower)")
    parser.add_argument("--time-budget-s", type=float, default=d.time_budget_s,
                        help="stop training after this many seconds (0: no limit)")
    parser.add_argument("--distill-time-s", type=float, default=d.distill_time_s,
                        help="time limit of self-distillation (0: 40%% of --time-budget-s)")
    parser.add_argument("--compile", choices=["auto", "on", "off"], default=d.compile,
                        help="mx.compile the training step (auto: on except on the CPU)")
    parser.add_argument("--stop-at", type=int, default=d.stop_at, metavar="STEP",
                        help="stop at this step with a checkpoint (--resume continues)")
    parser.add_argument("--log", help="append JSON lines (steps, evals, report) to this file")
    parser.add_argument("--resume", action="store_true",
                        help="continue from OUT/checkpoint (same settings)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--quiet", action="store_true", help="no progress output")
