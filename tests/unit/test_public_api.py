"""`agentloop.__all__` both ways: every name the docstring documents is exported, and nothing is
exported that is not documented; plus the folder APIs plugins import from (loops, tools, train)."""

from __future__ import annotations

import importlib
import inspect
import re
import types
from pathlib import Path

import pytest

import agentloop

README = Path(__file__).resolve().parents[2] / "README.md"


def documented() -> set[str]:
    block = agentloop.__doc__.split("Public API", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", block.split("\n", 1)[1]))


def test_all_is_exactly_the_documented_api():
    assert set(agentloop.__all__) == documented()
    assert len(agentloop.__all__) == len(set(agentloop.__all__))


def test_every_exported_name_resolves_to_a_class_or_function():
    for name in agentloop.__all__:
        obj = getattr(agentloop, name)
        assert inspect.isclass(obj) or inspect.isfunction(obj), f"{name} is {type(obj).__name__}"


def test_nothing_public_is_exported_outside_all():
    public = {n for n, v in vars(agentloop).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert public == set(agentloop.__all__)


def test_readme_documents_every_exported_name():
    text = README.read_text()
    missing = [n for n in agentloop.__all__ if n not in text]
    assert missing == []


@pytest.mark.parametrize("pkg", ["agentloop.loops", "agentloop.tools", "agentloop.train", "agentloop.rewards",
                                 "agentloop.data"])
def test_folder_apis_import_every_name(pkg):
    mod = importlib.import_module(pkg)
    for name in mod.__all__:
        obj = getattr(mod, name)  # agentloop.train resolves lazily: this imports the defining module
        assert obj is not None, f"{pkg}.{name}"


def test_exported_registry_round_trip():
    class Probe(agentloop.AgentLoopBase):
        async def run(self, sample, sampling_params):  # pragma: no cover - never run
            raise NotImplementedError

    agentloop.register_agent_loop("public_api_probe_loop", Probe)
    assert agentloop.get_agent_loop("public_api_probe_loop") is Probe
    assert agentloop.load_config(None, ["rollout.loop=public_api_probe_loop"]).rollout.loop == "public_api_probe_loop"
