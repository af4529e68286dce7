"""The child process of test_journal_real: episodes of a 3-turn loop against a real server, journaled, until the
test SIGKILLs this process. Also the loop the test resumes them with.

    python -m tests.integration.journal_child URL JOURNAL_DIR
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from agentloop.config import Config, load_config
from agentloop.journal import Journal, journal_header
from agentloop.loops.base import AgentLoopBase, TrajectoryBuilder
from agentloop.records import Sample

TURNS, GROUPS, N = 3, 3, 2


class ThreeTurns(AgentLoopBase):
    """Three generate calls, each on the whole trajectory so far plus two environment tokens."""

    resumable = True

    async def run(self, sample, sampling_params):
        traj = TrajectoryBuilder([5, 6, 7, 10 + sample.index, 11, 12])
        for turn in range(TURNS):
            out = await self.generate(sample.episode_id, traj.context(), self.turn_params(sampling_params, turn))
            traj.add_model(out)
            traj.add_env([198, 13])
        return traj.build(reward=1.0)


def config(url: str) -> Config:
    return load_config(None, [f'server.urls=["{url}"]', "sampling.max_new_tokens=24", "sampling.temperature=1.0",
                              "sampling.ignore_eos=true", "journal.write_interval_ms=1"])


def samples() -> list[Sample]:
    return [Sample(index=i, uid=i, data_source="t", messages=[{"role": "user", "content": "x"}])
            for i in range(GROUPS)]


def header(cfg: Config) -> dict:
    return journal_header(cfg, "tiny", "rows")


async def main(url: str, journal_dir: Path) -> None:
    from agentloop.rollout.engine import RolloutEngine
    from agentloop.server_manager import ServerManager

    cfg = config(url)
    journal = Journal.open(journal_dir, cfg.journal, header(cfg))
    async with ServerManager([url], cfg.manager, initial_version=0) as sm:
        cfg.rollout.max_concurrency = 2  # two episodes at a time: the kill finds some done, some half, some not begun
        stream = RolloutEngine(cfg, sm, None, ThreeTurns, progress=False).stream(journal=journal)
        for s in samples():
            stream.submit(s, N)
        for _ in range(GROUPS):
            await stream.next()
    print("FINISHED (the test should have killed this process)", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
