"""`agentloop train --dry-run` through the CLI, and the same preflight at the start of `agentloop train`
(agentloop.train.planning.preflight): every check reports one line; a wrong data_source, a missing chat template, a model
the learner cannot run, a template that is not append-only, rows calling unknown tools, prompts longer than the
context and a GPU too small each fail naming the cause; on a GPU (here: planned for with cluster.*) the unset keys
are sized to the machine and the set ones kept; on CPU nothing changes. The model directories here hold a config
and a tokenizer only: the preflight never reads weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agentloop.cli import main
from agentloop.config import load_config
from agentloop.errors import ConfigError
from agentloop.models.modelzoo import ensure_tiny_model, shape_config
from agentloop.train.orchestrator.loop import prepare_train, run_train
from agentloop.train.planning import inventory, render

RECIPE = str(Path(__file__).resolve().parents[3] / "configs" / "recipe_gsm8k.yaml")


def _model_dir(root: Path, name: str, *, template: str | None | bool = True, **config: object) -> Path:
    """A 0.5B-shaped model directory without weights: config.json and the tiny model's tokenizer."""
    tiny = ensure_tiny_model()
    d = root / name
    d.mkdir()
    tc = json.loads((tiny / "config.json").read_text())
    c = shape_config("qwen2.5-0.5b-shape", bos_token_id=tc["bos_token_id"], eos_token_id=tc["eos_token_id"],
                     pad_token_id=tc["pad_token_id"]).to_dict()
    c.update(architectures=["Qwen2ForCausalLM"], **config)
    (d / "config.json").write_text(json.dumps(c))
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, d / f.name)
    if template is not True:
        tok = json.loads((d / "tokenizer_config.json").read_text())
        tok.pop("chat_template", None)
        if template:
            tok["chat_template"] = template
        (d / "tokenizer_config.json").write_text(json.dumps(tok))
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    # a template that writes the number of messages first: each new message rewrites the text before it
    counting = ("{{ messages | length }}\n{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return {"shape": _model_dir(root, "shape"), "base": _model_dir(root, "base", template=None),
            "softcap": _model_dir(root, "softcap", attn_logit_softcapping=50.0),
            "counting": _model_dir(root, "counting", template=counting)}


