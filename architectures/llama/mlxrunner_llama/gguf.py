"""Reading llama.cpp's GGUF files of the Llama family (``general.architecture`` llama).

Hyperparameters come from the ``llama.*`` metadata keys; tensors are renamed from
llama.cpp's names (``blk.N.attn_q``) to transformers' (``model.layers.N.self_attn.q_proj``).
llama.cpp's converter reorders the rows of the query and key projections so that each head's
rotary pairs sit side by side (interleaved RoPE); the inverse order is restored here, which
gives back transformers' rotate-half layout the model computes with. The row order of a
quantized tensor moves with its scales and biases, so quantized files stay quantized.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

#: llama.cpp tensor name (within ``blk.N.``) -> transformers module name (within layer N)
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}


def _number(metadata: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value = metadata.get(key, default)
    if value is None:
        raise ValueError(f"metadata {key} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"metadata {key} is {value!r:.60}, not a number")
    return kind(value)


def gguf_config(metadata: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    """The transformers ``LlamaConfig`` a file's metadata describes."""
    p = "llama."
    if metadata.get(p + "expert_count"):
        raise ValueError("mixture-of-experts llama files are not supported")
    if "rope_freqs.weight" in tensors:
        raise ValueError("per-frequency RoPE factors (rope_freqs, Llama 3.1 and later) are "
                         "not supported; run the model's safetensors folder")
    heads = _number(metadata, p + "attention.head_count", int)
    hidden = _number(metadata, p + "embedding_length", int)
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = _number(metadata, p + "vocab_size", int,
                    len(tokens) if isinstance(tokens, list) else None)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": _number(metadata, p + "feed_forward_length", int),
        "num_hidden_layers": _number(metadata, p + "block_count", int),
        "num_attention_heads": heads,
        "num_key_value_heads": _number(metadata, p + "attention.head_count_kv", int, heads),
        "rms_norm_eps": _number(metadata, p + "attention.layer_norm_rms_epsilon", float),
        "rope_theta": _number(metadata, p + "rope.freq_base", float, 10000.0),
        "max_position_embeddings": _number(metadata, p + "context_length", int, 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
    }
    head_dim = metadata.get(p + "attention.key_length")
    if head_dim is not None:
        config["head_dim"] = _number(metadata, p + "attention.key_length", int)
    rotary = metadata.get(p + "rope.dimension_count")
    if rotary is not None and rotary != config.get("head_dim", hidden // max(heads, 1)):
        raise ValueError(f"partial rotary embeddings ({p}rope.dimension_count {rotary!r:.20}) "
                         "are not supported")
    scaling = metadata.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"RoPE scaling {scaling!r:.40} is not supported (linear is)")
        config["rope_scaling"] = {"rope_type": "linear",
                                  "factor": _number(metadata, p + "rope.scaling.factor", float)}
    for role in ("bos", "eos"):
        token_id = metadata.get(f"tokenizer.ggml.{role}_token_id")
        if isinstance(token_id, int):
            config[f"{role}_token_id"] = token_id
    return config


def _rotate_half_rows(w: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's row order: per head, rows (pair i, half h) were stored at 2 i + h."""
    rows = w.shape[0]
    if heads <= 0 or rows % (2 * heads):
        raise ValueError(f"a projection of {rows} rows does not split into {heads} heads")
    rest = w.shape[1:]
    return (w.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2)
            .reshape(rows, *rest))


def gguf_weights(config: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """A file's tensors under transformers' names, in transformers' row order."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out: dict[str, mx.array] = {}
    for name, value in tensors.items():
        base, _, part = name.rpartition(".")
        if base.startswith("blk."):
            _, index, short = base.split(".", 2)
            if not index.isdigit() or short not in LAYER_NAMES:
                raise ValueError(f"unexpected tensor {name!r:.80}")
            if short in heads:
                value = _rotate_half_rows(value, heads[short])
            out[f"model.layers.{index}.{LAYER_NAMES[short]}.{part}"] = value
        elif base in TOP_NAMES:
            out[f"{TOP_NAMES[base]}.{part}"] = value
        else:
            raise ValueError(f"unexpected tensor {name!r:.80}")
    return out


def from_gguf(metadata: dict[str, Any], tensors: dict[str, mx.array]
              ) -> tuple[dict[str, Any], dict[str, mx.array]]:
    config = gguf_config(metadata, tensors)
    return config, gguf_weights(config, tensors)
