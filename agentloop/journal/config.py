"""JournalConfig: the `journal` section of the config tree (agentloop.journal: a training run's episode journal)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class JournalConfig(BaseModel):
    """The episode journal of `agentloop train` (docs/journal.md): every episode's effects (each
    generate call's tokens, each tool call and its result) and every finished episode's record are appended, as they
    happen, to `RUN_DIR/journal/`, so a killed run (or a dead rollout worker, or an episode whose server failed)
    continues each episode from where it stood instead of rolling it out again."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    enabled: bool = True
    """Keep the journal. On by default: its cost measured at 10,000 episodes in flight is within the noise of the
    2-core box (benchmarks/RESULTS_resume.md); off, a resumed run rolls the prompts in flight at the kill out again
    from scratch (fresh seeds), as before the journal."""
    dir: str | None = None
    """Where the journal lives. None: `RUN_DIR/journal`."""
    write_interval_ms: float = Field(default=5.0, ge=0)
    """The writer thread gathers records for this long before one `write()` of them all. A SIGKILL loses the
    records not yet written (at most about this window's worth); their effects are done again on resume."""
    fsync_interval_ms: float = Field(default=1000.0, ge=0)
    """fsync the open segment at most this often (and at every step boundary): what survives a power loss, as
    opposed to a killed process, which keeps everything written. 0: fsync after every write."""
    max_queue_mb: float = Field(default=256.0, gt=0)
    """Records waiting for the writer thread, at most. A slow disk never blocks an episode: past this bound a record
    is dropped (counted, `journal/records_dropped_queue_full`) and its episode's journal ends there, so a resume
    continues that episode from its last journaled effect before the gap."""
    segment_mb: float = Field(default=64.0, gt=0)
    """A segment file is closed and a new one started past this size (and at every step boundary)."""
    compact: bool = True
    """At each step boundary, rewrite the closed segments without the records of groups the learner has been
    handed (its mailbox keeps the batch) or that were dropped, so the journal holds about what is in flight."""
    episode_retries: int = Field(default=1, ge=0)
    """An episode whose server call failed for an infrastructure cause (retries spent, a server that died, a
    server abort) is continued this many times from its journaled effects on another server, instead of becoming
    an error record that takes its group out."""
    on_mismatch: Literal["refuse", "discard"] = "refuse"
    """A journal written for another model, data file or rollout config: refuse (an error naming what differs) or
    discard (moved aside to journal.discarded-<time>/; the episodes in it are rolled out again)."""
