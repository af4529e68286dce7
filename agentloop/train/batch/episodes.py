"""A step's usable records -> the episodes that enter the loss, with their advantages and the batch's numbers, as
flat arrays (numpy; no per-episode Python lists, no torch).

Map:
    Episode            one episode as the collation reads it: its tokens, masks, behaviour logprobs, advantage,
                       versions (lists, or views of an Episodes' arrays)
    Episodes           a step's episodes as flat arrays: per-episode scalars for all of them, token arrays for
                       those held here (all on the orchestrator, a learner rank's own: agentloop.train.batch.format);
                       `episodes[i]` is an Episode of views
    Prepared           the episodes plus what verl's order of a step re-estimates from (every usable record's
                       reward, group and length)
    prepare_episodes   drop unscored records and infrastructure failures, group by uid, compute advantages
    staleness_metrics  version lag per token (asynchronous rollouts)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from agentloop.errors import failure_kind
from agentloop.records import EpisodeRecord
from agentloop.train.batch.advantages import Advantages, compute_advantages, group_ids
from agentloop.train.config import AlgoConfig


@dataclass
class Episode:
    ids: Sequence[int]
    """prompt_ids + response_ids."""
    prompt_len: int
    response_mask: Sequence[int]
    rollout_logprobs: Sequence[float]
    advantage: float
    reward: float
    versions: Sequence[int] | None = None
    """Per response token: the weight version that sampled it, -1 where unknown or mask 0; None when the
    record carries no token versions (synchronous rollouts)."""

    @property
    def length(self) -> int:
        """Tokens the model reads (the last token is only a target)."""
        return len(self.ids) - 1

    @property
    def model_tokens(self) -> int:
        return int(np.sum(np.asarray(self.response_mask, dtype=np.int64)))


@dataclass
class Episodes:
    """A step's episodes as flat arrays. Per episode i (all n of them): prompt_len, size (prompt + response
    tokens), model_tokens, advantage, reward, has_versions; its tokens are ids[start[i]:start[i] + size[i]] and its
    response positions (mask, behaviour logprobs, versions) the slice at rstart[i] of those arrays, when they are
    held here (start[i] >= 0). The orchestrator holds every episode; a learner rank reads only its own
    (agentloop.train.batch.format.RankBatch)."""

    prompt_len: np.ndarray
    """int32 [n]."""
    size: np.ndarray
    """int32 [n]: prompt + response tokens."""
    model_tokens: np.ndarray
    """int32 [n]: mask-1 response tokens."""
    advantage: np.ndarray
    """float64 [n]."""
    reward: np.ndarray
    """float64 [n]."""
    has_versions: np.ndarray
    """uint8 [n]: whether the record carried token versions."""
    start: np.ndarray
    """int64 [n]: where episode i's tokens start in `ids`, -1 when they are not held here."""
    rstart: np.ndarray
    """int64 [n]: where its response positions start in the response arrays (-1: not held)."""
    ids: np.ndarray
    """int32: the tokens held, episode after episode."""
    response_mask: np.ndarray
    """uint8, per response token held."""
    logprobs: np.ndarray
    """float32, per response token held: the behaviour policy's (the servers') logprobs."""
    versions: np.ndarray
    """int32, per response token held: the weight version that sampled it, -1 unknown (meaningless where
    has_versions is 0)."""

    def __len__(self) -> int:
        return int(self.prompt_len.shape[0])

    def __getitem__(self, i: int) -> Episode:
        s = int(self.start[i])
        if s < 0:
            raise IndexError(f"episode {i} is not held here (another learner rank's)")
        size, p, r = int(self.size[i]), int(self.prompt_len[i]), int(self.rstart[i])
        k = size - p
        return Episode(ids=self.ids[s:s + size], prompt_len=p, response_mask=self.response_mask[r:r + k],
                       rollout_logprobs=self.logprobs[r:r + k], advantage=float(self.advantage[i]),
                       reward=float(self.reward[i]), versions=self.versions[r:r + k] if self.has_versions[i] else None)

    def __iter__(self) -> Iterator[Episode]:
        return (self[i] for i in range(len(self)))

    @property
    def lengths(self) -> np.ndarray:
        """Per episode, the tokens the model reads (size - 1)."""
        return self.size.astype(np.int64) - 1

    @classmethod
    def from_list(cls, episodes: Sequence[Episode]) -> Episodes:
        """The flat form of a list of Episode (tests, an in-process caller's own episodes)."""
        n = len(episodes)
        size = np.array([len(e.ids) for e in episodes], dtype=np.int32)
        plen = np.array([e.prompt_len for e in episodes], dtype=np.int32)
        resp = size.astype(np.int64) - plen
        cat = lambda parts, dt: np.concatenate([np.asarray(x, dtype=dt) for x in parts]) if n else np.zeros(0, dt)  # noqa: E731
        mask = cat([e.response_mask for e in episodes], np.uint8)
        return cls(
            prompt_len=plen, size=size, model_tokens=np.array([e.model_tokens for e in episodes], dtype=np.int32),
            advantage=np.array([e.advantage for e in episodes], dtype=np.float64),
            reward=np.array([e.reward for e in episodes], dtype=np.float64),
            has_versions=np.array([e.versions is not None for e in episodes], dtype=np.uint8),
            start=np.concatenate([[0], np.cumsum(size, dtype=np.int64)[:-1]]).astype(np.int64) if n else
            np.zeros(0, np.int64),
            rstart=np.concatenate([[0], np.cumsum(resp)[:-1]]).astype(np.int64) if n else np.zeros(0, np.int64),
            ids=cat([e.ids for e in episodes], np.int32), response_mask=mask,
            logprobs=cat([e.rollout_logprobs for e in episodes], np.float32),
            versions=cat([e.versions if e.versions is not None else np.full(len(e.response_mask), -1)
                          for e in episodes], np.int32))


