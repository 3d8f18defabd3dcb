"""Write the tiny Qwen3.5 checkpoint with an MTP head, and the head's reference outputs.

transformers builds no MTP head, so the folder is made in two parts:

- the target: what ``Qwen3_5ForCausalLM.save_pretrained`` writes (float32, CPU torch), with
  ``mtp_num_hidden_layers: 1`` in config.json;
- the head: random tensors under the published names and shapes, added to the same
  model.safetensors: ``mtp.fc.weight [hidden, 2 * hidden]``, ``mtp.pre_fc_norm_embedding``,
  ``mtp.pre_fc_norm_hidden``, ``mtp.norm`` ``[hidden]``, and ``mtp.layers.0.*``, which are
  the tensors of a one-layer, full-attention ``Qwen3_5TextModel`` (its ``layers.0.*``;
  its final norm becomes ``mtp.norm``).

``reference.npz`` holds the head's logits as transformers' own modules compute them: the
target's last decoder layer's output ``h`` (before the final norm, read with a forward
hook), ``x = fc(concat(enorm(embed(ids[1:])), hnorm(h[:-1])))`` with transformers'
``Qwen3_5RMSNorm``, the one-layer model over ``inputs_embeds=x``, the target's ``lm_head``.
Then ``CHAIN`` chained steps: each appends the row of the greedy token of the last row,
paired with that row's layer output (before the final norm), and runs the one-layer model
over all rows again. Keys: ``ids [1, T]``, ``logits [T - 1 + CHAIN, V]``,
``chain_tokens [CHAIN]``.

The byte-level test tokenizer (core/mlxrunner/testdata) is copied in so that the folder
loads as a whole bundle.

Run from the repository root (needs torch and transformers):
    .venv/bin/python architectures/qwen3_5/tests/make_mtp_fixtures.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "mtp_fixtures"
NAME = "tiny_mtp"
VOCAB = 432  # the test tokenizer's 426 ids fit
PROMPT_LENGTH = 9
CHAIN = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, rms_norm_eps=1e-6,
    num_hidden_layers=4, full_attention_interval=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                     "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]},
)


def randomize(module: Any, gen: Any) -> None:
    """Weights wider than transformers' initialisation, so that every part moves the output."""
    import torch

    with torch.no_grad():
        for pname, param in module.named_parameters():
            if pname.endswith("A_log"):
                n = param.numel()
                param.copy_(torch.linspace(-7.0, 0.0, n) + 0.1 * torch.randn(n, generator=gen))
            elif pname.endswith("dt_bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            elif pname.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif "norm" in pname:  # zero-centred norms: exercise the 1 + w convention
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
            elif pname.endswith("conv1d.weight"):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))


class Head:
    """The MTP head from transformers' modules (see the module docstring)."""

    def __init__(self, target: Any, seed: int) -> None:
        import torch
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5TextModel

        gen = torch.Generator().manual_seed(seed)
        config = Qwen3_5TextConfig(**{**TEXT_CONFIG, "num_hidden_layers": 1,
                                      "layer_types": ["full_attention"]})
        hidden = config.hidden_size
        self.target = target
        self.layer_model = Qwen3_5TextModel(config).eval().to(torch.float32)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.enorm = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hnorm = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        for part in (self.layer_model, self.fc, self.enorm, self.hnorm):
            randomize(part, gen)

    def tensors(self) -> dict[str, Any]:
        """The head's tensors under their checkpoint names."""
        out = {"mtp.fc.weight": self.fc.weight,
               "mtp.pre_fc_norm_embedding.weight": self.enorm.weight,
               "mtp.pre_fc_norm_hidden.weight": self.hnorm.weight,
               "mtp.norm.weight": self.layer_model.norm.weight}
        for name, value in self.layer_model.layers.named_parameters():
            out[f"mtp.layers.{name}"] = value
        return {k: v.detach().clone().contiguous() for k, v in out.items()}

    def rows_input(self, hidden: Any, ids: Any) -> Any:
        import torch

        embedded = self.enorm(self.target.model.embed_tokens(ids))
        return self.fc(torch.cat([embedded, self.hnorm(hidden)], dim=-1))

    def run(self, rows: Any) -> tuple[Any, Any]:
        """(logits, layer output before the final norm) of the one-layer model over rows."""
        captured: list[Any] = []
        hook = self.layer_model.layers[0].register_forward_hook(
            lambda module, args, output: captured.append(
                output[0] if isinstance(output, tuple) else output))
        try:
            out = self.layer_model(inputs_embeds=rows, use_cache=False)
        finally:
            hook.remove()
        return self.target.lm_head(out.last_hidden_state), captured[0]


def target_hidden(target: Any, ids: Any) -> Any:
    """The target's last decoder layer's output (before the final norm)."""
    captured: list[Any] = []
    hook = target.model.layers[-1].register_forward_hook(
        lambda module, args, output: captured.append(
            output[0] if isinstance(output, tuple) else output))
    try:
        target(input_ids=ids, use_cache=False)
    finally:
        hook.remove()
    return captured[0]


def reference(target: Any, head: Head, ids: np.ndarray) -> dict[str, np.ndarray]:
    import torch

    with torch.no_grad():
        tid = torch.from_numpy(ids)
        h = target_hidden(target, tid)
        rows = head.rows_input(h[:, :-1], tid[:, 1:])
        logits, out = head.run(rows)
        chain_tokens = []
        for _ in range(CHAIN):
            token = logits[:, -1:].argmax(dim=-1)
            chain_tokens.append(int(token))
            rows = torch.cat([rows, head.rows_input(out[:, -1:], token)], dim=1)
            logits, out = head.run(rows)
    return {"ids": ids.astype(np.int32), "logits": logits[0].numpy().astype(np.float32),
            "chain_tokens": np.array(chain_tokens, dtype=np.int32)}


def write_fixture(folder: Path, seed: int = 0) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    import mlxrunner

    torch.manual_seed(seed)
    target = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TEXT_CONFIG)).eval().to(torch.float32)
    randomize(target, torch.Generator().manual_seed(seed + 1))
    head = Head(target, seed + 2)
    folder.mkdir(parents=True, exist_ok=True)
    target.save_pretrained(folder, safe_serialization=True)
    weights = load_file(str(folder / "model.safetensors"))
    weights.update(head.tensors())
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "model.safetensors").chmod(0o644)
    config = json.loads((folder / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    ids = np.random.default_rng(seed + 3).integers(0, VOCAB, (1, PROMPT_LENGTH))
    np.savez_compressed(folder / "reference.npz", **reference(target, head, ids))
    tokenizer = Path(mlxrunner.__file__).parent / "testdata" / "tokenizer-bytelevel"
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer / name, folder / name)
    keep = {"config.json", "model.safetensors", "reference.npz", *TOKENIZER_FILES}
    for extra in folder.iterdir():
        if extra.name not in keep:
            extra.unlink()


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else FIXTURES / NAME
    write_fixture(folder)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{folder}: {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
