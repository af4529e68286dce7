"""What a rollout run reports: `summarize` (reward, pass@k, throughput, errors) and the pass@k estimator.

`pass_at_k(n, c, k)` is the unbiased estimator of the Codex paper (Chen et al., 2021):
with n samples of which c are correct, 1 - C(n-c, k) / C(n, k), computed as the product
1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the (huge) binomials.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agentloop.records import EpisodeRecord

CORRECT_THRESHOLD = 1.0 - 1e-9
"""An episode counts as correct when its score is at least this."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def summarize_groups(
    groups: Mapping[int, Sequence[float]],
    k_values: Iterable[int],
    *,
    threshold: float = CORRECT_THRESHOLD,
) -> dict[str, float | int]:
    """Rewards grouped by prompt index -> summary numbers.

    Keys: `num_prompts`, `num_episodes`, `mean_reward` (over all episodes), `accuracy`
    (fraction of episodes with score >= threshold) and `pass@k` for each k, averaged over
    the prompts that have at least k episodes (a k no prompt reaches is left out). Empty
    groups count in `num_prompts` only. Scores must be finite.
    """
    ks = sorted(set(k_values))
    if any(k < 1 for k in ks):
        raise ValueError(f"k values must be >= 1, got {ks}")
    scores: list[float] = []
    counts: list[tuple[int, int]] = []  # (n, c) per non-empty group
    for index, group in groups.items():
        for s in group:
            if not math.isfinite(s):
                raise ValueError(f"group {index}: score {s!r} is not finite")
        if group:
            scores.extend(group)
            counts.append((len(group), sum(1 for s in group if s >= threshold)))
    out: dict[str, float | int] = {
        "num_prompts": len(groups),
        "num_episodes": len(scores),
        "mean_reward": math.fsum(scores) / len(scores) if scores else 0.0,
        "accuracy": sum(c for _, c in counts) / len(scores) if scores else 0.0,
    }
    for k in ks:
        eligible = [pass_at_k(n, c, k) for n, c in counts if n >= k]
        if eligible:
            out[f"pass@{k}"] = math.fsum(eligible) / len(eligible)
    return out


def summarize(records: list[EpisodeRecord], n_samples: int, wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    errors = Counter((r.error or "").split(":", 1)[0] for r in records if r.error is not None)
    rewards = [r.reward for r in ok if r.reward is not None]
    groups: dict[int, list[float]] = defaultdict(list)
    for r in ok:
        if r.reward is not None:
            groups[r.index].append(r.reward)
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, n_samples) if k <= n_samples})
    pass_k: dict[str, float] = {}
    for k in ks:
        vals = [pass_at_k(len(v), sum(x >= 1.0 - 1e-9 for x in v), k) for v in groups.values() if len(v) >= k]
        if vals:
            pass_k[f"pass@{k}"] = sum(vals) / len(vals)
    out_tokens = sum(r.num_model_tokens for r in records)
    return {
        "episodes": len(records),
        "errors": sum(errors.values()),
        "errors_by_type": dict(errors),
        # scored at reward.failure_score, not error records: the reward raised / ran past reward.timeout_s
        "reward_errors": int(sum(r.metrics.get("reward_errors", 0) for r in records)),
        "reward_timeouts": int(sum(r.metrics.get("reward_timeouts", 0) for r in records)),
        "mean_reward": (sum(rewards) / len(rewards)) if rewards else None,
        **pass_k,
        "accuracy": (sum(x >= 1.0 - 1e-9 for x in rewards) / len(rewards)) if rewards else None,
        "mean_response_tokens": (out_tokens / len(records)) if records else 0.0,
        "output_tokens": out_tokens,
        "tokens_per_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "episodes_per_s": len(records) / wall_s if wall_s > 0 else 0.0,
        "finish_reasons": dict(Counter(r.finish_reason for r in records)),
        "wall_s": wall_s,
    }
