"""Supervised warm start: the tiny model taught, by SFT on synthetic traces, to *sometimes* use the calculator.

RL on the calculator task needs a policy that already emits well-formed tool calls some of the time and
gets some answers right, and that has room to improve. The base tiny model (`modelzoo`) is random noise,
so this module writes tool-use conversations, fine-tunes the base model on them (CPU or GPU), and caches
the result as a full HF model directory that SGLang and transformers load like the base one.

Map:
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

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentloop.cache import build_once
from agentloop.data.builtin import _Lcg
from agentloop.data.tasks import CALCULATOR_SOURCE, CALCULATOR_SYSTEM, CalcProblem, calculator_problem, calculator_rows
from agentloop.modelzoo import default_cache_dir, ensure_tiny_model, load_tokenizer

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

logger = logging.getLogger(__name__)

CODE_VERSION = "1"
"""Bumped whenever the build code changes its output for an unchanged spec."""

EVAL_SEED = 3
"""Seed of the `calculator` eval set (excluded from the traces)."""
TRAIN_SEED, TRAIN_ROWS = 12345, 4096
"""Seed and size of the `calculator_train` RL set (excluded from the traces)."""
SHIPPED_DIR = Path(__file__).parent / "assets" / "warm_calculator"
"""A warm model built from `DEFAULT_SPEC` on a GPU by `benchmarks/gpu_build_warm.sh`, with its manifest."""
_COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


class WarmStartSpec(BaseModel):
    """Everything that determines the warm model's weights; its hash names the cache entry."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    n_traces: int = Field(default=16384, ge=8)
    """Synthetic conversations generated (each seen about steps * batch_size / n_traces times)."""
    tool_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """Share of traces that call the calculator; the rest answer directly with a rough estimate."""
    steps: int = Field(default=3000, ge=1)
    """Optimizer steps (copying the expression emerged between ~16k and 192k conversations seen)."""
    batch_size: int = Field(default=64, ge=1)
    """Conversations per step."""
    lr: float = Field(default=1e-3, gt=0)
    """Peak AdamW learning rate (linear warm-up, then cosine decay to `min_lr_ratio` of it)."""
    warmup_steps: int = Field(default=100, ge=0)
    """Steps of linear learning-rate warm-up."""
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    """Final learning rate as a fraction of `lr`."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Global gradient-norm clip."""
    max_len: int = Field(default=512, ge=16)
    """Traces longer than this many tokens are dropped."""
    num_threads: int = Field(default=2, ge=1)
    """torch CPU threads during the build (part of the spec: float sums depend on the thread split)."""
    device: str = "cpu"
    """torch device of the SFT ("cuda" is ~100x faster; part of the hash since numerics differ)."""
    seed: int = 20240607
    """Seed of the problems, the tool/direct split, the batch order and torch."""

    def digest(self, base_name: str) -> str:
        """Short hash of the spec, the base model's directory name and CODE_VERSION (the cache key)."""
        payload = json.dumps({"code": CODE_VERSION, "base": base_name, "spec": self.model_dump(mode="json")},
                             sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


DEFAULT_SPEC = WarmStartSpec(device="cuda")
"""The reference recipe: ~100 s on one GPU. Its result ships in the package (`SHIPPED_DIR`), since
the same SFT needs hours on 2 CPU cores; `ensure_warm_model()` installs it instead of training."""


class Trace(BaseModel):
    """One synthetic conversation and its tokens."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    messages: list[dict[str, Any]]
    """The chat messages (system, user, assistant, [tool, assistant])."""
    uses_tool: bool
    """True for a calculator trace, False for a direct (estimated) answer."""
    answer: int
    """The problem's exact answer."""
    ids: list[int]
    """Token ids of the whole conversation, tokenized as tool_agent_loop does."""
    mask: list[int]
    """1 where the token is the assistant's (trained on), 0 for system/user/tool/template tokens."""


class ToolUseStats(BaseModel):
    """What `evaluate_tool_use` measured."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    n: int
    """Episodes evaluated."""
    temperature: float
    """Sampling temperature (0 = greedy)."""
    tool_call_rate: float
    """Share of first turns holding a well-formed calculator call (parses, schema-valid arguments)."""
    attempted_call_rate: float
    """Share of first turns holding any <tool_call> block, well-formed or not."""
    right_expression_rate: float
    """Share of episodes whose first call's calculator result equals the true answer."""
    accuracy: float
    """Mean reward of the final assistant message (GSM8K `#### n`, the task's reward)."""
    accuracy_with_tool: float
    """Accuracy among episodes with a well-formed call (0 when there are none)."""
    accuracy_without_tool: float
    """Accuracy among episodes without a well-formed call (0 when there are none)."""
    examples: list[str] = Field(default_factory=list)
    """The first few episodes' response texts, for eyeballing."""


# ---------------------------------------------------------------- traces


def calculator_schemas() -> list[dict[str, Any]]:
    """The `tools=` list tool_agent_loop gives the template for calculator rows."""
    from agentloop.tools.registry import get_tool

    return [get_tool("calculator")().schema]


def estimate_answer(problem: CalcProblem) -> int:
    """A rough mental estimate: two-digit operands rounded to tens, one-digit ones kept, then computed."""
    from agentloop.tools.calculator import calculate

    def round10(m: re.Match[str]) -> str:
        v = int(m.group(0))
        return str(v if v < 10 else int(math.floor(v / 10 + 0.5)) * 10)

    return int(calculate(re.sub(r"\d+", round10, problem.expression)))


def _calculator_output(expressions: list[str]) -> list[str]:
    """The real calculator tool's message text for each expression."""
    from agentloop.tools.registry import get_tool

    tool = get_tool("calculator")()

    async def run() -> list[str]:
        inst = await tool.create(None)  # type: ignore[arg-type] - the calculator keeps no episode state
        try:
            return [(await tool.execute(inst, {"expression": e})).text for e in expressions]
        finally:
            await tool.release(inst)

    return asyncio.run(run())


def _tool_call_text(expression: str) -> str:
    """The hermes call exactly as the chat template writes an assistant's `tool_calls`."""
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
        "\n</tool_call>"


class _Renderer:
    """The template and its turn suffix, as tool_agent_loop sees them."""

    def __init__(self, tokenizer: Any, schemas: list[dict[str, Any]] | None):
        from agentloop.loops.tool_agent import template_info

        self.tok = tokenizer
        self.schemas = schemas
        self.eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        self.suffix = template_info(self.render).turn_suffix
        if not self.suffix.startswith(tokenizer.eos_token):
            raise ValueError(f"turn suffix {self.suffix!r} does not start with the EOS token {tokenizer.eos_token!r}")

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None, gen: bool) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": gen}
        if tools:
            kwargs["tools"] = tools
        return self.tok.apply_chat_template(messages, **kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def env_ids(self, history: list[dict[str, Any]], tool_msgs: list[dict[str, Any]], end_text: str) -> list[int]:
        """Tokens between an assistant turn and the next one (tool_agent_loop's `_env_ids`)."""
        a = self.render(history, self.schemas, False)
        b = self.render(history + tool_msgs, self.schemas, True)
        if not b.startswith(a):
            raise ValueError("the chat template is not append-only for tool turns")
        return self.encode(self.suffix[len(end_text):] + b[len(a):])


def encode_conversation(tokenizer: Any, messages: list[dict[str, Any]],
                        schemas: list[dict[str, Any]] | None) -> tuple[list[int], list[int]]:
    """(ids, mask) of a conversation that starts with system/user messages, tokenized turn by turn.

    Every assistant message becomes its content's tokens plus the EOS token with mask 1; everything
    else (prompt, tool messages, headers) has mask 0. The ids end with the last assistant's EOS.
    """
    r = _Renderer(tokenizer, schemas)
    return _encode(r, messages)


def _encode(r: _Renderer, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    history = [dict(m) for m in messages[:first]]
    ids = r.encode(r.render(history, r.schemas, True))
    mask = [0] * len(ids)
    i = first
    while i < len(messages):
        msg = messages[i]
        if msg["role"] != "assistant":
            raise ValueError(f"message {i} should be the assistant's, got role {msg['role']!r}")
        seg = r.encode(msg["content"]) + [r.eos_id]
        ids += seg
        mask += [1] * len(seg)
        history.append(dict(msg))
        i += 1
        tool_msgs = []
        while i < len(messages) and messages[i]["role"] == "tool":
            tool_msgs.append(dict(messages[i]))
            i += 1
        if tool_msgs:
            env = r.env_ids(history, tool_msgs, r.tok.eos_token)
            ids += env
            mask += [0] * len(env)
            history += tool_msgs
        elif i < len(messages):
            raise ValueError(f"message {i} ({messages[i]['role']!r}) follows an assistant turn; only tool "
                             "messages may")
    return ids, mask


def _excluded_expressions() -> set[str]:
    """Expressions of the `calculator` eval set and the `calculator_train` RL set."""
    out: set[str] = set()
    for seed, n in ((EVAL_SEED, 64), (TRAIN_SEED, TRAIN_ROWS)):
        rng = _Lcg(seed)
        out.update(calculator_problem(rng).expression for _ in range(n))
    return out


def build_traces(tokenizer: Any, spec: WarmStartSpec) -> list[Trace]:
    """`spec.n_traces` conversations (minus any over `max_len`), a `tool_fraction` share calling the tool."""
    excluded = _excluded_expressions()
    rng = _Lcg(spec.seed)
    problems: list[CalcProblem] = []
    seen: set[str] = set()
    while len(problems) < spec.n_traces:
        p = calculator_problem(rng)
        if p.expression not in excluded and p.expression not in seen:
            seen.add(p.expression)
            problems.append(p)
    n_tool = round(spec.n_traces * spec.tool_fraction)
    kinds = [True] * n_tool + [False] * (spec.n_traces - n_tool)
    random.Random(spec.seed).shuffle(kinds)
    outputs = iter(_calculator_output([p.expression for p, k in zip(problems, kinds) if k]))
    r = _Renderer(tokenizer, calculator_schemas())
    traces = []
    for p, uses_tool in zip(problems, kinds):
        messages: list[dict[str, Any]] = [{"role": "system", "content": CALCULATOR_SYSTEM},
                                          {"role": "user", "content": p.question}]
        if uses_tool:
            result = next(outputs)
            messages += [{"role": "assistant", "content": _tool_call_text(p.expression)},
                         {"role": "tool", "name": "calculator", "content": result},
                         {"role": "assistant", "content": f"#### {result}"}]
        else:
            messages.append({"role": "assistant", "content": f"#### {estimate_answer(p)}"})
        ids, mask = _encode(r, messages)
        if len(ids) <= spec.max_len:
            traces.append(Trace(messages=messages, uses_tool=uses_tool, answer=p.answer, ids=ids, mask=mask))
    if not traces:
        raise ValueError(f"every trace is longer than max_len={spec.max_len}")
    return traces


# ---------------------------------------------------------------- training


def _common_prefix_len(rows: list[list[int]]) -> int:
    n = min(len(r) for r in rows)
    first = rows[0]
    for i in range(n):
        t = first[i]
        if any(r[i] != t for r in rows):
            return i
    return n


def _forward_shared_prefix(model: Any, prefix: Any, suffix: Any, **kwargs: Any) -> tuple[Any, Any]:
    """(hidden states, KV cache) of `suffix` (B, S) continuing the one shared `prefix` (P,), run once.

    The prefix runs without autograd (its keys and values are constants of the step: the loss lies on
    assistant tokens after it, and skipping its backward saves about a quarter of a step); its KV cache
    is repeated across the batch. Extra kwargs (attention_mask over P + S, position_ids) go to the
    suffix's forward.
    """
    import torch

    with torch.no_grad():
        pre = model.model(input_ids=prefix[None], use_cache=True)
    cache = pre.past_key_values
    cache.batch_repeat_interleave(suffix.shape[0])
    out = model.model(input_ids=suffix, past_key_values=cache, use_cache=True, **kwargs)
    return out.last_hidden_state, out.past_key_values


def _lr_at(step: int, spec: WarmStartSpec) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    span = max(1, spec.steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / span)
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_sft(model: Any, traces: list[Trace], spec: WarmStartSpec, pad_id: int) -> list[float]:
    """Fine-tune `model` (float32, in place) on `traces`; returns the loss of every step.

    Loss: mean next-token cross-entropy over the assistant tokens of the batch (mask 1 targets).
    Batches: `batch_size` traces in a seeded shuffled order, epoch after epoch; the prefix common to
    all traces is run once per step, the rest right-padded (causal attention never sees the padding of
    a row before its last real token, and padded targets carry no loss). The logits are computed only
    at the positions that have a target.
    """
    import torch
    import torch.nn.functional as F

    P = _common_prefix_len([t.ids for t in traces])
    if any(1 in t.mask[:P + 1] for t in traces):
        raise ValueError("an assistant token lies in the prefix shared by all traces")
    dev = next(model.parameters()).device
    prefix = torch.tensor(traces[0].ids[:P], device=dev)
    order_rng = random.Random(spec.seed + 1)
    order: list[int] = []
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=spec.weight_decay)
    losses: list[float] = []
    t0 = time.monotonic()
    for step in range(spec.steps):
        while len(order) < spec.batch_size:
            epoch = list(range(len(traces)))
            order_rng.shuffle(epoch)
            order += epoch
        batch = [traces[i] for i in order[:spec.batch_size]]
        del order[:spec.batch_size]
        S = max(len(t.ids) for t in batch) - P
        ids = torch.full((len(batch), S), pad_id, dtype=torch.long)
        tmask = torch.zeros((len(batch), S), dtype=torch.bool)
        for b, t in enumerate(batch):
            ids[b, :len(t.ids) - P] = torch.tensor(t.ids[P:])
            tmask[b, :len(t.ids) - P] = torch.tensor(t.mask[P:], dtype=torch.bool)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, spec)
        ids, tmask = ids.to(dev), tmask.to(dev)
        hidden, _ = _forward_shared_prefix(model, prefix, ids)
        sel = tmask[:, 1:]  # position j predicts token j + 1
        logits = model.lm_head(hidden[:, :-1][sel]).float()
        loss = F.cross_entropy(logits, ids[:, 1:][sel])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        if step % 20 == 0 or step == spec.steps - 1:
            logger.info("warm start step %d/%d loss %.4f lr %.2e (%.1fs)", step + 1, spec.steps, losses[-1],
                        _lr_at(step, spec), time.monotonic() - t0)
    model.eval()
    return losses


