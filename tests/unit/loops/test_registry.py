"""Agent-loop registry: register/get, decorator form, duplicates, plugins by file, module and entry point."""

from __future__ import annotations

import sys
import textwrap

import pytest

from agentloop import AgentLoopBase, get_agent_loop, register_agent_loop
from agentloop.errors import ConfigError
from agentloop.loops import list_agent_loops, load_plugin, registry


class _Loop(AgentLoopBase):
    async def run(self, sample, sampling_params):  # pragma: no cover - never run here
        raise NotImplementedError


def test_builtin_single_turn_registered():
    assert get_agent_loop("single_turn_agent_loop").__name__ == "SingleTurnAgentLoop"


def test_register_function_and_decorator():
    register_agent_loop("t_fn", _Loop)
    assert get_agent_loop("t_fn") is _Loop

    @register_agent_loop("t_deco")
    class Deco(_Loop):
        pass

    assert get_agent_loop("t_deco") is Deco and Deco.name == "t_deco"


def test_duplicate_name_needs_override():
    class A(_Loop):
        pass

    class B(_Loop):
        pass

    register_agent_loop("t_dup", A)
    register_agent_loop("t_dup", A)  # same class again: harmless
    with pytest.raises(ConfigError, match="already registered"):
        register_agent_loop("t_dup", B)
    register_agent_loop("t_dup", B, override=True)
    assert get_agent_loop("t_dup") is B


def test_non_loop_rejected_and_unknown_named():
    with pytest.raises(ConfigError, match="not a subclass"):
        register_agent_loop("t_bad", dict)
    with pytest.raises(ConfigError, match="unknown agent loop 'nope'.*single_turn_agent_loop"):
        get_agent_loop("nope")


def test_plugin_from_file(tmp_path):
    p = tmp_path / "myplug.py"
    p.write_text(textwrap.dedent("""
        from agentloop import AgentLoopBase, register_agent_loop

        @register_agent_loop("t_file_loop")
        class FileLoop(AgentLoopBase):
            async def run(self, sample, sampling_params):
                raise NotImplementedError
    """))
    load_plugin(str(p))
    load_plugin(str(p))  # idempotent
    assert get_agent_loop("t_file_loop").__name__ == "FileLoop"
    with pytest.raises(ConfigError, match="does not exist"):
        load_plugin(str(tmp_path / "missing.py"))
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="failed to import: RuntimeError: boom"):
        load_plugin(str(bad))


def test_plugin_from_module(tmp_path, monkeypatch):
    (tmp_path / "t_modplug.py").write_text(textwrap.dedent("""
        from agentloop import AgentLoopBase, register_agent_loop

        class ModLoop(AgentLoopBase):
            async def run(self, sample, sampling_params):
                raise NotImplementedError

        register_agent_loop("t_mod_loop", ModLoop)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    load_plugin("t_modplug")
    assert get_agent_loop("t_mod_loop").__name__ == "ModLoop"
    with pytest.raises(ConfigError, match="cannot be imported"):
        load_plugin("t_no_such_module_xyz")


def test_plugin_from_entry_point(tmp_path, monkeypatch):
    (tmp_path / "t_epplug.py").write_text(textwrap.dedent("""
        from agentloop import AgentLoopBase

        class EpLoop(AgentLoopBase):
            async def run(self, sample, sampling_params):
                raise NotImplementedError
    """))
    dist = tmp_path / "t_epplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: t-epplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[agentloop.loops]\nt_ep_loop = t_epplug:EpLoop\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_ENTRY_POINTS_LOADED", False)
    assert get_agent_loop("t_ep_loop").__name__ == "EpLoop"
    assert "t_ep_loop" in list_agent_loops()
    sys.modules.pop("t_epplug", None)