@dataclass
class Prepared:
    episodes: Episodes
    """Episodes that enter the loss (failed, unscored and dropped ones removed)."""
    metrics: dict[str, float]
    ok_rewards: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))
    """Rewards of every usable record (the advantage estimator's input, episodes without model tokens
    and dropped groups included), for estimators run again later (agentloop.train.trainer.verl_order)."""
    ok_groups: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Their group numbers."""
    ok_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Their model-token counts."""
    ok_episode: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per usable record, its index in `episodes`, -1 when it is not there."""
    uids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per episode, its record's uid (the GRPO group; -1 when the record has none)."""


def _records_to_episodes(ok: list[EpisodeRecord], advantage: np.ndarray) -> Episodes:
    """The records' token lists, once, into flat arrays."""
    n = len(ok)
    plen = np.array([len(r.prompt_ids) for r in ok], dtype=np.int32)
    resp = np.array([len(r.response_ids) for r in ok], dtype=np.int64)
    size = (plen + resp).astype(np.int32)
    if n:
        ids = np.concatenate([np.asarray(x, dtype=np.int32) for r in ok for x in (r.prompt_ids, r.response_ids)])
        mask = np.concatenate([np.asarray(r.response_mask, dtype=np.uint8) for r in ok])
        lps = np.concatenate([np.asarray(r.response_logprobs, dtype=np.float32) for r in ok])
        vers = np.concatenate([np.array([-1 if v is None else v for v in r.token_versions], dtype=np.int32)
                               if r.token_versions else np.full(len(r.response_ids), -1, dtype=np.int32)
                               for r in ok])
        start = np.concatenate([[0], np.cumsum(size, dtype=np.int64)[:-1]]).astype(np.int64)
        rstart = np.concatenate([[0], np.cumsum(resp)[:-1]]).astype(np.int64)
    else:
        ids, mask, lps, vers = (np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.float32),
                                np.zeros(0, np.int32))
        start = rstart = np.zeros(0, np.int64)
    for i, r in enumerate(ok):
        if len(r.response_mask) != resp[i] or len(r.response_logprobs) != resp[i]:
            raise ValueError(f"episode {i}: {resp[i]} response tokens but {len(r.response_mask)} mask entries")
    cm = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    model = (cm[rstart + resp] - cm[rstart]).astype(np.int32) if n else np.zeros(0, np.int32)
    return Episodes(prompt_len=plen, size=size, model_tokens=model, advantage=np.asarray(advantage, np.float64),
                    reward=np.array([float(r.reward) for r in ok], dtype=np.float64),
                    has_versions=np.array([bool(r.token_versions) for r in ok], dtype=np.uint8),
                    start=start, rstart=rstart, ids=ids, response_mask=mask, logprobs=lps, versions=vers)