# ---------------------------------------------------------------- the cached build


def warm_model_dir_for(spec: WarmStartSpec, base_dir: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where `ensure_warm_model` puts (or finds) the model of `spec` trained from `base_dir`."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "models" / f"warm-{spec.digest(Path(base_dir).name)}"


def ensure_warm_model(cache_dir: str | Path | None = None, spec: WarmStartSpec | None = None, *,
                      base_dir: str | Path | None = None) -> Path:
    """The warm-started model's directory (weights, config, tokenizer), building it on first use.

    `base_dir` defaults to the project's tiny model (`ensure_tiny_model(cache_dir)`). Safe across
    processes: an fcntl lock serialises builders, the build happens in a temp dir next to the target
    and is renamed into place, so a reader sees either nothing or a complete directory.
    """
    spec = spec or DEFAULT_SPEC
    base = Path(base_dir) if base_dir is not None else ensure_tiny_model(cache_dir)
    target = warm_model_dir_for(spec, base, cache_dir)
    shipped = shipped_artefact()
    if shipped is not None and shipped["digest"] == target.name and shipped["base_model"] == base.name:
        return build_once(target, lambda tmp: _install_shipped(shipped, base, tmp))
    if spec.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"warm start {target.name}: its spec trains on {spec.device!r} but no GPU is "
                               "visible and no shipped artefact matches; pass a spec with device='cpu' "
                               "(hours on 2 cores) or build it on a GPU (benchmarks/gpu_build_warm.sh)")
    return build_once(target, lambda tmp: _build(spec, base, tmp))


