"""A loop with an environment of its own and a stateful tool, continued after a crash from the episode journal
(README: "Resuming your loop after a crash"). The code below the docstring is the README's example;
tests/unit/journal/test_example_loop.py kills it mid-episode and checks that the resumed episodes equal
uninterrupted ones token for token, with no journaled step or tool call run again.

    agentloop rollout --plugin examples/journaled_env_loop.py --loop room_loop
    agentloop train --plugin examples/journaled_env_loop.py --loop room_loop      # journaled; kill it, run it again
"""

from agentloop import AgentLoopBase, register_agent_loop
from agentloop.loops import TrajectoryBuilder
from agentloop.tools import BaseTool, ToolResponse, register_tool


class Room:
    """An environment kept in this process (a simulator, a game): the journal holds its results, not its state."""

    def __init__(self, visits: int = 0):
        self.visits = visits

    def step(self, action: str) -> dict:
        self.visits += 1
        return {"obs": f"visit {self.visits}: you said {len(action)} characters", "visits": self.visits}


@register_tool("tally")
class Tally(BaseTool):
    description = "Add a number to the episode's running total."
    parameters = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    stateful = True    # the instance keeps the total: a resume runs the journaled calls again to rebuild it ...
    idempotent = True  # ... which is safe: adding to a fresh instance has no effect outside it

    async def create(self, episode, **kwargs):
        return {"total": 0}

    async def execute(self, instance, arguments):
        instance["total"] += arguments["x"]
        return ToolResponse(text=str(instance["total"]))


@register_agent_loop("room_loop")
class RoomLoop(AgentLoopBase):
    resumable = True   # all it learns from outside comes through generate, effect and tool_call
    room = None

    async def restore(self, sample, journaled) -> bool:
        # called before a journaled episode is replayed: the Room died with the process, so rebuild it from the
        # journaled results of its steps (the replay answers those steps from the journal without running them)
        steps = [e.value for e in journaled.replay() if e.name == "room.step" and e.done]
        self.room = Room(steps[-1]["visits"] if steps else 0)
        return True    # False: restart the episode from scratch

    async def run(self, sample, sampling_params):
        self.room = self.room or Room()
        tally = Tally(self.config.tools)
        counter = await tally.create(sample)
        traj = TrajectoryBuilder(self.apply_chat_template(sample.messages))
        for turn in range(3):
            out = await self.generate(sample.episode_id, traj.context(), self.turn_params(sampling_params, turn))
            traj.add_model(out)
            action = self.decode(out.token_ids)
            n = len(action)

            async def step(action=action):
                return self.room.step(action)

            async def add(n=n):
                return (await tally.execute(counter, {"x": n})).model_dump()

            # journaled; on a resume answered from the journal. idempotent: a step cut by the kill may run again
            # (the Room it changed died with the process); an action with an effect outside the process (a
            # payment, a message) is idempotent=False, and an episode cut in it ends as an error record
            obs = await self.effect("room.step", {"action": action}, step, idempotent=True)
            total = await self.tool_call(tally, {"x": n}, add)  # reads Tally.idempotent / .stateful
            traj.add_env(self.encode_env(f"\n{obs['obs']}; total {total['text']}\n"))
        return traj.build(finish_reason=out.finish_reason)