def prepare_episodes(records: list[EpisodeRecord], algo: AlgoConfig) -> Prepared:
    """Exclude unscored records and those failed for a cause outside the policy, compute advantages per
    GRPO group (uid, else (step, index)).

    A policy failure (agentloop.errors.failure_kind: an episode timeout) that the orchestrator scored at
    `reward.failure_score` stays: it takes part in its group's baseline, and in the loss with the
    tokens it sampled. Episodes without model tokens (or without any tokens) take part in their group's
    baseline but not in the loss. An episode of several segments (records sharing its episode_id,
    openai_agent_loop) is one episode to the estimator (its reward counted once in the group's baseline,
    its length the sum of theirs); each segment is then a sequence of the loss with the episode's advantage
    (so under token-mean every model token weighs the same, under seq-mean-* each segment counts as a
    sequence). (`algo.use_kl_in_reward` re-estimates per record: there each segment counts as an episode.)
    """
    ok = [r for r in records if r.reward is not None and failure_kind(r.error, r.finish_reason) != "infra"]
    kept = {id(r) for r in ok}
    failed = sum(1 for r in records if r.error is not None and id(r) not in kept)
    group = [("uid", r.uid) if r.uid is not None else (r.step, r.index) for r in ok]
    groups = group_ids(group)
    episodes: dict[tuple[object, str], list[int]] = {}  # (group, episode id) -> its records in `ok`
    for i, (g, r) in enumerate(zip(group, ok)):
        episodes.setdefault((g, r.episode_id), []).append(i)
    per_episode = compute_advantages([float(ok[idx[0]].reward) for idx in episodes.values()],
                                     group_ids([g for g, _ in episodes]),
                                     [sum(ok[i].num_model_tokens for i in idx) for idx in episodes.values()], algo)
    which = np.zeros(len(ok), dtype=np.int64)
    for e, idx in enumerate(episodes.values()):
        which[idx] = e
    adv = Advantages(values=per_episode.values[which], keep=per_episode.keep[which],
                     zero_variance=per_episode.zero_variance[which])
    entered = np.array([bool(k) and r.num_model_tokens > 0 and bool(r.prompt_ids) for r, k in zip(ok, adv.keep)],
                       dtype=bool)
    ok_episode = np.where(entered, np.cumsum(entered) - 1, -1).astype(np.int64)
    ins = [r for r, e in zip(ok, entered) if e]
    eps = _records_to_episodes(ins, adv.values[entered])
    rewards = [float(r.reward) for r in ok]
    n = len(eps)
    metrics = {
        "batch/records": float(len(records)),
        "batch/failed": float(failed),
        "batch/policy_failed": float(sum(1 for r in ok if r.error is not None)),
        "batch/unscored": float(len(records) - failed - len(ok)),
        "batch/episodes": float(n),
        "batch/model_tokens": float(eps.model_tokens.sum()),
        "batch/seq_len_mean": int(eps.size.sum()) / max(n, 1),
        "reward/mean": sum(rewards) / max(len(rewards), 1),
        **adv.metrics(),
    }
    return Prepared(episodes=eps, metrics=metrics, ok_rewards=np.array(rewards, dtype=np.float64), ok_groups=groups,
                    ok_lengths=np.array([r.num_model_tokens for r in ok], dtype=np.int64), ok_episode=ok_episode,
                    uids=np.array([-1 if r.uid is None else r.uid for r in ins], dtype=np.int64))


def staleness_metrics(episodes: Episodes | Sequence[Episode], step: int, *,
                      max_lag_bucket: int = 4) -> dict[str, float]:
    """Version lag per model token, lag = (step - 1) - version (step s trains the weights of version
    s - 1), over the tokens whose version is known: `async/staleness_mean`, `async/staleness_max`,
    `async/lag_share_<k>` for k < max_lag_bucket and `async/lag_share_<max_lag_bucket>+` (shares of those
    tokens), and `async/version_known_frac` (of all model tokens). Empty when no episode carries versions.
    Computed from the full episode list, so every rank gets the same numbers without a collective."""
    eps = episodes if isinstance(episodes, Episodes) else Episodes.from_list(episodes)
    if not eps.has_versions.any():
        return {}
    total = int(eps.model_tokens.sum())
    if (eps.start < 0).any():
        raise ValueError("staleness_metrics needs every episode's tokens (the orchestrator's Episodes)")
    # per response token: whether its episode carries versions (the response arrays hold the episodes back to
    # back, in `rstart` order)
    resp = eps.size.astype(np.int64) - eps.prompt_len
    order = np.argsort(eps.rstart, kind="stable")
    carried = np.repeat(eps.has_versions[order].astype(bool), resp[order])
    known_tok = (eps.response_mask > 0) & carried & (eps.versions >= 0)
    lags = (step - 1) - eps.versions[known_tok].astype(np.int64)
    known = int(lags.size)
    out = {"async/version_known_frac": known / max(total, 1)}
    if known:
        if lags.min() < 0:
            raise ValueError(f"step {step}: a token was sampled by weight version {step - 1 - int(lags.min())}, "
                             f"newer than the weights this step starts from (version {step - 1})")
        out["async/staleness_mean"] = int(lags.sum()) / known
        out["async/staleness_max"] = float(lags.max())
        counts = np.bincount(lags)
        for k in range(max_lag_bucket):
            out[f"async/lag_share_{k}"] = int(counts[k] if k < counts.size else 0) / known
        out[f"async/lag_share_{max_lag_bucket}+"] = int(counts[max_lag_bucket:].sum()) / known
    return out


__all__ = ["Episode", "Episodes", "Prepared", "prepare_episodes", "staleness_metrics"]
