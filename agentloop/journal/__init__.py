"""The episode journal: a training run's rollout state, crash-consistent, beside its checkpoints.

    config.py    JournalConfig, the `journal` section of the config tree (a vocabulary leaf)
    frames.py    the on-disk unit: [u32 length][u32 crc32][payload], and reading it back (damage found and skipped)
    codec.py     the record kinds and their compact bodies (token arrays as machine words)
    writer.py    SegmentWriter: one writer thread fed by a bounded queue; write cadence, fsync policy, segments
    reader.py    read_journal: every segment folded into groups, episodes and their effects
    tape.py      EpisodeTape: an episode's effects recorded, and served back in order on a resume (replay)
    journal.py   Journal: a run's journal (open and check, plan a resume, tapes, step boundaries, compaction)

May import: the vocabulary and util. The engine (agentloop.rollout.journaled) and the orchestrator use it; a loop
reaches its tape only through AgentLoopBase.effect / tool_call and the server manager the engine hands it.
"""

from agentloop.journal.journal import Journal, JournalMismatchError, ResumePlan, journal_header
from agentloop.journal.tape import EffectNotReplayable, EpisodeTape, ReplayDiverged

__all__ = ["EffectNotReplayable", "EpisodeTape", "Journal", "JournalMismatchError", "ReplayDiverged", "ResumePlan",
           "journal_header"]
