"""One episode run with the journal (agentloop.journal): recorded, or continued from where it stood.

`run_journaled` is what the engine runs per episode when its group stream has a journal:

    finished in the journal     its journaled records are returned as they are (scored; nothing runs again)
    journaled effects           the loop is run again with a tape that replays them (agentloop.journal.tape), then
                                goes on live; a loop that cannot replay (`AgentLoopBase.resumable` False and no
                                `restore` hook, or `restore` said no) restarts instead, counted
    diverged from its journal   (a replayed call differs from the journaled one) restarted live, counted, named
    a server failure            (retries spent, a server abort) continued again from its journaled effects, on
                                whichever server answers, up to `journal.episode_retries` times, instead of becoming
                                an error record that takes its group out
    always                      its records journaled when it ends (DONE), so a finished group waiting for the
                                learner survives a kill
"""

from __future__ import annotations

from typing import Any

from agentloop.journal import Journal, ReplayDiverged
from agentloop.loops.base import AgentLoopBase
from agentloop.records import EpisodeRecord, Sample

RETRYABLE_ERRORS = ("RetryBudgetExhausted", "RetryableError", "ServerError")
"""Error types of a record that another server may not repeat: continued from the journal."""


def records_effects(loop_cls: type[AgentLoopBase]) -> bool:
    """Whether an episode of `loop_cls` can use its journaled effects (resumable, or a restore hook of its own)."""
    return bool(loop_cls.resumable) or loop_cls.restore is not AgentLoopBase.restore


def server_failure(rec: EpisodeRecord) -> bool:
    """The record failed because of a server (not the policy, not the loop): worth continuing elsewhere."""
    if rec.error is None:
        return rec.finish_reason == "abort"
    return rec.error.split(":", 1)[0].strip() in RETRYABLE_ERRORS


async def run_journaled(engine: Any, sample: Sample, step: int | None,
                        journal: Journal) -> list[EpisodeRecord]:
    """The episode's records (module doc); `engine`: the RolloutEngine running it."""
    effects = records_effects(engine.loop_cls)
    tape = journal.tape(sample, record=effects)
    if tape.log is not None and (done := tape.log.records()) is not None:
        journal.counts["episodes_reused_finished"] += 1
        journal.counts["tokens_reused"] += sum(r.num_model_tokens for r in done)
        return done
    if tape.log is not None and effects:  # finished light: replayed whole, then its journaled score applies
        tape.done_fields = tape.log.finished_light()
    if tape.resumed and effects and tape.done_fields is None:
        journal.counts["episodes_resumed"] += 1
    elif tape.log is not None and not effects:  # in flight at the kill, but its loop cannot replay: from scratch
        tape.restart(f"{engine.loop_cls.__name__} is not resumable (AgentLoopBase.resumable / restore)")
    elif tape.log is None:
        tape.start({"index": sample.index, "loop": engine.loop_cls.name or engine.loop_cls.__name__, "step": step})
    retries = journal.cfg.episode_retries
    while True:
        try:
            rec = await engine._run_episode_inner(sample, step, tape)
        except ReplayDiverged as e:
            tape.restart(f"diverged from its journal: {e}")
            continue  # live from here (nothing is left to replay): it cannot diverge again
        if retries > 0 and effects and tape.record and server_failure(rec):
            retries -= 1
            journal.counts["episodes_continued_after_failure"] += 1
            log = await journal.reload_episode(sample)
            tape = journal.tape_from(sample, log, g=tape.g)
            continue
        break
    if tape.done_fields is not None:
        if tape.replayed_done(rec.finish_reason) is not None:
            journal.counts["episodes_reused_finished"] += 1
        else:  # it did not replay whole (a divergence, a failure): it went on as a resumed episode
            journal.counts["episodes_resumed"] += 1
    records = rec.split_segments()
    tape.done(records)
    return records


def journaled_started_version(journal: Journal | None, uid: int, expected: Any) -> Any:
    """The version a group counts as started at: a resumed group's oldest journaled token, when older."""
    if journal is None:
        return expected
    old = journal.oldest_version(uid)
    if old is None or expected is None:
        return expected if old is None else old
    return min(old, expected)
