"""single_turn_agent_loop: template the prompt once, generate once, return the tokens."""

from __future__ import annotations

from agentloop.config import SamplingParams
from agentloop.loops.base import AgentLoopBase, TrajectoryBuilder
from agentloop.loops.registry import register_agent_loop
from agentloop.records import AgentLoopOutput, Sample


@register_agent_loop("single_turn_agent_loop")
class SingleTurnAgentLoop(AgentLoopBase):
    """One assistant turn. The reward is left to the engine (scored by data_source)."""

    resumable = True  # one generate call on the templated prompt: the journal replays it

    async def run(self, sample: Sample, sampling_params: SamplingParams) -> AgentLoopOutput:
        traj = TrajectoryBuilder(self.apply_chat_template(sample.messages))
        out = await self.generate(sample.episode_id, traj.context(), sampling_params)
        traj.add_model(out)
        return traj.build(
            finish_reason=out.finish_reason,
            metrics={"cached_tokens": float(out.cached_tokens), "attempts": float(out.attempts)},
            extra={"response_text": self.decode(out.token_ids)},
        )
