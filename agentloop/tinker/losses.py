"""Tinker's loss functions, on the per-token logprobs of one datum, as its documentation defines them.

Each takes the target tokens' logprobs under the model being trained (a 1-D tensor with a graph) and the datum's
loss inputs, and returns the datum's loss: a SUM over tokens (Tinker sums; a recipe that wants a mean puts it in the
weights or advantages). The batch's loss is the sum over its datums; its metric is `loss:sum`.

    cross_entropy        -sum(weights * logprobs)                          inputs: target_tokens, weights
    importance_sampling  -sum(exp(logprobs - sampling_logprobs) * advantages)
                                                                           inputs: target_tokens, logprobs, advantages
    ppo                  -sum(min(r * A, clip(r, lo, hi) * A)), r = exp(logprobs - sampling_logprobs)
                         lo = clip_low_threshold (default 0.8), hi = clip_high_threshold (default 1.2), from
                         loss_fn_config (thresholds on the ratio itself, as Tinker's)

`LOSSES` is the registry; a name not in it is refused by the backend, naming the ones we have.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

PPO_CLIP_LOW = 0.8
PPO_CLIP_HIGH = 1.2


def _t(x: Any, like: Any) -> Any:
    import torch

    return torch.as_tensor(x, dtype=like.dtype, device=like.device)


def _need(inputs: Mapping[str, Any], loss: str, *names: str) -> None:
    missing = [n for n in names if n not in inputs]
    if missing:
        raise ValueError(f"loss_fn={loss!r} needs loss_fn_inputs {sorted(names)}; missing {missing}")


def cross_entropy(logprobs: Any, inputs: Mapping[str, Any], config: Mapping[str, Any]) -> Any:
    _need(inputs, "cross_entropy", "target_tokens", "weights")
    return -(logprobs * _t(inputs["weights"], logprobs)).sum()


def importance_sampling(logprobs: Any, inputs: Mapping[str, Any], config: Mapping[str, Any]) -> Any:
    import torch

    _need(inputs, "importance_sampling", "target_tokens", "logprobs", "advantages")
    ratio = torch.exp(logprobs - _t(inputs["logprobs"], logprobs))
    return -(ratio * _t(inputs["advantages"], logprobs)).sum()


def ppo(logprobs: Any, inputs: Mapping[str, Any], config: Mapping[str, Any]) -> Any:
    import torch

    _need(inputs, "ppo", "target_tokens", "logprobs", "advantages")
    lo = float(config.get("clip_low_threshold", PPO_CLIP_LOW))
    hi = float(config.get("clip_high_threshold", PPO_CLIP_HIGH))
    ratio = torch.exp(logprobs - _t(inputs["logprobs"], logprobs))
    adv = _t(inputs["advantages"], logprobs)
    return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv).sum()


LossFn = Callable[[Any, Mapping[str, Any], Mapping[str, Any]], Any]
LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo}
"""Tinker loss name -> our function (logprobs, loss inputs, loss_fn_config) -> the datum's summed loss."""


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise ValueError(f"loss_fn={name!r} is not supported by agentloop's Tinker service (supported: "
                         f"{sorted(LOSSES)}; forward_backward_custom runs any loss client-side)")
    return LOSSES[name]