def shipped_artefact() -> dict[str, Any] | None:
    """The manifest of the warm model shipped in the package (None when the package has none)."""
    manifest = SHIPPED_DIR / "artefact.json"
    return json.loads(manifest.read_text()) if manifest.is_file() else None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _install_shipped(manifest: dict[str, Any], base: Path, out: Path) -> None:
    """Copy the shipped weights next to the locally built tokenizer, checking every checksum.

    The tokenizer is rebuilt locally (modelzoo), not shipped; its hash must equal the one the weights
    were trained with, or the ids would mean different strings and the model would emit noise.
    """
    tok_sha = _sha256(base / "tokenizer.json")
    if tok_sha != manifest["tokenizer_sha256"]:
        raise RuntimeError(f"shipped warm model {manifest['digest']}: the local tokenizer {base / 'tokenizer.json'} "
                           f"hashes to {tok_sha[:12]}, the weights were trained with "
                           f"{manifest['tokenizer_sha256'][:12]}; rebuild the warm start on a GPU")
    for name, sha in manifest["files"].items():
        src = SHIPPED_DIR / name
        if not src.is_file() or _sha256(src) != sha:
            raise RuntimeError(f"shipped warm model {manifest['digest']}: {src} is missing or corrupt "
                               f"(expected sha256 {sha[:12]})")
        shutil.copyfile(src, out / name)
    for name in _COPIED_FILES:
        if (base / name).is_file() and not (out / name).exists():
            shutil.copyfile(base / name, out / name)
    logger.info("warm start %s installed from the package (built %s)", manifest["digest"], manifest["built_on"])


