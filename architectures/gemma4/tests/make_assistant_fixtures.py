"""Write tiny Gemma 4 assistant drafts, their targets, and transformers' assistant outputs.

    .venv/bin/python architectures/gemma4/tests/make_assistant_fixtures.py [OUT_DIR]

Each draft is transformers' ``Gemma4AssistantForCausalLM`` (CPU torch, float32, eager
attention) with random weights of O(1) effect, written with ``save_pretrained`` under
``OUT_DIR/assistant/<name>``. Its target is a tiny ``Gemma4ForCausalLM`` of the same vocabulary
whose hidden size is the draft's ``backbone_hidden_size``: the committed ``e2b`` fixture (KV
sharing and per-layer inputs, as the published E2B assistant's target has), or ``small`` (a
32-token vocabulary, small enough for the chi-square test's exact enumeration), written
here too.

The shapes are those of the published assistants scaled down: layers with ``q_proj``,
``q_norm`` and ``o_proj`` only (every layer reads the target's keys and values), four norms,
an MLP and ``layer_scalar`` per layer, ``pre_projection`` [hidden, 2 * backbone],
``post_projection`` [backbone, hidden], the tied head, and with ``use_ordered_embeddings``
``masked_embedding.centroids`` [num_centroids, hidden] and ``masked_embedding.token_ordering``
[vocab] (a permutation of the vocabulary).

``reference.npz`` of each draft holds, for prompt lengths 1, 9 and 20 (past the target's
window of 8 and twice it): ``ids_{L}`` (the prompt), ``token_{L}`` (the token at position L
that the draft step reads), and from transformers, given the target's ``shared_kv_states``
and last final-normed hidden state after the prompt: ``logits_{L}`` [steps, V] (masked
entries at transformers' fill value) and ``hidden_{L}`` [steps, backbone] (the projected
state) of three chained steps (greedy), all at position L as transformers' candidate
generator runs them.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
PROMPT_LENGTHS = (1, 9, 20)
STEPS = 3

_spec = importlib.util.spec_from_file_location("gemma4_make_fixtures",
                                               HERE / "make_fixtures.py")
assert _spec is not None and _spec.loader is not None
target_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(target_fixtures)

_S, _F = "sliding_attention", "full_attention"

#: tiny targets written here (the e2b target is make_fixtures.py's)
TARGETS: dict[str, dict] = {
    "small": {
        **target_fixtures._COMMON,
        "vocab_size": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 1,
        "num_global_key_value_heads": 1,
        "layer_types": [_S, _S, _F, _S, _F],
        "num_kv_shared_layers": 1,
        "hidden_size_per_layer_input": 0,
        "attention_k_eq_v": True,
    },
}


def _assistant_text(vocab: int) -> dict:
    return {
        "model_type": "gemma4_text",
        "vocab_size": vocab,
        "vocab_size_per_layer_input": 0,
        "hidden_size": 24,
        "intermediate_size": 40,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "global_head_dim": 32,
        "layer_types": [_S, _S, _F],
        "sliding_window": target_fixtures.WINDOW,
        "rms_norm_eps": 1e-6,
        "hidden_size_per_layer_input": 0,
        "enable_moe_block": False,
        "use_double_wide_mlp": False,
        "attention_k_eq_v": False,
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    }


#: name: (target, assistant config)
DRAFTS: dict[str, tuple[str, dict]] = {
    "e2b_plain": ("e2b", {"backbone_hidden_size": 32, "use_ordered_embeddings": False}),
    "e2b_ordered": ("e2b", {"backbone_hidden_size": 32, "use_ordered_embeddings": True,
                            "num_centroids": 16, "centroid_intermediate_top_k": 4}),
    "small_plain": ("small", {"backbone_hidden_size": 32, "use_ordered_embeddings": False}),
    "small_ordered": ("small", {"backbone_hidden_size": 32, "use_ordered_embeddings": True,
                                "num_centroids": 8, "centroid_intermediate_top_k": 3}),
}


def target_folder(name: str, out_dir: Path) -> Path:
    return out_dir / name if name == "e2b" else out_dir / "assistant" / f"{name}_target"


def write_target(name: str, out_dir: Path) -> Path:
    """The small target's folder (the e2b one comes from make_fixtures.py)."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    config = Gemma4TextConfig(**TARGETS[name], attn_implementation="eager")
    model = Gemma4ForCausalLM(config).eval().float()
    target_fixtures._randomize(model, seed=sum(map(ord, name)) + 7)
    folder = target_folder(name, out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").unlink(missing_ok=True)
    return folder


def _randomize_assistant(model, seed: int) -> None:
    import torch

    target_fixtures._randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        masked = getattr(model, "masked_embedding", None)
        if masked is not None:
            masked.token_ordering.copy_(torch.randperm(masked.vocab_size, generator=gen))


def _as_the_target_caches_hold(shared: dict, window: int) -> dict:
    """The target's keys and values as its caches hold them after the prompt: every position
    for full attention, the last ``window`` for sliding attention (a ring of the window; also
    what transformers' own sliding cache hands over after a decode step). Handed a longer
    history, transformers' assistant would take ``window + 1`` (its bidirectional window
    counts the distance inclusively)."""
    keys, values = shared["sliding_attention"]
    return {"full_attention": shared["full_attention"],
            "sliding_attention": (keys[:, :, -window:], values[:, :, -window:])}


def write_draft(name: str, out_dir: Path) -> Path:
    """Write draft ``name`` (and its small target when needed) with ``reference.npz``."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    target_name, extra = DRAFTS[name]
    tfolder = target_folder(target_name, out_dir)
    if target_name != "e2b" or not (tfolder / "config.json").exists():
        tfolder = (write_target(target_name, out_dir) if target_name != "e2b"
                   else target_fixtures.write_fixture("e2b", out_dir))
    target = Gemma4ForCausalLM.from_pretrained(tfolder, attn_implementation="eager").eval()
    vocab = target.config.vocab_size

    torch.manual_seed(0)
    config = Gemma4AssistantConfig(text_config=_assistant_text(vocab), **extra)
    config.text_config._attn_implementation = "eager"
    config._attn_implementation = "eager"
    draft = Gemma4AssistantForCausalLM(config).eval().float()
    _randomize_assistant(draft, seed=sum(map(ord, name)))
    folder = out_dir / "assistant" / name
    folder.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").unlink(missing_ok=True)

    rng = np.random.default_rng(len(name) + vocab)
    arrays = {}
    for length in PROMPT_LENGTHS:
        ids = rng.integers(3, vocab, size=length + 1)
        prompt, token = ids[:length], int(ids[length])
        with torch.no_grad():
            out = target(torch.tensor(prompt)[None], use_cache=False, output_hidden_states=True,
                         return_shared_kv_states=True)
            shared = _as_the_target_caches_hold(out.shared_kv_states,
                                                target.config.sliding_window)
            hidden = out.hidden_states[-1][:, -1:]
            position = torch.tensor([[length]])
            last = torch.tensor([[token]])
            logits, states = [], []
            for _ in range(STEPS):
                embeds = torch.cat([target.model.embed_tokens(last), hidden], dim=-1)
                step = draft(inputs_embeds=embeds, position_ids=position,
                             shared_kv_states=shared)
                logits.append(step.logits[0, 0])
                states.append(step.last_hidden_state[0, 0])
                last = step.logits.argmax(dim=-1)
                hidden = step.last_hidden_state
        arrays[f"ids_{length}"] = prompt.astype(np.int32)
        arrays[f"token_{length}"] = np.array(token, dtype=np.int32)
        arrays[f"logits_{length}"] = torch.stack(logits).numpy().astype(np.float32)
        arrays[f"hidden_{length}"] = torch.stack(states).numpy().astype(np.float32)
    np.savez_compressed(folder / "reference.npz", **arrays)
    return folder


def main(argv: list[str]) -> None:
    out_dir = Path(argv[1]) if len(argv) > 1 else FIXTURES
    for name in DRAFTS:
        folder = write_draft(name, out_dir)
        size = sum(f.stat().st_size for f in folder.iterdir())
        config = json.loads((folder / "config.json").read_text())
        print(f"{folder}: {size / 1024:.0f} KiB, "
              f"{config['text_config']['num_hidden_layers']} layers")


if __name__ == "__main__":
    main(sys.argv)
