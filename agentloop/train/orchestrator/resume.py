"""The resume rule of `agentloop train --run-dir X`: an existing run goes on with its own saved config.

When X holds a config.yaml, the run's config is X/config.yaml (not a preset), with only the values given
now applied on top: a `--config` file's values, then `key.sub=value` overrides and flags. Only settings that
carry state may not change unless forced, each with its own flag; the error names each changed key with its
old and new value and the flag that accepts it. Paths compare as the files they name.
    PINNED_STATE  what the checkpoint's state was made with (`--force-settings`): the model and tokenizer, the
                  optimizer's moments (learner.betas, learner.adam_eps), the parameters' dtype, the adaptive
                  KL controller whose value the checkpoint keeps (algo.kl_ctrl*)
    PINNED_DATA   what the data position indexes (`--force-data`): the training and validation rows and the
                  data order's seed; a checkpoint whose data position was stored for other rows needs it too
Everything else (learning rate, clip ratios, kl_coef, micro-batching, the number of processes: the sharded
checkpoint loads into any world size) may change on a resume, and the change is printed. `--force` is both.

Configs saved before the training rows moved to the `data` section (train.data_path, ...) are read with
those keys mapped to their new place: the same training rows; before the renames of agentloop.config's
MOVED_KEYS, with the dead train.sync dropped, learner.nproc as learner.ranks (x learner.nnodes: it counted one
host's ranks under torchrun, and Ray allows one "node") and learner.checkpoint_async as
learner.checkpoint_background.

Map:
    PINNED_STATE / PINNED_DATA   keys a resume may not change without --force-settings / --force-data
    config_changes    (key, old, new) for every leaf two configs disagree on
    resume_config     X/config.yaml + the values given now -> (Config, changes); ConfigError on pinned changes
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from agentloop.config import Config, apply_overrides, config_from_tree, read_config_file
from agentloop.errors import ConfigError

PINNED_STATE = ("model.path", "model.tokenizer_path", "learner.betas", "learner.adam_eps", "learner.dtype",
                "algo.kl_ctrl", "algo.kl_ctrl_coef", "algo.kl_ctrl_target", "algo.kl_ctrl_horizon")
"""Settings the checkpoint's state was made with: changed only with --force-settings."""

PINNED_DATA = ("data.path", "data.builtin", "data.max_samples", "data.prompt_key", "data.val_path",
               "data.val_builtin", "data.val_holdout", "rollout.seed")
"""Settings the data position indexes: changed only with --force-data."""

PINNED = PINNED_STATE + PINNED_DATA
"""Every key a resumed run may not change without a force flag."""

PATH_KEYS = frozenset({"model.path", "model.tokenizer_path", "data.path", "data.val_path"})
"""Keys holding a file or directory: `./a.jsonl` and `/abs/a.jsonl` are the same value."""


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_leaves(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _same(key: str, a: Any, b: Any) -> bool:
    if a == b:
        return True
    if key in PATH_KEYS and isinstance(a, str) and isinstance(b, str):
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    return False


def config_changes(old: Config, new: Config) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for each leaf of the config tree that differs."""
    a, b = _leaves(old.model_dump(mode="json")), _leaves(new.model_dump(mode="json"))
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if not _same(k, a.get(k), b.get(k))]


def is_pinned(key: str) -> bool:
    """Whether `key` is one of `PINNED` or under a section of it."""
    return pin_kind(key) is not None


def pin_kind(key: str) -> str | None:
    """"settings" (PINNED_STATE), "data" (PINNED_DATA) or None: what forcing a change of `key` takes."""
    for kind, keys in (("settings", PINNED_STATE), ("data", PINNED_DATA)):
        if any(key.startswith(p) if p.endswith(".") else key == p for p in keys):
            return kind
    return None


def _migrate_moved_keys(tree: dict[str, Any]) -> dict[str, Any]:
    """A config saved before the training rows joined the `data` section, with the rows the old run
    trained on in their new place (the old training read neither data.max_samples nor data.prompt_key).
    Its validation rows too, but for a run on a data file, which validated on the built-in set
    train.val_builtin: that one now validates on nothing (no rows are held out of rows already trained)."""
    train = tree.get("train")
    if not isinstance(train, dict) or not {"data_path", "builtin", "val_path", "val_builtin",
                                           "val_max_samples"} & set(train):
        return tree
    data = tree.setdefault("data", {})
    path, builtin = train.pop("data_path", None), train.pop("builtin", "calculator_train")
    val_path, val_builtin = train.pop("val_path", None), train.pop("val_builtin", "calculator")
    data.update(path=path, builtin=builtin, max_samples=None, prompt_key="prompt", val_path=val_path,
                val_builtin=val_builtin if val_path is None and path is None else None,
                val_max_samples=train.pop("val_max_samples", 32), val_holdout=0)
    return tree


def _migrate_renamed_keys(tree: dict[str, Any]) -> dict[str, Any]:
    """A config saved before train.sync went and learner.nproc and learner.checkpoint_async were renamed, with
    the same meaning in the new keys (module doc)."""
    train, learner = tree.get("train"), tree.get("learner")
    if isinstance(train, dict):
        train.pop("sync", None)  # its one value, disk, is learner.weight_sync's default and the only path it had
    if isinstance(learner, dict):
        if "nproc" in learner:
            learner.setdefault("ranks", int(learner.pop("nproc")) * int(learner.get("nnodes") or 1))
        if "checkpoint_async" in learner:
            learner.setdefault("checkpoint_background", learner.pop("checkpoint_async"))
    return tree


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top`'s values over `base` (sections merged key by key; anything else replaced), in place."""
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = copy.deepcopy(v)
    return base


def resume_config(run_dir: str | Path, config_file: str | Path | None, overrides: list[str], *,
                  force: bool = False, force_settings: bool = False,
                  force_data: bool = False) -> tuple[Config, list[tuple[str, Any, Any]]]:
    """The config of a resumed run: `run_dir`/config.yaml, then `config_file`'s values, then `overrides`.
    Returns it and what changed; ConfigError naming every pinned key that changed and the flag it takes
    (`force_settings` accepts PINNED_STATE changes, `force_data` PINNED_DATA ones, `force` both)."""
    saved_path = Path(run_dir) / "config.yaml"
    saved = _migrate_renamed_keys(_migrate_moved_keys(read_config_file(saved_path)))
    old = config_from_tree(copy.deepcopy(saved), str(saved_path))
    tree = copy.deepcopy(saved)
    source = str(saved_path)
    if config_file is not None:
        _merge(tree, read_config_file(config_file))
        source += f" + {config_file}"
    apply_overrides(tree, overrides)
    new = config_from_tree(tree, source + (" + overrides" if overrides else ""))
    changes = config_changes(old, new)
    allowed = {"settings": force or force_settings, "data": force or force_data}
    pinned = [(k, a, b, kind) for k, a, b in changes if (kind := pin_kind(k)) is not None and not allowed[kind]]
    if pinned:
        lines = "\n  ".join(f"{k}: {a!r} -> {b!r} (--force-{kind})" for k, a, b, kind in pinned)
        raise ConfigError(
            f"{run_dir} holds a run whose checkpoints were made with other settings; these arguments change "
            f"state it carries (the model, the optimizer's moments, the data position):\n  {lines}\n"
            "drop them to resume the run as it was, pass the flag named to resume with them anyway (--force: "
            "both; the old config is kept as config.prev.yaml), or give a new --run-dir for a new run")
    return new, changes