def _quiet_hf():
    """Context manager: transformers' progress bars off (restored after)."""
    from contextlib import contextmanager

    from transformers.utils import logging as hf_logging

    @contextmanager
    def quiet():
        was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if was_on:
                hf_logging.enable_progress_bar()

    return quiet()


def _build(spec: WarmStartSpec, base: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.monotonic()
    tok = load_tokenizer(base)
    traces = build_traces(tok, spec)
    t_traces = time.monotonic() - t0
    threads = torch.get_num_threads()
    det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(spec.num_threads)
    torch.use_deterministic_algorithms(spec.device == "cpu")
    try:
        with torch.random.fork_rng(devices=[]), _quiet_hf():
            torch.manual_seed(spec.seed)
            model = AutoModelForCausalLM.from_pretrained(str(base), dtype="auto")
            saved_dtype = next(model.parameters()).dtype
            model = model.float().to(spec.device)
            losses = train_sft(model, traces, spec, pad_id=tok.pad_token_id)
            model = model.to("cpu", saved_dtype)
            model.save_pretrained(str(out), safe_serialization=True)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)
    for name in _COPIED_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, out / name)
    n_tool = sum(t.uses_tool for t in traces)
    meta = {
        "code_version": CODE_VERSION,
        "base_model": base.name,
        "spec": spec.model_dump(mode="json"),
        "traces": {"total": len(traces), "tool": n_tool, "direct": len(traces) - n_tool,
                   "tokens": sum(len(t.ids) for t in traces),
                   "assistant_tokens": sum(sum(t.mask) for t in traces)},
        "loss": {"first": losses[0], "last": losses[-1], "every_10": losses[::10]},
    }
    (out / "agentloop_warmstart.json").write_text(json.dumps(meta, indent=2) + "\n")
    logger.info("warm start built in %.1fs (traces %.1fs): loss %.3f -> %.3f", time.monotonic() - t0, t_traces,
                losses[0], losses[-1])


