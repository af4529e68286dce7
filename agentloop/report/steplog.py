"""StepLog: one row of metrics per training step, to metrics.jsonl (and TensorBoard / W&B when asked),
and the reward-curve page drawn from those rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentloop.config import Config
from agentloop.errors import ConfigError
from agentloop.report.plots import write_curves_html
from agentloop.util.fsio import atomic_write_text

KL_KEY, ENTROPY_KEY = "learner/actor/kl_ref", "learner/actor/entropy"
"""The learner's metrics (prefixed `learner/` in metrics.jsonl) that the progress line and curves show."""

OFF_POLICY_KEYS = {"learner/mismatch/kl_behaviour_proximal": "mismatch KL (behaviour vs proximal)",
                   "learner/mismatch/tis_capped_frac": "tokens with TIS weight capped",
                   "learner/mismatch/masked_frac": "tokens masked by ratio",
                   "learner/actor/clip_frac": "PPO-clipped tokens"}
"""Learner metrics of the off-policy correction drawn on curves.html (those present)."""


class StepLog:
    """metrics.jsonl (one line per step), optional TensorBoard and W&B, the reward-curve page."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self.run_dir = run_dir
        self.rows: list[dict[str, float]] = []
        if self.path.exists():  # resumed run: keep earlier steps for the curve
            self.rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        self.tb = None
        if cfg.train.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                self.tb = None
        self.wandb = _start_wandb(cfg, run_dir) if cfg.train.wandb_project else None

    def truncate_from(self, first: int) -> None:
        """Drop the rows of steps >= `first` (a resumed run redoes them), on disk too."""
        kept = [r for r in self.rows if r.get("step", 0) < first] if first > 1 else []
        if kept != self.rows:
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
            self.rows = kept

    def log(self, row: dict[str, float]) -> None:
        self.rows = [r for r in self.rows if r.get("step") != row["step"]] + [row]
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, int(row["step"]))
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))},
                           step=int(row["step"]))

    def curves(self) -> Path:
        def series(key: str) -> list[tuple[float, float]]:
            return [(r["step"], r[key]) for r in self.rows if key in r]

        charts = [("reward", {"train reward": series("train/reward"), "val reward": series("val/reward")}),
                  ("accuracy", {"train": series("train/accuracy"), "val": series("val/accuracy")})]
        if any("train/tool_call_rate" in r for r in self.rows):
            charts.append(("tool-call rate", {"train": series("train/tool_call_rate"),
                                              "val": series("val/tool_call_rate")}))
        charts.append(("KL to the reference / entropy",
                       {label: series(k) for k, label in ((KL_KEY, "kl"), (ENTROPY_KEY, "entropy")) if series(k)}))
        charts.append(("response tokens", {"train": series("train/response_tokens")}))
        if any("staleness/lag_mean" in r for r in self.rows):
            charts.append(("staleness: version lag of trained tokens",
                           {"mean": series("staleness/lag_mean"), "max": series("staleness/lag_max")}))
        if any("async/busy_frac" in r for r in self.rows):
            charts.append(("asynchronous schedule", {
                "server busy fraction": series("async/busy_frac"),
                "groups cancelled (stale)": series("async/groups_cancelled"),
                "episodes continued across an update": series("async/episodes_continued")}))
        offp = {label: series(k) for k, label in OFF_POLICY_KEYS.items() if series(k)}
        if offp:
            charts.append(("off-policy correction", offp))
        return write_curves_html(self.run_dir / "curves.html", "agentloop train", charts, str(self.run_dir))

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _start_wandb(cfg: Config, run_dir: Path) -> Any:
    """A W&B run for `train.wandb_project`, resumable: its id is kept in the run dir."""
    try:
        import wandb
    except ImportError as e:
        raise ConfigError("train.wandb_project is set but the wandb package is not installed "
                          "(pip install wandb; or unset train.wandb_project)") from e
    id_file = run_dir / "wandb_id.txt"
    run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
    id_file.write_text(run_id + "\n")
    return wandb.init(project=cfg.train.wandb_project, name=cfg.train.wandb_run_name or run_dir.name, id=run_id,
                      resume="allow", dir=str(run_dir), config=cfg.model_dump(mode="json"))

