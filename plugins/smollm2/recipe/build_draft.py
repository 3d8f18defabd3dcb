"""Build the default model's DFlash2 draft: the target answers the recipe's prompts, the
draft learns from those answers, and the pair is measured on held-out prompts.

    python plugins/smollm2/recipe/build_draft.py TARGET.gguf --out DIR [--train-prompts 1500]
        [--time-budget-s 360] [--max-tokens 256]

1. Prompts (``prompts.py``: written from templates here; held-out ones share no subject with
   the training ones) rendered with the target's chat template.
2. The target's greedy answers, generated in one continuous batch (``generate_batch``:
   every row is what a one-prompt run computes), written as
   ``DIR/answers-{train,heldout}.jsonl``.
3. ``mlxrunner train-draft`` (its own process, as a user would run it) on the rendered
   conversations, labels the target's own greedy tokens, into ``DIR/draft``.
4. ``bench/default_model.py``'s measurement is separate (it times plain against
   speculative decoding on the held-out prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

import mlxrunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import prompts  # noqa: E402

#: a control token chat text never contains, standing for the draft block's unknown tokens
MASK_TOKEN = "<empty_output>"


def answer(bundle: mlxrunner.Bundle, texts: list[str], max_tokens: int, path: Path,
           batch: int, time_s: float = 0.0, more: bool = True) -> list[dict]:
    """The target's greedy replies to ``texts`` as records in ``path``, written after every
    chunk of prompts (a killed run keeps the chunks it finished, and the next run goes on
    from there). ``time_s``: start no chunk after that many seconds; ``more=False``: only
    the records ``path`` already holds."""
    records: list[dict] = []
    if path.exists():
        records = [json.loads(line) for line in path.read_text().splitlines() if line]
        if [r["prompt"] for r in records] != texts[:len(records)]:
            records = []  # other prompts (another seed or count): answer afresh
    if not more and records:
        return records
    stop = bundle.stop_token_ids()
    greedy = mlxrunner.SamplerOptions(temperature=0)
    t0, tokens = time.perf_counter(), 0
    chunk = batch * 16
    for start in range(len(records), len(texts), chunk):
        if time_s and time.perf_counter() - t0 > time_s:
            break
        chosen = texts[start:start + chunk]
        rendered = [bundle.renderer.render([{"role": "user", "content": t}]) for t in chosen]
        ids = [bundle.tokenizer.encode(r) for r in rendered]
        # one continuous batch a chunk (each row what a one-prompt greedy run gives),
        # longest prompts first so that the batch drains evenly
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        results = dict(zip(order, mlxrunner.generate_batch(
            bundle.model, [ids[i] for i in order], options=greedy, max_tokens=max_tokens,
            eos_ids=stop, max_sequences=batch), strict=True))
        for i, text in enumerate(chosen):
            reply_ids = [t for t in results[i].tokens if t not in stop]
            tokens += len(reply_ids)
            reply = bundle.tokenizer.decode(reply_ids, skip_special_tokens=True)
            # a reply cut at max_tokens did not end: no end-of-turn after it
            ended = results[i].finish_reason == "stop"
            records.append({"prompt": text, "answer": reply, "tokens": len(reply_ids),
                            "text": rendered[i] + reply + ("<|im_end|>\n" if ended else "")})
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, path)
        print(f"{path.name}: {len(records)} answers ({tokens} new tokens in "
              f"{time.perf_counter() - t0:.1f}s)", file=sys.stderr, flush=True)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("--out", required=True)
    ap.add_argument("--train-prompts", type=int, default=1500)
    ap.add_argument("--heldout-prompts", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64, help="prompts answered together")
    ap.add_argument("--time-budget-s", type=float, default=360)
    ap.add_argument("--answer-time-s", type=float, default=0,
                    help="answer the training prompts for at most this long (0: all)")
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8)
    # SmolLM2's own attention shape (9 query heads over 3 key/value heads of 64)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=384)
    # 48 x 48 blocks a step: the first H200 build's 16 x 32 left the GPU waiting on launches
    # (0.087 s a draft step, a few ms of arithmetic)
    ap.add_argument("--train-batch", type=int, default=48)
    ap.add_argument("--anchors", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=150,
                    help="held-out estimate every N steps; the best one's draft is kept")
    # training across device calls (each at most 10 minutes): the first stops at a step with
    # a checkpoint, the next resumes it; --time-budget-s is the budget of all of them
    ap.add_argument("--stop-at", type=int, default=0,
                    help="stop at this step with a checkpoint (0: at the budget)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the checkpoint in OUT/draft (answers reused)")
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--reuse-answers", action="store_true",
                    help="train on the answers already written, answer no more")
    ap.add_argument("--answers-only", action="store_true",
                    help="write the answers and corpora, do not train (a separate call)")
    # rank 32: the selector's two vocabulary codebooks are most of a small draft's bytes
    ap.add_argument("--selector-rank", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    # bfloat16 on a GPU: float32 over the Q4 weights made answering and training several
    # times slower there (the shipped model computes in float32)
    ap.add_argument("--target-dtype", default="auto")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bundle = mlxrunner.load(args.target, use_draft=False,
                            dtype=None if args.target_dtype == "auto" else args.target_dtype)
    mask_id = bundle.tokenizer.token_to_id(MASK_TOKEN)
    if mask_id is None:
        raise SystemExit(f"{args.target}: no {MASK_TOKEN} token to use as the mask")
    # held-out first: a time-bounded run still leaves the estimate's replies
    texts = {"heldout": prompts("heldout", args.heldout_prompts, args.seed),
             "train": prompts("train", args.train_prompts, args.seed)}
    for split, chosen in texts.items():
        records = answer(bundle, chosen, args.max_tokens, out / f"answers-{split}.jsonl",
                         args.batch, args.answer_time_s if split == "train" else 0.0,
                         more=not (args.reuse_answers or args.resume))
        folder = out / f"corpus-{split}"
        folder.mkdir(exist_ok=True)
        for stale in folder.glob("*.txt"):  # an earlier run's, maybe of other prompts
            stale.unlink()
        for i, record in enumerate(records):
            (folder / f"{i:05d}.txt").write_text(record["text"])
    del bundle
    mx.clear_cache()
    if args.answers_only:
        return
    command = [sys.executable, "-m", "mlxrunner_dflash.train", args.target,
               "--corpus", str(out / "corpus-train"), "--glob", "*.txt",
               "--heldout", str(out / "corpus-heldout"),
               "--out", str(out / "draft"), "--kind", "dflash2", "--labels", "target",
               # blocks where decoding puts them: in the replies (not the prompts), measured
               # on the held-out replies themselves, one conversation per row
               "--anchor-on", "target", "--eval-text", "corpus",
               # every held-out reply (the estimate takes one per --anchors blocks)
               "--eval-blocks", str(args.heldout_prompts * args.anchors),
               "--steps", str(args.steps), "--batch", str(args.train_batch),
               "--seq-len", str(args.seq_len), "--anchors", str(args.anchors),
               "--lr", str(args.lr), "--layers", str(args.layers),
               "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
               "--head-dim", str(args.head_dim), "--selector-rank", str(args.selector_rank),
               "--block-size", str(args.block_size), "--mask-token-id", str(mask_id),
               "--save-dtype", "bfloat16", "--seed", str(args.seed),
               "--log", str(out / "train-log.jsonl"), "--eval-prompts", "0",
               # the 1,024-answer build overfit (held-out cross-entropy 4.9 against 1.4):
               # keep the step whose held-out estimate was best
               "--eval-every", str(args.eval_every), "--keep-best",
               "--save-every", str(args.save_every), "--time-budget-s", str(args.time_budget_s),
               "--target-dtype", args.target_dtype, "--stop-at", str(args.stop_at),
               *(["--resume"] if args.resume else [])]
    print(" ".join(command), file=sys.stderr)
    completed = subprocess.run(command)
    if completed.returncode:
        raise SystemExit(f"train-draft failed with exit status {completed.returncode}")


if __name__ == "__main__":
    main()
