"""DFlash: a block-diffusion draft conditioned on the target's tapped hidden states.

Context: the tapped states of every committed token, ``hidden_norm(fc(concat))``
(optionally RMS-normed per tap first). Every draft layer projects this same
context to keys and values (its own k_proj / v_proj, k_norm, RoPE at absolute
positions); context rows make no queries. A round runs one block
``[current, mask x (block_size - 1)]`` at positions ``pos ..``: embeddings from
the target times ``input_embedding_scale``, each layer attention over context +
block (bidirectional within the block unless causal) and a SwiGLU MLP, a final
norm, and the target's head (``raw_logits``) on block rows ``1 .. n``.

The core runs the rounds (``mlxrunner.plugin.BlockDraft``): it keeps the context keys and
values per layer, writes each round's block after them (overwritten by the next commit) and
traces the block and the commits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

import mlxrunner.nn as mnn
from mlxrunner.nn import Linear
from mlxrunner.plugin import (
    BlockDraft,
    BlockDraftSession,
    ContextCache,
    DraftConfigError,
    DraftProposal,
    Model,
    RowContext,
    TracedContext,
)

Store = ContextCache | TracedContext | RowContext


@dataclass(frozen=True)
class DFlashArgs:
    """A DFlash / DFlash2 config.json, parsed."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    layer_types: tuple[str, ...]
    sliding_window: int | None
    causal: bool
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None
    aux_hidden_norms: bool
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DFlashArgs:
        section = config.get("dflash_config") or {}

        def setting(key: str, default: Any = None) -> Any:
            value = section.get(key)
            if value is None:
                value = config.get(key)
            return default if value is None else value

        def required(key: str) -> Any:
            value = config.get(key)
            if value is None:
                raise DraftConfigError(f"draft config has no {key}")
            return value

        hidden = int(required("hidden_size"))
        layers = int(required("num_hidden_layers"))
        heads = int(required("num_attention_heads"))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        layer_types = tuple(config.get("layer_types") or ["full_attention"] * layers)
        if len(layer_types) != layers:
            raise DraftConfigError(f"draft config: {len(layer_types)} layer_types for "
                                   f"{layers} layers")
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise DraftConfigError(f"draft config: unsupported layer types {unknown}")
        window = config.get("sliding_window")
        if "sliding_attention" in layer_types and not window:
            raise DraftConfigError("draft config has sliding_attention layers but no "
                                   "sliding_window")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise DraftConfigError(f"draft config: rope_type {rope_type!r} is not supported "
                                   "(only default RoPE)")
        theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        causal = setting("causal")
        if causal is None:
            causal = config.get("is_causal")
        cap = setting("final_logit_softcapping")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(required("intermediate_size")),
            rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
            rope_theta=theta,
            layer_types=layer_types,
            sliding_window=int(window) if window else None,
            causal=bool(causal),
            input_embedding_scale=float(setting("input_embedding_scale", 1.0)),
            output_multiplier=float(setting("output_multiplier", 1.0)),
            final_logit_softcapping=float(cap) if cap else None,
            aux_hidden_norms=bool(setting("aux_hidden_norms", False)),
            conv_kernel_size=int(setting("conv_kernel_size", 0)),
            conv_group_size=int(setting("conv_group_size", 0)),
            selector_rank=int(setting("selector_rank", 0)),
            selector_top_k=int(setting("selector_top_k", 0)),
        )


class DraftAttention(nn.Module):
    def __init__(self, args: DFlashArgs, sliding: bool) -> None:
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim ** -0.5
        self.window = args.sliding_window if sliding else None
        self.causal = args.causal
        h, d = args.hidden_size, args.head_dim
        self.q_proj = Linear(h, self.n_heads * d, bias=False)
        self.k_proj = Linear(h, self.n_kv_heads * d, bias=False)
        self.v_proj = Linear(h, self.n_kv_heads * d, bias=False)
        self.o_proj = Linear(self.n_heads * d, h, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.rope = nn.RoPE(d, traditional=False, base=args.rope_theta)

    def _keys_values(self, x: mx.array, position: int | mx.array) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        # nn.RoPE annotates offset as int; it hands it to mx.fast.rope, which takes an array too
        k = self.rope(k.transpose(0, 2, 1, 3), offset=position)  # type: ignore[arg-type]
        return k, v.transpose(0, 2, 1, 3)

    def context_kv(self, context: mx.array, position: int | mx.array
                   ) -> tuple[mx.array, mx.array]:
        """Keys/values of context rows starting at absolute ``position`` (one per row: [B])."""
        return self._keys_values(context, position)

    def __call__(self, x: mx.array, pos: int | mx.array, store: Store
                 ) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim))
        # (nn.RoPE's offset: see _keys_values)
        q = self.rope(q.transpose(0, 2, 1, 3), offset=pos)  # type: ignore[arg-type]
        k, v = self._keys_values(x, pos)
        if isinstance(store, ContextCache):  # an eager round, at an int position
            mask = store.block_mask(cast(int, pos), L, self.causal)
        else:  # a traced round: positions are arrays
            mask = store.block_mask(cast(mx.array, pos), L, self.causal)
        keys, values = store.with_block(k, v)
        out = mnn.attend(q, keys, values, mask, scale=self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, args: DFlashArgs, index: int) -> None:
        super().__init__()
        self.self_attn = DraftAttention(args, args.layer_types[index] == "sliding_attention")
        self.mlp = SwiGLU(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, h: mx.array, pos: int | mx.array, store: Store
                 ) -> mx.array:
        h = h + self.self_attn(self.input_layernorm(h), pos, store)
        return h + self.mlp(self.post_attention_layernorm(h))