def _gsm8k_rows(n: int, *, source: str = "openai/gsm8k") -> list[dict]:
    return [{"data_source": source, "ability": "math",
             "prompt": [{"role": "user", "content": f"Ann has {i} apples and buys {i + 3} more. How many does she "
                                                    "have? Let's think step by step and output the final answer "
                                                    "after \"####\"."}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i + 3)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture()
def gsm8k(tmp_path) -> tuple[Path, Path]:
    return _write(tmp_path / "train.jsonl", _gsm8k_rows(60)), _write(tmp_path / "test.jsonl", _gsm8k_rows(10))


UNSANDBOXED = "tools.python.allow_unisolated=true"  # the sandbox check is not under test (a worktree's venv path)


def _dry(model: Path, data: tuple[Path, Path], *extra: str, config: str | None = RECIPE) -> list[str]:
    argv = ["train", "--dry-run", "--model", str(model), "--data", str(data[0]), "--val-data", str(data[1])]
    return argv[:2] + (["--config", config] if config else []) + argv[2:] + [UNSANDBOXED, *extra]


def test_dry_run_of_the_gsm8k_recipe_reports_every_check(models, gsm8k, capsys, tmp_path):
    assert main(_dry(models["shape"], gsm8k, f"runs_dir={tmp_path / 'runs'}")) == 0
    out = capsys.readouterr().out
    for name in ("data", "rewards", "template", "prompts", "model", "tools", "memory"):
        assert any(line.startswith(f"  ok    {name}") for line in out.splitlines()), (name, out)
    assert "60 training rows" in out and "validation: 10 rows" in out
    assert "openai/gsm8k (70 rows): agentloop.rewards.verl_gsm8k" in out
    assert "qwen2 (494M parameters, 24 layers)" in out
    assert "CPU run: nothing to plan" in out and "plan:" not in out  # no GPU here, none planned for
    assert "all 7 checks passed" in out
    assert not (tmp_path / "runs").exists()  # nothing started, no run directory


def test_a_data_source_without_a_reward_fails_naming_it_and_its_rows(models, tmp_path, capsys):
    rows = _gsm8k_rows(40)
    for r in rows[5::10]:
        r["data_source"] = "my/gsm8k_variant"
    data = (_write(tmp_path / "train.jsonl", rows), _write(tmp_path / "test.jsonl", _gsm8k_rows(5)))
    assert main(_dry(models["shape"], data)) == 2
    captured = capsys.readouterr()
    assert "FAIL  rewards   no reward for data_source 'my/gsm8k_variant'" in captured.out
    assert f"4 rows, first: training row 5 of {data[0]}" in captured.out
    assert "reward.default" in captured.err and "reward.custom" in captured.err
    # reward.default covers it
    assert main(_dry(models["shape"], data, "reward.default=openai/gsm8k")) == 0
    assert "my/gsm8k_variant (4 rows): agentloop.rewards.verl_gsm8k.compute_score (reward.default)" in \
        capsys.readouterr().out


def test_a_tokenizer_without_a_chat_template(models, gsm8k, capsys):
    assert main(_dry(models["base"], gsm8k)) == 2
    out = capsys.readouterr().out
    assert "FAIL  template  tokenizer at" in out and "has no chat_template" in out
    assert "model.tokenizer_path" in out and "data.apply_chat_template=false" in out
    # a base model whose rows are sent as written: fine
    assert main(_dry(models["base"], gsm8k, "data.apply_chat_template=false")) == 0
    assert "ok    template  not used: data.apply_chat_template=false" in capsys.readouterr().out


def test_a_model_the_learner_cannot_run_exactly(models, gsm8k, capsys):
    assert main(_dry(models["softcap"], gsm8k)) == 2
    out = capsys.readouterr().out
    assert "FAIL  model     the learner cannot run" in out and "attn_logit_softcapping=50" in out


def test_a_gpu_too_small_for_the_plan(models, gsm8k, capsys):
    assert main(_dry(models["shape"], gsm8k, "cluster.gpu_memory_gib=8")) == 2
    captured = capsys.readouterr()
    assert "FAIL  memory    the plan for 1 GPU of 8 GiB" in captured.out
    assert "GPU 0 (8.0 GiB)" in captured.err and "short" in captured.err and "a smaller model" in captured.err
    # the recipe's own 80 GiB plan fits
    assert main(_dry(models["shape"], gsm8k, "cluster.gpu_memory_gib=80")) == 0
    out = capsys.readouterr().out
    assert "ok    memory    fits 1 GPU of 80 GiB" in out and "plan: 1 GPU of 80 GiB" in out
    assert "server.mem_fraction_static       0.6        (set)" in out  # the recipe's own value, kept


def test_a_template_that_is_not_append_only(models, gsm8k, capsys):
    # tool_agent_loop relies on it: an error; a single-turn loop does not: a warning
    assert main(_dry(models["counting"], gsm8k, "rollout.loop=tool_agent_loop")) == 2
    out = capsys.readouterr().out
    assert "FAIL  template  training row 0 of" in out and "not append-only" in out
    assert main(_dry(models["counting"], gsm8k)) == 0
    assert "warn  template" in capsys.readouterr().out


def test_a_real_multi_turn_row_is_rendered_prefix_by_prefix(models, tmp_path, capsys):
    rows = _gsm8k_rows(20)
    rows[7]["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
                         {"role": "assistant", "content": "2"}, {"role": "user", "content": "And 2+2?"}]
    data = (_write(tmp_path / "train.jsonl", rows), _write(tmp_path / "test.jsonl", _gsm8k_rows(3)))
    assert main(_dry(models["shape"], data)) == 0
    out = capsys.readouterr().out
    assert f"ok    template  training row 7 of {data[0]} (4 messages): 3 renderings" in out


def test_rows_calling_an_unknown_tool(models, gsm8k, tmp_path, capsys):
    rows = _gsm8k_rows(20)
    rows[3]["extra_info"]["tools_kwargs"] = {"web_browser": {"create_kwargs": {}}}
    data = (_write(tmp_path / "train.jsonl", rows), gsm8k[1])
    assert main(_dry(models["shape"], data, "rollout.loop=tool_agent_loop", "tools.names=[calculator]")) == 2
    out = capsys.readouterr().out
    assert "FAIL  tools     1 tool set(s) cannot be built" in out
    assert f"training row 3 of {data[0]}" in out and "unknown tool 'web_browser'" in out


def test_tools_each_row_is_offered(models, gsm8k, capsys):
    assert main(_dry(models["shape"], gsm8k, "rollout.loop=tool_agent_loop", "tools.names=[calculator]")) == 0
    assert "ok    tools     calculator: 70 rows" in capsys.readouterr().out


def test_a_verl_tool_config_is_offered_to_every_row(models, gsm8k, tmp_path, capsys):
    from tests.unit.tools.test_verl_tools import SEARCH_TOOL_CONFIG

    tools = tmp_path / "search_tool_config.yaml"
    tools.write_text(SEARCH_TOOL_CONFIG.format(url="http://127.0.0.1:8000/retrieve"))
    assert main(_dry(models["shape"], gsm8k, "rollout.loop=tool_agent_loop", f"tools.verl_tool_config={tools}")) == 0
    out = capsys.readouterr().out
    assert "ok    tools     search: 70 rows" in out  # verl's search, not the built-in one the rows do not name


def test_prompts_longer_than_the_context(models, tmp_path, capsys):
    rows = _gsm8k_rows(20)
    rows[11]["prompt"][0]["content"] += " Again." * 80
    data = (_write(tmp_path / "train.jsonl", rows), _write(tmp_path / "test.jsonl", _gsm8k_rows(3)))
    assert main(_dry(models["shape"], data, "model.context_length=128")) == 2
    out = capsys.readouterr().out
    assert "FAIL  prompts   1 of the 23 longest prompts leave no room to answer in the context of 128 tokens" in out
    assert f"training row 11 of {data[0]}" in out


def test_bad_rows_and_the_held_out_rule(models, tmp_path, capsys):
    rows = _gsm8k_rows(20)
    rows[4]["reward_model"]["ground_truth"] = 11  # verl compares strings: never matches
    data = (_write(tmp_path / "train.jsonl", rows), _write(tmp_path / "test.jsonl", _gsm8k_rows(3)))
    assert main(_dry(models["shape"], data)) == 2
    out = capsys.readouterr().out
    assert "FAIL  data      1 error(s) in the rows" in out and f"{data[0]}:5: ground truth 11 is a int" in out
    good = _write(tmp_path / "good.jsonl", _gsm8k_rows(20))
    assert main(["train", "--dry-run", "--config", RECIPE, "--model", str(models["shape"]), "--data", str(good),
                 "data.val_path=null", "data.val_holdout=20", UNSANDBOXED]) == 2
    assert "data.val_holdout=20 holds out every one of the 20 training rows" in capsys.readouterr().out


def _cfg(model: Path, data: tuple[Path, Path], *overrides: str, config: str | None = None):
    return load_config(config, [f"model.path={model}", f"data.path={data[0]}", f"data.val_path={data[1]}",
                                UNSANDBOXED, *overrides])


def test_on_a_gpu_the_unset_keys_are_sized_and_the_set_ones_kept(models, gsm8k):
    cfg = _cfg(models["shape"], gsm8k, "cluster.gpu_memory_gib=80", "learner.micro_batch_tokens=16384",
               "manager.request_timeout_s=900")
    _, pre = prepare_train(cfg, dry_run=True)
    assert not pre.failed, pre.lines()
    p = pre.plan
    assert cfg.server.max_total_tokens is None  # the KV pool from free memory, not the CPU box's 16384
    assert cfg.server.mem_fraction_static == p.mem_fraction_static and 0 < p.mem_fraction_static < 0.6
    assert cfg.learner.weight_sync == "tensor"  # one GPU: colocated
    assert cfg.sampling.max_new_tokens == 4096  # min(4096, 32768 - the longest prompt)
    assert cfg.manager.max_inflight_per_server == p.max_inflight_per_server
    # the async window's episodes (2 x 16 prompts x 4 samples) all in flight: the KV pool holds them
    assert cfg.rollout.max_concurrency == 128 == p.max_inflight_per_server
    assert cfg.manager.request_timeout_s == 900  # set: kept
    shown = "\n".join(pre.lines())
    assert "manager.request_timeout_s        900.0      (set)" in shown
    assert "learner.weight_sync              tensor     (derived: CUDA IPC: colocated)" in shown
    # the plan's numbers travel with the run
    assert pre.record["server_mem_fraction"] == p.mem_fraction_static
    assert pre.record["learner_peak_gib"] == pytest.approx(p.learner.peak, abs=1e-3)


def test_two_gpus_place_learner_and_server_apart(models, gsm8k):
    cfg = _cfg(models["shape"], gsm8k, "cluster.gpu_memory_gib=80", "cluster.num_gpus=2")
    prepare_train(cfg, dry_run=True)
    assert cfg.server.gpus == [1] and cfg.learner.weight_sync == "nccl"
    assert cfg.learner.gpus is None  # rank 0 on GPU 0 as it is
    assert cfg.server.mem_fraction_static is None and cfg.server.max_total_tokens is None


@pytest.mark.parametrize("colocate,want", [(False, "nccl"), (True, "tensor")])
def test_ray_with_learner_gpus_pushes_weights_gpu_to_gpu(models, gsm8k, colocate, want):
    """cluster.backend=ray where the learner has GPUs: NCCL broadcast to the servers' GPUs (CUDA IPC when
    colocated), never disk copies through the object store each step; Ray places the actors, so no GPU lists."""
    extra = ["cluster.colocate=true"] if colocate else []
    cfg = _cfg(models["shape"], gsm8k, "cluster.gpu_memory_gib=80", "cluster.num_gpus=2", "cluster.backend=ray",
               *extra)
    prepare_train(cfg, dry_run=True)
    assert cfg.learner.weight_sync == want
    assert cfg.server.gpus is None and cfg.learner.gpus is None


def test_on_cpu_nothing_is_derived(models, gsm8k):
    cfg = _cfg(models["shape"], gsm8k)
    before = cfg.model_dump()
    _, pre = prepare_train(cfg, dry_run=True)
    assert not pre.failed and pre.plan is None and pre.record == {}
    after = cfg.model_dump()
    for section in ("server", "manager", "sampling", "rollout"):
        assert after[section] == before[section]
    assert after["learner"]["weight_sync"] == "disk" and after["learner"]["gpus"] is None


def test_a_real_run_planned_for_absent_gpus_is_refused(models, gsm8k, tmp_path):
    cfg = _cfg(models["shape"], gsm8k, "cluster.gpu_memory_gib=80", f"runs_dir={tmp_path / 'runs'}")
    with pytest.raises(ConfigError, match="none is visible here: this run would run on CPU.*--dry-run"):
        run_train(cfg)
    assert not (tmp_path / "runs").exists()


def test_a_failing_check_stops_agentloop_train_before_anything_starts(models, tmp_path, capsys):
    rows = _gsm8k_rows(20, source="nobody/knows")
    data = _write(tmp_path / "train.jsonl", rows)
    code = main(["train", "--config", RECIPE, "--model", str(models["shape"]), "--data", str(data),
                 "data.val_path=null", f"runs_dir={tmp_path / 'runs'}", UNSANDBOXED])
    assert code == 2
    err = capsys.readouterr().err
    assert "agentloop train: preflight" in err and "FAIL  rewards" in err and "'nobody/knows'" in err
    assert not (tmp_path / "runs").exists()


def test_gpu_inventory_without_a_gpu_device(monkeypatch, tmp_path):
    assert inventory.gpu_inventory(dev=tmp_path) == []  # no device node: torch is not even asked
    (tmp_path / "nvidia0").touch()
    # a device node: torch is asked in a child process (none visible to it here)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert inventory.gpu_inventory(dev=tmp_path) == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert inventory.gpu_inventory(dev=tmp_path) == []


def test_the_machine_planned_for(models, gsm8k):
    h100 = [{"name": "NVIDIA H100 80GB HBM3", "total": 85_000_000_000, "free": 84_000_000_000}]
    cfg = _cfg(models["shape"], gsm8k)
    gib, said = inventory.machine_for(cfg, h100, dry_run=False)
    assert gib == [pytest.approx(84e9 / 2**30)] and "1 x NVIDIA H100 80GB HBM3" in said
    cfg = _cfg(models["shape"], gsm8k, "cluster.gpu_memory_gib=40")
    assert inventory.machine_for(cfg, h100, dry_run=False)[0] == [40.0]
    cfg = _cfg(models["shape"], gsm8k, "cluster.num_gpus=2")
    with pytest.raises(ConfigError, match="cluster.num_gpus=2 but 1 GPU"):
        inventory.machine_for(cfg, h100, dry_run=False)
    assert inventory.machine_for(cfg, h100, dry_run=True)[0] == [pytest.approx(84e9 / 2**30)] * 2
    assert inventory.machine_for(_cfg(models["shape"], gsm8k, "server.device=cpu", "learner.device=cpu"), h100,
                                 dry_run=False) == ([], "")


def test_plan_summary_puts_the_measured_peak_next_to_the_plan(tmp_path):
    assert render.plan_summary(tmp_path, [], []) is None  # a CPU run made no plan
    (tmp_path / "plan.json").write_text(json.dumps({"learner_peak_gib": 40.9, "server_kv_tokens": 1000}))
    rows = [{"step": 1.0, "learner/perf/peak_memory_gib": 39.0, "learner/perf/peak_reserved_gib": 44.0},
            {"step": 2.0, "learner/perf/peak_memory_gib": 40.2}]
    out = render.plan_summary(tmp_path, rows, [1200])
    assert out["learner_peak_gib"] == 40.9
    assert out["measured"] == {"learner_peak_gib": 40.2, "learner_reserved_gib": 44.0, "server_kv_tokens": [1200]}
    assert render.find_key({"a": [{"b": 1}, {"internal_states": [{"max_total_num_tokens": 7}]}]},
                              "max_total_num_tokens") == 7


def test_a_failure_score_above_the_rewards_floor_is_said(models, gsm8k, capsys):
    """gsm8k's reward gives 0 to a wrong (empty) answer: a failure_score of 0.5 rewards failing over answering."""
    assert main(_dry(models["shape"], gsm8k, "reward.failure_score=0.5")) == 0
    out = capsys.readouterr().out
    assert "warn  rewards" in out and "reward.failure_score=0.5 is above the lowest score the reward gives" in out
    assert "openai/gsm8k: the reward's floor is 0" in out
    assert main(_dry(models["shape"], gsm8k, "reward.failure_score=0.0")) == 0
    assert "ok    rewards" in capsys.readouterr().out


def test_a_custom_rewards_floor_is_what_it_declares_and_it_is_never_called(models, gsm8k, capsys, tmp_path):
    """A custom reward is not probed (it may count its calls or cost money): its `floor` attribute is the floor."""
    reward = tmp_path / "reward.py"
    calls = tmp_path / "calls"
    reward.write_text(f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      f"    open({str(calls)!r}, 'a').write('x')\n"
                      "    return -1.0 if not solution_str else 1.0\n"
                      "compute_score.floor = -1.0\n")
    assert main(_dry(models["shape"], gsm8k, f"reward.custom={reward}:compute_score")) == 0
    out = capsys.readouterr().out
    assert "reward.failure_score=0 is above the lowest score the reward gives" in out
    assert "the reward's floor is -1" in out and not calls.exists()