# ---------------------------------------------------------------- measurement


def _generate(model: Any, rows: list[list[int]], *, max_new_tokens: int, temperature: float, eos_id: int,
              pad_id: int, generator: Any) -> list[list[int]]:
    """Batched generation continuing each row; stops a row at EOS (kept) or after max_new_tokens.

    The rows' common prefix is run once; the rest is left-padded after it (padding masked out,
    positions counted from the prefix so every row sees itself contiguous).
    """
    import torch

    P = min(_common_prefix_len(rows), min(len(r) for r in rows) - 1)
    B, S = len(rows), max(len(r) for r in rows) - P
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    attn = torch.ones((B, P + S), dtype=torch.long)
    pos = torch.full((B, S), P, dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r) - P
        ids[b, S - n:] = torch.tensor(r[P:])
        attn[b, P:P + S - n] = 0
        pos[b, S - n:] = torch.arange(P, P + n)
    dev = next(model.parameters()).device
    ids, attn, pos = ids.to(dev), attn.to(dev), pos.to(dev)
    hidden, cache = _forward_shared_prefix(model, torch.tensor(rows[0][:P], device=dev), ids, attention_mask=attn,
                                           position_ids=pos)
    logits = model.lm_head(hidden[:, -1])
    new: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    next_pos = pos[:, -1] + 1
    for _ in range(max_new_tokens):
        if temperature <= 0:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(dev)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        for b, (t, d) in enumerate(zip(nxt.tolist(), done.tolist())):
            if not d:
                new[b].append(t)
        done |= nxt == eos_id
        if bool(done.all()):
            break
        attn = torch.cat([attn, torch.ones((B, 1), dtype=torch.long, device=dev)], dim=1)
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                    past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
        next_pos = next_pos + 1
    return new


