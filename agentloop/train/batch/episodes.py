"""A step's usable records -> the episodes that enter the loss, with their advantages and the batch's numbers.

Map:
    Episode            one usable record, flattened (ids, masks, rollout logprobs, advantage, versions)
    Prepared           the episodes plus what verl's order of a step re-estimates from (every usable record's
                       reward, group and length)
    prepare_episodes   drop unscored records and infrastructure failures, group by uid, compute advantages
    staleness_metrics  version lag per token (asynchronous rollouts)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from agentloop.errors import failure_kind
from agentloop.records import EpisodeRecord
from agentloop.train.batch.advantages import Advantages, compute_advantages, group_ids
from agentloop.train.config import AlgoConfig


@dataclass
class Episode:
    ids: list[int]
    """prompt_ids + response_ids."""
    prompt_len: int
    response_mask: list[int]
    rollout_logprobs: list[float]
    advantage: float
    reward: float
    versions: list[int] | None = None
    """Per response token: the weight version that sampled it, -1 where unknown or mask 0; None when the
    record carries no token versions (synchronous rollouts)."""

    @property
    def length(self) -> int:
        """Tokens the model reads (the last token is only a target)."""
        return len(self.ids) - 1

    @property
    def model_tokens(self) -> int:
        return sum(self.response_mask)


@dataclass
class Prepared:
    episodes: list[Episode]
    """Episodes that enter the loss (failed, unscored and dropped ones removed)."""
    metrics: dict[str, float]
    ok_rewards: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    """Rewards of every usable record (the advantage estimator's input, episodes without model tokens
    and dropped groups included), for estimators run again later (agentloop.train.trainer.verl_order)."""
    ok_groups: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    """Their group numbers."""
    ok_lengths: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    """Their model-token counts."""
    ok_episode: list[int] = field(default_factory=list)
    """Per usable record, its index in `episodes`, -1 when it is not there."""
    uids: list[int] = field(default_factory=list)
    """Per episode, its record's uid (the GRPO group; -1 when the record has none)."""


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
    which = torch.zeros(len(ok), dtype=torch.int64)
    for e, idx in enumerate(episodes.values()):
        which[idx] = e
    adv = Advantages(values=per_episode.values[which], keep=per_episode.keep[which],
                     zero_variance=per_episode.zero_variance[which])
    entered = [bool(k) and r.num_model_tokens > 0 and bool(r.prompt_ids) for r, k in zip(ok, adv.keep.tolist())]
    ok_episode, n = [], 0
    for e in entered:
        ok_episode.append(n if e else -1)
        n += e
    eps = [
        Episode(
            ids=list(r.prompt_ids) + list(r.response_ids),
            prompt_len=len(r.prompt_ids),
            response_mask=list(r.response_mask),
            rollout_logprobs=list(r.response_logprobs),
            advantage=float(a),
            reward=float(r.reward),
            versions=[-1 if v is None else int(v) for v in r.token_versions] if r.token_versions else None,
        )
        for r, a, e in zip(ok, adv.values.tolist(), entered)
        if e
    ]
    rewards = [float(r.reward) for r in ok]
    metrics = {
        "batch/records": float(len(records)),
        "batch/failed": float(failed),
        "batch/policy_failed": float(sum(1 for r in ok if r.error is not None)),
        "batch/unscored": float(len(records) - failed - len(ok)),
        "batch/episodes": float(len(eps)),
        "batch/model_tokens": float(sum(e.model_tokens for e in eps)),
        "batch/seq_len_mean": sum(len(e.ids) for e in eps) / max(len(eps), 1),
        "reward/mean": sum(rewards) / max(len(rewards), 1),
        **adv.metrics(),
    }
    return Prepared(episodes=eps, metrics=metrics,
                    ok_rewards=torch.tensor(rewards, dtype=torch.float64), ok_groups=groups,
                    ok_lengths=torch.tensor([r.num_model_tokens for r in ok], dtype=torch.int64),
                    ok_episode=ok_episode, uids=[-1 if r.uid is None else r.uid for r, e in zip(ok, entered) if e])


def staleness_metrics(episodes: list[Episode], step: int, *, max_lag_bucket: int = 4) -> dict[str, float]:
    """Version lag per model token, lag = (step - 1) - version (step s trains the weights of version
    s - 1), over the tokens whose version is known: `async/staleness_mean`, `async/staleness_max`,
    `async/lag_share_<k>` for k < max_lag_bucket and `async/lag_share_<max_lag_bucket>+` (shares of those
    tokens), and `async/version_known_frac` (of all model tokens). Empty when no episode carries versions.
    Computed from the full episode list, so every rank gets the same numbers without a collective."""
    if not any(e.versions is not None for e in episodes):
        return {}
    lags: Counter[int] = Counter()
    known = total = 0
    for e in episodes:
        total += e.model_tokens
        if e.versions is None:
            continue
        for m, v in zip(e.response_mask, e.versions):
            if m and v >= 0:
                lags[(step - 1) - v] += 1
                known += 1
    out = {"async/version_known_frac": known / max(total, 1)}
    if known:
        if min(lags) < 0:
            raise ValueError(f"step {step}: a token was sampled by weight version {step - 1 - min(lags)}, newer than "
                             f"the weights this step starts from (version {step - 1})")
        out["async/staleness_mean"] = sum(k * n for k, n in lags.items()) / known
        out["async/staleness_max"] = float(max(lags))
        for k in range(max_lag_bucket):
            out[f"async/lag_share_{k}"] = lags.get(k, 0) / known
        out[f"async/lag_share_{max_lag_bucket}+"] = sum(n for k, n in lags.items() if k >= max_lag_bucket) / known
    return out


__all__ = ["Episode", "Prepared", "prepare_episodes", "staleness_metrics"]
