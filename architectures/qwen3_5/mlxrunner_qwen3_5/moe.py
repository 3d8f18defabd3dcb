"""Qwen3.5 mixture of experts (``qwen3_5_moe``: Qwen3.5-35B-A3B and its larger siblings).

The dense model's layers (:mod:`.model`) with the feed-forward block replaced, in the sparse
layers, by

    p = softmax(gate(x));  E = the num_experts_per_tok largest p  (renormalised over E
    when norm_topk_prob, the default)
    out = sum_{e in E} p_e * down_e(silu(gate_e(x)) * up_e(x))
          + sigmoid(shared_expert_gate(x)) * shared_expert(x)

Layer ``i`` is sparse unless listed in ``mlp_only_layers`` or ``(i + 1) %
decoder_sparse_step != 0`` (the rule Qwen's MoE configs share; the released Qwen3.5 MoE
configs leave both at their defaults, every layer sparse); the others keep the dense
``intermediate_size`` MLP.

Checkpoints hold the experts in one of three layouts, which ``sanitize`` packs into ours
(``experts.gate_up_proj.weight [E, 2I, H]``, gate rows first, and ``experts.down_proj.weight
[E, H, I]``): transformers 5.x's fused ``experts.gate_up_proj`` / ``experts.down_proj``
(already that layout, without ``.weight``); older per-expert ``experts.N.{gate,up,down}_proj``;
mlx-lm's stacked ``switch_mlp.{gate,up,down}_proj``, possibly quantized (their quantized rows
stack the same way, so gate and up join along the output rows as they are).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

import mlxrunner.nn as mnn
from mlxrunner.plugin import ConfigBound, ModelFolderError

from .model import Qwen3_5, Qwen3_5Config


@dataclass(frozen=True)
class Qwen3_5MoeConfig(Qwen3_5Config):
    """The dense fields plus the mixture of experts'."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Qwen3_5MoeConfig:
        required = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        fields = cls.fields(config, required=required)
        experts, per_token = int(config["num_experts"]), int(config["num_experts_per_tok"])
        if not 1 <= per_token <= experts:
            raise ModelFolderError(f"qwen3_5_moe needs 1 <= num_experts_per_tok ({per_token}) "
                                   f"<= num_experts ({experts})")
        if int(config["moe_intermediate_size"]) < 1:
            raise ModelFolderError("qwen3_5_moe needs moe_intermediate_size >= 1")
        only = config.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(type(i) is int for i in only):
            raise ModelFolderError(f"qwen3_5_moe mlp_only_layers must list layer indices, "
                                   f"got {str(only)[:80]}")
        moe = cls(**fields, num_experts=experts, num_experts_per_tok=per_token,
                  moe_intermediate_size=int(config["moe_intermediate_size"]),
                  shared_expert_intermediate_size=int(
                      config.get("shared_expert_intermediate_size") or 0),
                  norm_topk_prob=bool(config.get("norm_topk_prob", True)),
                  decoder_sparse_step=int(config.get("decoder_sparse_step") or 1),
                  mlp_only_layers=tuple(only))
        dense = [i for i in range(moe.num_hidden_layers) if not moe.is_sparse(i)]
        if dense and moe.intermediate_size <= 0:
            raise ModelFolderError(f"qwen3_5_moe layers {dense[:8]} are dense "
                                   "(mlp_only_layers / decoder_sparse_step) but config.json "
                                   "has no intermediate_size for them")
        return moe


class SparseMoeBlock(nn.Module):
    """Routed experts plus the sigmoid-gated shared expert (checkpoint names under ``mlp.``:
    ``gate``, ``experts``, ``shared_expert``, ``shared_expert_gate``)."""

    def __init__(self, cfg: Qwen3_5MoeConfig) -> None:
        super().__init__()
        self.gate = mnn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.top_k = cfg.num_experts_per_tok
        self.renormalise = cfg.norm_topk_prob
        self.experts = mnn.GatedExperts(cfg.num_experts, cfg.hidden_size,
                                        cfg.moe_intermediate_size, mnn.silu_mul)
        self.shared = cfg.shared_expert_intermediate_size > 0
        if self.shared:
            self.shared_expert = mnn.GatedMLP(cfg.hidden_size,
                                              cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = mnn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """The ``top_k`` experts of each token and their weights (float32)."""
        logits = self.gate(x).astype(mx.float32)
        k = self.top_k
        indices = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
        chosen = mx.take_along_axis(logits, indices, axis=-1)
        if self.renormalise:  # the softmax renormalised over k is the softmax of those k
            return indices, mx.softmax(chosen, axis=-1)
        return indices, mx.exp(chosen - mx.logsumexp(logits, axis=-1, keepdims=True))

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        indices, weights = self.route(x)
        out = mnn.residual_stream(residual) + self.experts(x, indices, weights)
        if self.shared:
            out = out + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


# layer prefix, then what follows "mlp." in each layout
_PER_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_SWITCH = re.compile(r"(.*\.mlp)\.switch_mlp\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_FUSED = re.compile(r"(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")


class Qwen3_5Moe(Qwen3_5):
    """Qwen3.5 mixture of experts (``Qwen3_5MoeForConditionalGeneration`` /
    ``Qwen3_5MoeForCausalLM``)."""

    config_type = Qwen3_5MoeConfig
    config_bounds = {
        **Qwen3_5.config_bounds,
        "decoder_sparse_step": ConfigBound(int, 1, 1024),
        "norm_topk_prob": ConfigBound(bool),
        "mlp_only_layers": ConfigBound(int, 0, 1023, per_layer=True),
    }
    config: Qwen3_5MoeConfig

    def layer_mlp(self, index: int) -> nn.Module | None:
        return SparseMoeBlock(self.config) if self.config.is_sparse(index) else None

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The dense model's renaming, then every expert layout packed into ours."""
        out: dict[str, mx.array] = {}
        per_expert: dict[tuple[str, str, str], dict[int, mx.array]] = {}
        switch: dict[tuple[str, str], dict[str, mx.array]] = {}
        for name, value in super().sanitize(weights).items():
            if m := _PER_EXPERT.match(name):
                prefix, expert, proj, part = m.groups()
                per_expert.setdefault((prefix, proj, part), {})[int(expert)] = value
            elif m := _SWITCH.match(name):
                prefix, proj, part = m.groups()
                switch.setdefault((prefix, part), {})[proj] = value
            elif _FUSED.match(name):
                out[f"{name}.weight"] = value
            else:
                out[name] = value
        experts = self.config.num_experts
        for (prefix, proj, part), by_index in per_expert.items():
            if sorted(by_index) != list(range(experts)):
                raise ValueError(f"{prefix}.experts.*.{proj}.{part}: found {len(by_index)} of "
                                 f"{experts} experts")
            switch.setdefault((prefix, part), {})[proj] = mx.stack(
                [by_index[e] for e in range(experts)])
        for (prefix, part), projs in switch.items():
            if set(projs) != {"gate_proj", "up_proj", "down_proj"}:
                raise ValueError(f"{prefix} experts' {part}: expected gate_proj, up_proj and "
                                 f"down_proj, got {sorted(projs)}")
            out[f"{prefix}.experts.gate_up_proj.{part}"] = mx.concatenate(
                [projs["gate_proj"], projs["up_proj"]], axis=-2)
            out[f"{prefix}.experts.down_proj.{part}"] = projs["down_proj"]
        return out
