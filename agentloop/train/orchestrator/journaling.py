"""The orchestrator's side of the episode journal (agentloop.journal): open it for a run, plan what a resumed run
continues, and the `journal/...` numbers of each step's row.

    open_run_journal   RUN_DIR/journal (journal.dir) checked against this run (model, data fingerprint, rollout
                       config) and, on a resume, the plan: the groups handed out and not trained (per the data
                       state the learner reports) continue from the journal, too-stale ones are dropped and their
                       prompts given out again (counted)
    JournalRows        per step: what changed since the previous row (episodes resumed, tokens reused, tool calls
                       not run again, ...), the bytes written, the journal's size on disk

Where the orchestrator calls it: a prompt the cursor gives out goes through `Journal.resumed_sample` (a journaled
group keeps its attempt, so its seeds and episode ids); a prompt given out again journals its old attempt as
dropped; a step's batch handed to the learner is `Journal.trained` (segment closed, compaction).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable

from agentloop.config import Config
from agentloop.journal import Journal, journal_header
from agentloop.journal.journal import journal_size
from agentloop.train.orchestrator.cursor import DataCursor


def journal_dir(cfg: Config, run_dir: Path) -> Path:
    return Path(cfg.journal.dir) if cfg.journal.dir else run_dir / "journal"


def open_run_journal(cfg: Config, run_dir: Path, model: Path | str, cursor: DataCursor, *, first: int,
                     floor_version: int | None, say: Callable[[str], None]) -> Journal | None:
    """The run's journal (None with journal.enabled=false), with its resume planned when it holds anything."""
    if not cfg.journal.enabled:
        return None
    header = journal_header(cfg, str(Path(model).resolve()), cursor.fingerprint)
    journal = Journal.open(journal_dir(cfg, run_dir), cfg.journal, header, say=say)
    if journal.state.records:
        plan = journal.plan_resume(handed_out=cursor.handed_out_untrained, floor_version=floor_version)
        say(plan.line())
    return journal


class JournalRows:
    """`journal/...` of each step's row: counters since the previous row, sizes as they are."""

    CUMULATIVE = ("journal/bytes_written", "journal/records_written", "journal/fsyncs")

    def __init__(self, journal: Journal, directory: Path):
        self.journal = journal
        self.directory = directory
        self.seen: Counter[str] = Counter()

    def row(self) -> dict[str, float]:
        now = self.journal.gauges()
        out: dict[str, float] = {}
        for k, v in now.items():
            if k in ("journal/queued_bytes", "journal/writer_failed"):
                out[k] = v
            else:
                out[k] = v - self.seen.get(k, 0.0)
        self.seen = Counter(now)
        out["journal/size_bytes"] = float(journal_size(self.directory))
        return out


def step_uids(records: list[Any]) -> set[int]:
    """The GRPO groups (uids) a step's records belong to."""
    return {r.uid if r.uid is not None else r.index for r in records}
