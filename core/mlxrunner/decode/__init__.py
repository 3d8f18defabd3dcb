"""Decoding: sampler options, the sampler pipeline, top-k, grammars, the prefill and the
speculative round's decision (the steps themselves are :class:`mlxrunner.batch.Scheduler`'s).

Names resolve lazily (``options`` is plain Python: the CLI builds its flags from it without
importing MLX).
"""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    # options (plain Python)
    "OPTION_HELP": "options",
    "SamplerOptionError": "options",
    "SamplerOptions": "options",
    # the sampler and top-k
    "Sampler": "sampler",
    "topk_indices": "topk",
    "prepare_topk_indices": "topk",
    "kernel_launch": "topk",
    "kernel_status": "topk",
    "check_rows": "topk",
    "CHUNK": "topk",
    "KERNEL_MIN_BLOCKS": "topk",
    # plain decoding
    "GenerationResult": "plain",
    "GenerationStats": "plain",
    "PREFILL_CHUNK": "plain",
    "logprob_entry": "plain",
    "prefill": "plain",
    # speculative decoding
    "DepthController": "speculative",
    "RoundDecision": "speculative",
    "SpeculativeStats": "speculative",
    "can_speculate": "speculative",
    "decide": "speculative",
    "penalties_active": "sampler",
    # structured output (a grammar's token mask)
    "Constraint": "grammar",
    "Format": "grammar",
    "Grammar": "grammar",
    "GrammarError": "grammar",
    "MAX_WHITESPACE": "grammar",
    "allowed_rows": "grammar",
    "compile_format": "grammar",
    "constrain_proposal": "speculative",
    # the compiled step
    "forward": "step",
    "compiled_steps": "step",
    "CompiledSteps": "step",
    "agree": "step",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