def softcap(x: mx.array, cap: float | None) -> mx.array:
    return x if not cap else cap * mx.tanh(x / cap)


class DFlashDraftModel(BlockDraft):
    """The DFlash block draft. Borrows the target's embedding and head; drafts with a
    depth chosen per round (``adaptive_depth``)."""

    adaptive_depth = True
    layer_class: type[DFlashLayer] = DFlashLayer

    def __init__(self, config: dict[str, Any], target: Model) -> None:
        super().__init__(config, target)
        args = DFlashArgs.from_config(config)
        self.args = args
        n_taps = len(self.taps)
        target_hidden = target.hidden_size
        if args.aux_hidden_norms:
            self.aux_hidden_norms = [nn.RMSNorm(target_hidden, eps=args.rms_norm_eps)
                                     for _ in range(n_taps)]
        self.fc = Linear(n_taps * target_hidden, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [self.layer_class(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # Own embedding / head live under the checkpoint's names as dict entries (the
        # methods embed_tokens / raw_logits of the base class look them up).
        if self.own_embedding:
            self["embed_tokens"] = nn.Embedding(target.vocab_size, args.hidden_size)
        if self.own_head:
            self["lm_head"] = Linear(args.hidden_size, target.vocab_size, bias=False)

    @classmethod
    def setting(cls, config: Mapping[str, Any], key: str, default: Any = None) -> Any:
        """DFlash keeps its block settings in ``dflash_config``, the top level as a fallback."""
        section = config.get("dflash_config")
        if isinstance(section, Mapping) and section.get(key) is not None:
            return section[key]
        return super().setting(config, key, default)

    @classmethod
    def config_for_checkpoint(cls, config: dict[str, Any], tensor_names: Any) -> dict[str, Any]:
        names = set(tensor_names)
        config = super().config_for_checkpoint(config, names)
        section = dict(config.get("dflash_config") or {})
        if "aux_hidden_norms" not in section and "aux_hidden_norms" not in config:
            section["aux_hidden_norms"] = any(n.startswith("aux_hidden_norms.") for n in names)
            config["dflash_config"] = section
        return config

    def validate(self, target: Model) -> None:
        super().validate(target)
        args = self.args
        if args.num_attention_heads % args.num_key_value_heads:
            raise DraftConfigError(f"{type(self).__name__}: {args.num_attention_heads} heads "
                                   f"are not a multiple of {args.num_key_value_heads} KV heads")

    # -- the computation -----------------------------------------------------------
    @property
    def compute_dtype(self) -> mx.Dtype:
        """The dtype activations run in: the norms' (never quantized, unlike projections)."""
        return self.hidden_norm.weight.dtype

    def context(self, tapped: mx.array) -> mx.array:
        """Tapped target states [B, M, taps * hidden] -> context rows [B, M, hidden]."""
        dtype = self.compute_dtype
        if getattr(self, "aux_hidden_norms", None):
            parts = mx.split(tapped, len(self.taps), axis=-1)
            tapped = mx.concatenate([norm(p) for norm, p in zip(self.aux_hidden_norms, parts)],
                                    axis=-1)
        return self.hidden_norm(self.fc(tapped.astype(dtype)))

    def block_hidden(self, ids: mx.array, pos: int | mx.array,
                     stores: Sequence[Store]) -> mx.array:
        """Final-normed hidden states of blocks ``ids`` [B, L] at positions ``pos ..``."""
        h = self.embed_tokens(ids)
        if self.args.input_embedding_scale != 1.0:
            h = h * self.args.input_embedding_scale
        h = h.astype(self.compute_dtype)
        for layer, store in zip(self.layers, stores):
            h = layer(h, pos, store)
        return self.norm(h)

    def proposal_logits(self, hidden: mx.array) -> mx.array:
        """The draft's logits: the head, times output_multiplier, softcapped if configured."""
        logits = self.raw_logits(hidden).astype(mx.float32)
        return self.scale_logits(logits)

    def scale_logits(self, logits: mx.array) -> mx.array:
        if self.args.output_multiplier != 1.0:
            logits = logits * self.args.output_multiplier
        return softcap(logits, self.args.final_logit_softcapping)

    # -- rounds: the block and its proposals --------------------------------------------
    def block_rows(self, anchor: mx.array, pos: int | mx.array, n: int,
                   stores: Sequence[Store]) -> mx.array:
        """Block rows 1..n of the blocks anchored at ``anchor`` [B], final-normed:
        [B, n, hidden]. The full trained block always runs (in-block attention is
        bidirectional); only the first n rows are proposals."""
        rows = anchor.shape[0]
        masks = mnn.constant((self.mask_token_id,) * (self.block_size - 1), mx.int32)
        ids = mx.concatenate([anchor.astype(mx.int32)[:, None],
                              mx.broadcast_to(masks[None], (rows, self.block_size - 1))], axis=1)
        return self.block_hidden(ids, pos, stores)[:, 1:1 + n]

    def greedy_tokens(self, hidden: mx.array, anchor: mx.array) -> mx.array:
        """Temperature 0: the proposed tokens [B, n] from block rows ``hidden``
        [B, n, hidden] (pure array code: it runs inside the traced block)."""
        return mx.argmax(self.proposal_logits(hidden), axis=-1).astype(mx.int32)

    def sampled(self, session: BlockDraftSession, hidden: mx.array, anchor: mx.array
                ) -> DraftProposal:
        """Temperature > 0: one sequence's block rows ``hidden`` [1, n, hidden], drawn from
        the request's stream (outside any trace)."""
        logits = self.proposal_logits(hidden[0])
        probs = mx.softmax(logits / session.temperature, axis=-1, precise=True)
        return DraftProposal(session.draw(probs), probs)