def evaluate_tool_use(model_dir: str | Path, *, n: int = 64, temperature: float = 1.0, seed: int = 0,
                      max_new_tokens: int = 64, num_threads: int = 2, device: str = "cpu") -> ToolUseStats:
    """Run the first `n` rows of the `calculator` eval set as two-turn tool episodes with transformers.

    Turn 1 is generated from the prompt rendered with the calculator schema; a turn holding tool
    calls gets the real calculator's result (or the parser's error) appended as tool_agent_loop
    would, and turn 2 is generated. The reward is the task's own (GSM8K `#### n`) on the last
    assistant message. Simplified: at most two turns, first call only, no per-episode token budget.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from agentloop.rewards import get_reward
    from agentloop.tools.parsers import parse_hermes
    from agentloop.tools.registry import get_tool

    tok = load_tokenizer(model_dir)
    schemas = calculator_schemas()
    r = _Renderer(tok, schemas)
    tool = get_tool("calculator")()
    reward = get_reward(CALCULATOR_SOURCE)
    rows = calculator_rows(n=n, seed=EVAL_SEED)
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        with _quiet_hf():
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
        gen = torch.Generator().manual_seed(seed)
        kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, eos_id=r.eos_id,
                  pad_id=tok.pad_token_id, generator=gen)
        histories = [[dict(m) for m in row["prompt"]] for row in rows]
        prompts = [r.encode(r.render(h, schemas, True)) for h in histories]
        with torch.no_grad():
            first = _generate(model, prompts, **kw)
        well_formed, attempted, right_expr, finals = [], [], [], []
        second_rows, second_idx = [], []
        for i, (h, ids) in enumerate(zip(histories, first)):
            end_text = tok.eos_token if ids and ids[-1] == r.eos_id else ""
            content = tok.decode(ids[:len(ids) - (1 if end_text else 0)], skip_special_tokens=False)
            h.append({"role": "assistant", "content": content})
            parsed = parse_hermes(content)
            call = parsed.calls[0] if parsed.calls else None
            ok = call is not None and call.name == "calculator" and not tool.validate_arguments(call.arguments)
            well_formed.append(ok)
            attempted.append(parsed.attempted)
            result = None
            if ok:
                result = asyncio.run(tool.execute({}, call.arguments)).text  # type: ignore[union-attr]
            right_expr.append(result == str(rows[i]["reward_model"]["ground_truth"]))
            if not parsed.attempted:
                finals.append(content)
                continue
            text = result if result is not None else (
                f"error: could not parse tool call: {parsed.errors[0]}" if parsed.errors
                else "error: invalid call")
            env = r.env_ids(h, [{"role": "tool", "name": "calculator", "content": text}], end_text)
            second_rows.append(prompts[i] + ids + env)
            second_idx.append(i)
            finals.append("")
        if second_rows:
            with torch.no_grad():
                second = _generate(model, second_rows, **kw)
            for i, ids in zip(second_idx, second):
                finals[i] = tok.decode(ids, skip_special_tokens=True)
                histories[i].append({"role": "assistant", "content": finals[i]})
    finally:
        torch.set_num_threads(threads)
    scores = [float(reward(CALCULATOR_SOURCE, f, row["reward_model"]["ground_truth"], row["extra_info"]))
              for f, row in zip(finals, rows)]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    return ToolUseStats(
        n=n, temperature=temperature,
        tool_call_rate=mean([float(x) for x in well_formed]),
        attempted_call_rate=mean([float(x) for x in attempted]),
        right_expression_rate=mean([float(x) for x in right_expr]),
        accuracy=mean(scores),
        accuracy_with_tool=mean([s for s, w in zip(scores, well_formed) if w]),
        accuracy_without_tool=mean([s for s, w in zip(scores, well_formed) if not w]),
        examples=[json.dumps(h[2:]) for h in histories[:4]],
    )
