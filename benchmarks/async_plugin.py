"""A long-tail workload for the asynchronous-training benchmarks (`--plugin benchmarks/async_plugin.py`).

`longtail_tool_loop` is tool_agent_loop with two things scripted, since random weights never call tools:
- every turn is read as one calculator call (the `bench_forced_calculator` parser, as
  `agentloop bench tools --bench-force-tools` does): real generation, a real tool call between turns;
- the episode's turn count is heavy-tailed: T = min(cap, floor(U ** (-1 / alpha))), U uniform in (0, 1]
  drawn from the episode's seed. With alpha 1.2 and cap 16: P(T = 1) = 0.56, P(T >= 4) = 0.19,
  P(T = 16) = 0.036, mean 2.9. A synchronous step waits for its longest episode; most episodes end
  early and leave the servers idle.
Settings: LONGTAIL_ALPHA (1.2), LONGTAIL_CAP (16) in the environment; tokens per turn come from
`tools.max_tokens_per_turn` (or `sampling.max_new_tokens`), with `sampling.ignore_eos=true` for fixed turns.
"""

from __future__ import annotations

import os
import random

from agentloop.bench.tools import forced_parser
from agentloop.loops import register_agent_loop
from agentloop.loops.tool_agent import ToolAgentLoop
from agentloop.tools import ToolsConfig, register_parser

register_parser("bench_forced_calculator", forced_parser("calculator"), override=True)


def turns_for(seed: int | None, alpha: float, cap: int) -> int:
    u = 1.0 - random.Random(seed).random()  # (0, 1]
    return max(1, min(cap, int(u ** (-1.0 / alpha))))


@register_agent_loop("longtail_tool_loop")
class LongTailToolLoop(ToolAgentLoop):
    """tool_agent_loop with forced calculator calls and a heavy-tailed turn count per episode."""

    _turns = 1

    @property
    def tools_config(self) -> ToolsConfig:
        base = super().tools_config
        names = base.names or ["calculator"]
        return base.model_copy(update={"max_turns": self._turns, "parser": "bench_forced_calculator", "names": names})

    async def run(self, sample, sampling_params):
        self._turns = turns_for(sampling_params.seed, float(os.environ.get("LONGTAIL_ALPHA", "1.2")),
                                int(os.environ.get("LONGTAIL_CAP", "16")))
        return await super().run(sample, sampling_params)
