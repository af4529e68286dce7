"""Supervised warm start: the tiny model taught, by SFT on synthetic traces, to *sometimes* use the calculator.

RL on the calculator task needs a policy that already emits well-formed tool calls some of the time and
gets some answers right, and that has room to improve. The base tiny model (`modelzoo`) is random noise,
so this module writes tool-use conversations, fine-tunes the base model on them (CPU or GPU), and caches
the result as a full HF model directory that SGLang and transformers load like the base one.

Map (modules of this package):
    spec.py      WarmStartSpec, DEFAULT_SPEC, CODE_VERSION, SHIPPED_DIR, the Trace / ToolUseStats records
    traces.py    build_traces, encode_conversation, calculator_schemas, estimate_answer
    sft.py       train_sft
    build.py     ensure_warm_model, warm_model_dir_for, shipped_artefact (cache + shipped install)
    evaluate.py  evaluate_tool_use
    renderings.py how real harnesses render the task (tools, system prompt): WarmStartSpec(renderings="varied")

Names:
    WarmStartSpec        every knob of the build; its hash (with the base dir name and CODE_VERSION)
                         names the cache directory
    ensure_warm_model    cached build (file lock + temp dir + atomic rename), returns the model dir
    build_traces         the synthetic conversations, tokenized as tool_agent_loop tokenizes episodes
    encode_conversation  one conversation -> (ids, mask): mask 1 on the assistant's tokens only
    train_sft            plain-torch SFT (AdamW, assistant-only loss, shared-prefix batches)
    evaluate_tool_use    transformers generation on the `calculator` eval set, with the real tool:
                         tool-call rate and answer accuracy (greedy or sampled)

Calls go one way: ensure_warm_model -> build_traces -> encode_conversation, then train_sft.
evaluate_tool_use is separate (measurement only) and shares `_forward_shared_prefix` with train_sft.

The traces. Each is the eval prompt's exact shape (CALCULATOR_SYSTEM, the calculator tool offered
through the chat template's `tools=` list, the user question) and then one of:
    tool   assistant `<tool_call>{"name": "calculator", "arguments": {"expression": E}}</tool_call>`,
           the tool message holding the real calculator's output, assistant `#### <result>`
    direct assistant `#### <estimate>`, where the estimate rounds the two-digit operands to tens before
           computing (37 * 24 + 5 -> 40 * 20 + 5 = 805): plausible, and right only by luck
The default mix is 50/50 (`tool_fraction`). With half the traces calling the tool, the first token of
the answer is a coin flip between `<tool_call>` and `####` at temperature 1, so sampled episodes show
both behaviours; the direct branch earns ~0 reward and the tool branch earns reward when the copy of
the expression and of the result is right. RL can therefore raise both the tool-call rate and the
accuracy (and greedy decoding picks one branch per prompt, so it is not saturated either).

Tokenization matches tool_agent_loop token for token: the prompt is the template rendered with
`add_generation_prompt`, each assistant turn is its content's tokens plus the end-of-turn token (what
the model emits), and the text between turns is the template's text difference (the rest of the
turn suffix, the tool message, the next header), tokenized on its own.

Seeds. Problems come from the same generator as the `calculator` (seed 3) and `calculator_train`
(seed 12345) sets, with the spec's own seed. `_Lcg` streams of different seeds are shifted views of one
cycle, so a different seed alone does not guarantee disjoint problems: expressions of both sets are
excluded explicitly.

Determinism: the same spec, base model and CODE_VERSION give the same weights on one machine and
library stack (torch seeded, fixed thread count, deterministic algorithms on during the build).

Measured (64 `calculator` eval prompts, transformers generation, the real tool; SFT run on an H200 with
train_sft, the same code as the CPU path):
    the defaults (lr 1e-3, batch 64, 3000 steps), ensure_warm_model with device="cuda" (95 s), bf16
    output evaluated on the CPU: T=1 tool calls 50%, accuracy 34% (69% when it calls);
    greedy tool calls 94%, accuracy 77%
    lr 1e-3 or 5e-4, up to 1000 x 16 or 500 x 32: calls 45-53% at T=1, well-formed, but the expression
                                                  is not copied from the question: accuracy 0
    lr 3e-3 (even 3000 x 32) or 1e-2:            never learns to copy; accuracy 0
Copying (an induction mechanism) appears only after far more than 16k conversations, so the defaults
do not fit a few CPU minutes: on 2 shared cores a 16 x 60-token step took 1.5-7 s, i.e. the defaults
would need hours on the CPU. So the reference recipe (`DEFAULT_SPEC`, device="cuda") is built on a GPU by
`benchmarks/gpu_build_warm.sh` and its weights ship in the package (`assets/warm_calculator/`, 7.4 MB,
with a manifest of checksums, the tokenizer's hash and the GPU's eval). `ensure_warm_model()` installs
them into the cache when the spec's digest and the base model match; any other spec is trained here.
The shipped build (H100, 101 s; 128 eval prompts): T=1 tool calls 50%, accuracy 50% (100% when it
calls); greedy tool calls 75%, accuracy 75%. CUDA SFT is not bitwise deterministic, so a rebuild gives
other weights of the same quality.

Simplifications: the trainer runs one process without FSDP or gradient accumulation; traces whose
token count exceeds `max_len` are dropped, not cut; the prompt prefix that all traces share (system
message and tool list) is run once per step with batch 1 and its KV cache repeated across the batch.
"""

from agentloop.models.warmstart.build import (
    ensure_warm_model,
    shipped_artefact,
    warm_model_dir_for,
)
from agentloop.models.warmstart.evaluate import evaluate_tool_use
from agentloop.models.warmstart.sft import train_sft
from agentloop.models.warmstart.spec import (
    CODE_VERSION,
    DEFAULT_SPEC,
    SHIPPED_DIR,
    ToolUseStats,
    Trace,
    WarmStartSpec,
)
from agentloop.models.warmstart.traces import (
    build_traces,
    calculator_schemas,
    encode_conversation,
    estimate_answer,
)

__all__ = [
    "CODE_VERSION",
    "DEFAULT_SPEC",
    "SHIPPED_DIR",
    "ToolUseStats",
    "Trace",
    "WarmStartSpec",
    "build_traces",
    "calculator_schemas",
    "encode_conversation",
    "ensure_warm_model",
    "estimate_answer",
    "evaluate_tool_use",
    "shipped_artefact",
    "train_sft",
    "warm_model_dir_for",
]
