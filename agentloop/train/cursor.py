"""DataCursor: the deterministic, resumable order of training prompts (shuffled per epoch)."""

from __future__ import annotations

import random

from agentloop.errors import ConfigError
from agentloop.records import Sample


class DataCursor:
    """Prompts in a per-epoch shuffled order; `position` counts prompts consumed (resumable)."""

    def __init__(self, samples: list[Sample], seed: int, position: int = 0):
        if not samples:
            raise ConfigError("the training set is empty")
        self.samples = samples
        self.seed = seed
        self.position = position

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.samples)))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def take(self, n: int) -> list[Sample]:
        out = []
        for _ in range(n):
            epoch, k = divmod(self.position, len(self.samples))
            out.append(self.samples[self._order(epoch)[k]])
            self.position += 1
        return out
