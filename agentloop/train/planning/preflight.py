"""The checks of `agentloop train --dry-run`, which every `agentloop train` run makes before it starts anything.

In seconds, from the config, the data, the model's config.json and its tokenizer (never its weights), one line
per check, each failure naming the row, key or file that is wrong:
    data      `agentloop data check`'s rules on the rows the run uses (training rows, validation file), then the
              data section's own rules (the held-out slice, the row limits)
    rewards   a reward for every data_source, found as the Scorer finds it (reward.custom, the run's code reward,
              the registry, reward.default)
    template  the chat template on a real row, rendered prefix by prefix, each rendering extending the previous
              one token for token (what tool_agent_loop's trajectories rely on); a single-turn row gets a tool
              call and its result appended, as the loop would. A tokenizer without a template passes only with
              data.apply_chat_template=false and a loop that renders none
    prompts   the longest prompt (rendered as the loop renders it) fits the context
    model     the learner runs the model exactly (model_support.check_model_support, at model.context_length)
    tools     the tools each row is offered, resolved as tool_agent_loop resolves them (its own method)
    memory    the GPU memory plan (agentloop.train.planning.memory): learner peak, server KV pool, placement
On CUDA (a visible GPU, or cluster.gpu_memory_gib on a machine without one), the plan also sizes the keys the
user left unset (`apply_plan`; a key in a --config file, a preset or an override counts as set) and prints
them once as the "plan:" block; they go into the run's config.yaml, so the run and a resumed run keep them.
On CPU nothing is derived.

Map (this module puts the planning room's parts together):
    Preflight            all the checks' lines, the data and plan for the run, the derived keys
    run_preflight        every check in order (agentloop.train.planning.checks), the machine (inventory), the plan
                         and its keys (defaults); Preflight.raise_for_failures: ConfigError naming each failure
    check_memory         the memory check's line, from the plan
    say_lines            the preflight's lines, through the caller's `say`
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from agentloop.config import Config
from agentloop.errors import ConfigError
from agentloop.train.planning import memory as planner
from agentloop.train.planning.checks import (
    Check,
    _loop_kind,
    check_data,
    check_model,
    check_prompts,
    check_rewards,
    check_template,
    check_tools,
    context_length,
)
from agentloop.train.planning.defaults import Derived, apply_plan, derive
from agentloop.train.planning.inventory import gpu_inventory, machine_for
from agentloop.train.planning.render import plan_lines, plan_record


@dataclass
class Preflight:
    """Everything the checks found."""

    checks: list[Check]
    data: Any | None
    """TrainData of the run (None when the data check failed)."""
    plan: planner.Plan | None
    machine: str
    """What the plan was made for, in words ('' on CPU)."""
    derived: list[Derived]
    seconds: float
    record: dict[str, Any] = field(default_factory=dict)
    """The plan's numbers (plan.json in the run dir, train_summary.json's `plan`)."""

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "FAIL"]

    def lines(self) -> list[str]:
        out = [line for c in self.checks for line in c.lines()]
        if self.plan is not None:
            out.append(f"plan: {self.machine}")
            out += [f"  {line}" for line in plan_lines(self.plan)]
            for d in self.derived:
                out.append(f"  {d.key:<32} {_show(d.value):<10} " + ("(set)" if d.user_set else f"(derived: {d.why})"))
        return out

    def raise_for_failures(self) -> None:
        if self.failed:
            raise ConfigError(f"preflight: {len(self.failed)} check(s) failed:\n" + "\n".join(
                f"  {c.name}: {c.summary}" + "".join(f"\n    {d}" for d in c.details) for c in self.failed))

    def save(self, run_dir: Path) -> None:
        if self.record:
            (run_dir / "plan.json").write_text(json.dumps(self.record, indent=2) + "\n")


def _show(v: Any) -> str:
    return "null" if v is None else str(v)


def check_memory(plan: planner.Plan | None, machine: str) -> Check:
    if plan is None:
        return Check("memory", "ok", "CPU run: nothing to plan (no GPU visible, cluster.gpu_memory_gib unset)")
    if not plan.ok:
        return Check("memory", "FAIL", f"the plan for {machine} does not fit", plan.problems)
    mem = plan.learner
    said = f"fits {machine}" + (f": learner peak {mem.peak:.1f} GiB per rank" if mem is not None else "")
    if plan.kv_tokens is not None:
        said += f", server KV {plan.kv_tokens:,} tokens"
    return Check("memory", "warn" if plan.notes else "ok", said, [f"note: {n}" for n in plan.notes])


def run_preflight(cfg: Config, model_path: Path, *, dry_run: bool = False) -> Preflight:
    """Every check in order, for the run's model directory. `cfg.data` becomes the data section as resolved
    (load_train_data); on CUDA the derived keys are written into `cfg` (only when every check passed).
    `dry_run`: cluster.gpu_memory_gib / num_gpus may name GPUs this machine does not have."""
    from agentloop.loops import get_agent_loop
    from agentloop.models.loading import load_tokenizer_for

    t0 = time.monotonic()
    checks: list[Check] = []
    data_check, data = check_data(cfg)
    checks.append(data_check)
    if data is not None:
        cfg.data = data.config  # the held-out slice's size, no unused built-in set: what config.yaml saves
    kind = _loop_kind(get_agent_loop(cfg.rollout.loop))
    if data is not None:
        checks.append(check_rewards(cfg, data))
    try:
        model_config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {model_path}/config.json: {e}") from None
    ctx = context_length(cfg, model_config)
    tokenizer, longest = None, 0
    try:
        tokenizer = load_tokenizer_for(cfg, Path(model_path))
    except ConfigError as e:
        checks.append(Check("template", "FAIL", str(e)))
    if tokenizer is not None and data is not None:
        checks.append(check_template(cfg, tokenizer, data, kind))
        prompt_check, longest = check_prompts(cfg, tokenizer, data, kind, ctx)
        checks.append(prompt_check)
    model_check = check_model(cfg, Path(model_path), model_config)
    checks.append(model_check)
    if tokenizer is not None and data is not None:
        checks.append(check_tools(cfg, tokenizer, data, kind))
    plan, derived, machine, record = None, [], "", {}
    try:
        gpu_gib, machine = machine_for(cfg, gpu_inventory(), dry_run=dry_run)
    except ConfigError as e:
        checks.append(Check("memory", "FAIL", str(e)))
        gpu_gib = None
    if gpu_gib and model_check.status != "FAIL" and longest:
        shape = planner.ModelShape.from_config(model_config)
        plan, derived = derive(cfg, kind, ctx, longest, gpu_gib, shape)
        record = plan_record(plan, machine, gpu_gib, shape)
    if gpu_gib is not None:
        checks.append(check_memory(plan, machine) if plan is not None or not gpu_gib else
                      Check("memory", "warn", "not planned: it needs the checks above"))
    pre = Preflight(checks, data, plan, machine, derived, time.monotonic() - t0, record)
    if plan is not None and not pre.failed:
        apply_plan(cfg, derived)
    return pre


def say_lines(pre: Preflight, say: Callable[[str], None], header: str) -> None:
    say(f"{header} ({pre.seconds:.1f} s)")
    for line in pre.lines():
        say(line)


__all__ = ["Preflight", "check_memory", "run_preflight", "say_lines"]
