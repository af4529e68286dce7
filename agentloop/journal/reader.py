"""Reading a journal back: its segments' valid frames folded into what each group and episode left.

    read_journal   every `*.jal` segment of a directory (any writer, compacted or not, in any order) ->
                   JournalState; damaged frames are dropped and counted (frames.scan)
    JournalState   headers; groups -> attempts -> episodes (EpisodeLog); dropped groups; trained uids and the
                   newest data state; damage
    EpisodeLog     one episode: its generation, start, effects by order number, finished records

The fold is order-free and idempotent, so segments may be read in any order and a record may appear twice (a
compaction killed between writing its output and deleting its inputs): effects are keyed by (generation, order
number), finished records by generation, a RESTART raises the generation (effects of older generations are void),
DROP and TRAINED are sets. What an episode can replay is the run of effects numbered 0, 1, 2, ... of its newest
generation, up to the first gap (a record lost to damage or to a full queue).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentloop.journal import codec
from agentloop.journal.frames import Damage, iter_prefixes, scan
from agentloop.records import EpisodeRecord, TokenOutput


@dataclass
class Effect:
    """One journaled effect of an episode: a generate call (`out`), or a tool call / other effect (`name`)."""

    n: int
    kind: str
    """gen | effect."""
    prompt_len: int = 0
    prompt_hash: int = 0
    out: TokenOutput | None = None
    name: str = ""
    args_hash: int = 0
    done: bool = False
    """effect: its result was journaled (else it was running when the journal ended)."""
    value: Any = None


@dataclass
class EpisodeLog:
    uid: int
    attempt: int
    repeat: int
    g: int = 0
    start: dict[str, Any] | None = None
    effects: dict[tuple[int, int], Effect] = field(default_factory=dict)
    """(generation, order number) -> effect."""
    done: dict[int, list[EpisodeRecord]] = field(default_factory=dict)
    """generation -> the finished episode's records."""
    light: dict[int, dict[str, Any]] = field(default_factory=dict)
    """generation -> the finished episode's score and metrics (a light DONE: its tokens come from replaying)."""

    def records(self) -> list[EpisodeRecord] | None:
        """The finished records of the newest generation (None: not finished, or finished light)."""
        return self.done.get(self.g)

    def finished_light(self) -> dict[str, Any] | None:
        """The newest generation's light DONE (codec.done_light), when its effects are all there to replay."""
        d = self.light.get(self.g)
        return d if d is not None and len(self.replay()) >= d["effects"] else None

    @property
    def finished(self) -> bool:
        return self.records() is not None or self.finished_light() is not None

    def replay(self) -> list[Effect]:
        """The newest generation's effects 0, 1, ... up to the first gap."""
        out = []
        while (e := self.effects.get((self.g, len(out)))) is not None:
            out.append(e)
        return out

    @property
    def model_tokens(self) -> int:
        """Model tokens the replayable effects hold."""
        return sum(len(e.out.token_ids) for e in self.replay() if e.out is not None)

    @property
    def oldest_version(self) -> int | None:
        """The oldest weight version among the tokens it would keep (finished records, or replayable calls)."""
        recs = self.records()
        if recs is not None:
            vs = [v for r in recs if (v := r.oldest_version) is not None]
        else:
            vs = [v for e in self.replay() if e.out is not None for v in e.out.token_versions if v is not None]
        return min(vs) if vs else None


@dataclass
class JournalState:
    headers: list[dict[str, Any]] = field(default_factory=list)
    episodes: dict[tuple[int, int, int], EpisodeLog] = field(default_factory=dict)
    """(uid, attempt, repeat) -> episode."""
    dropped: dict[tuple[int, int], str] = field(default_factory=dict)
    """(uid, attempt) -> why the group will never be trained."""
    trained: set[int] = field(default_factory=set)
    data_state: Any = None
    """The data state of the newest TRAINED record."""
    trained_step: int = 0
    damage: list[tuple[Path, Damage]] = field(default_factory=list)
    records: int = 0
    files: list[Path] = field(default_factory=list)
    bytes: int = 0

    @property
    def damaged_records(self) -> int:
        """Damaged stretches found (each held one record or more; a torn tail usually one)."""
        return len(self.damage)

    def groups(self) -> dict[int, dict[int, list[EpisodeLog]]]:
        """uid -> attempt -> its episodes, for groups neither dropped nor trained."""
        out: dict[int, dict[int, list[EpisodeLog]]] = {}
        for (uid, attempt, _), ep in self.episodes.items():
            if uid in self.trained or (uid, attempt) in self.dropped:
                continue
            out.setdefault(uid, {}).setdefault(attempt, []).append(ep)
        for atts in out.values():
            for eps in atts.values():
                eps.sort(key=lambda e: e.repeat)
        return out


def _episode(state: JournalState, uid: int, attempt: int, repeat: int) -> EpisodeLog:
    key = (uid, attempt, repeat)
    ep = state.episodes.get(key)
    if ep is None:
        ep = state.episodes[key] = EpisodeLog(uid, attempt, repeat)
    return ep


def fold(state: JournalState, payload: memoryview, kind: int, uid: int, attempt: int, repeat: int) -> None:
    """One valid record into `state`."""
    _, _, _, _, meta, blobs = codec.decode(payload)
    state.records += 1
    if kind == codec.HEADER:
        state.headers.append(meta)
    elif kind == codec.TRAINED:
        state.trained.update(meta["uids"])
        if meta["step"] >= state.trained_step:
            state.trained_step, state.data_state = meta["step"], meta.get("data_state")
    elif kind == codec.DROP:
        state.dropped[(uid, attempt)] = meta.get("why", "")
    else:
        ep = _episode(state, uid, attempt, repeat)
        g = meta.get("g", 0)
        if g > ep.g:
            ep.g = g
        if kind == codec.START:
            ep.start = meta
        elif kind == codec.GEN:
            ep.effects[(g, meta["n"])] = Effect(n=meta["n"], kind="gen", prompt_len=meta["pl"],
                                                prompt_hash=meta["ph"], out=codec.token_output(meta, blobs))
        elif kind == codec.EFFECT_START:
            ep.effects.setdefault((g, meta["n"]), Effect(n=meta["n"], kind="effect", name=meta["name"],
                                                         args_hash=meta["ah"]))
        elif kind == codec.EFFECT_DONE:
            ep.effects[(g, meta["n"])] = Effect(n=meta["n"], kind="effect", name=meta["name"], args_hash=meta["ah"],
                                                done=True, value=meta.get("v"))
        elif kind == codec.DONE:
            if meta.get("light"):
                ep.light[g] = meta
            else:
                ep.done[g] = codec.done_records(meta, blobs)
        # RESTART: only its generation counts (raised above)


def segment_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.jal") if p.is_file())


def read_segment(path: Path, state: JournalState, uids: set[int] | None = None) -> None:
    """Fold one segment's valid frames (only the groups in `uids`, and run records, when given)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:  # compacted away while we listed: its records are in the compacted file
        return
    frames, damage = scan(data)
    state.files.append(path)
    state.bytes += len(data)
    state.damage += [(path, d) for d in damage]
    for kind, uid, attempt, repeat, payload in iter_prefixes(frames):
        if uids is not None and uid != codec.RUN and uid not in uids:
            continue
        fold(state, payload, kind, uid, attempt, repeat)


def read_journal(directory: Path, uids: set[int] | None = None) -> JournalState:
    """Every segment of `directory` folded (module doc); `uids`: read only these groups' records."""
    state = JournalState()
    for path in segment_files(directory):
        read_segment(path, state, uids)
    return state
