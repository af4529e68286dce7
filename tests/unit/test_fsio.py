"""agentloop.util.fsio.replace_dir: a directory replaced in place is there at every moment, old or new, never
missing (a resumed run's learner replaces weight directories a server may still serve, while the run reads them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agentloop.train.orchestrator.served_model import weights_fingerprint
from agentloop.util import fsio


def _dir(root: Path, name: str, content: str) -> Path:
    d = root / name
    d.mkdir()
    (d / "model.safetensors").write_text(content)
    return d


def test_replacing_a_directory_never_leaves_its_place_empty(tmp_path, monkeypatch):
    path = _dir(tmp_path, "step-000008", "old")
    tmp = _dir(tmp_path, ".step-000008.tmp-1", "new")
    seen = []
    rmtree = shutil.rmtree

    def watching_rmtree(p, *a, **kw):  # the old copy goes only once the new one is in place
        seen.append((path / "model.safetensors").read_text())
        rmtree(p, *a, **kw)

    monkeypatch.setattr(fsio.shutil, "rmtree", watching_rmtree)
    fsio.replace_dir(tmp, path)
    assert seen == ["new"]
    assert (path / "model.safetensors").read_text() == "new" and not tmp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000008"]


def test_a_new_directory_is_put_in_place(tmp_path):
    tmp = _dir(tmp_path, ".x.tmp", "new")
    fsio.replace_dir(tmp, tmp_path / "x")
    assert (tmp_path / "x" / "model.safetensors").read_text() == "new" and not tmp.exists()


def test_without_an_atomic_swap_the_old_directory_still_goes(tmp_path, monkeypatch):
    monkeypatch.setattr(fsio, "_exchange", lambda a, b: False)
    path = _dir(tmp_path, "x", "old")
    fsio.replace_dir(_dir(tmp_path, ".x.tmp", "new"), path)
    assert (path / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_a_weight_directory_gone_while_read_has_no_fingerprint(tmp_path):
    d = _dir(tmp_path, "w", "weights")
    assert weights_fingerprint(d) is not None
    shutil.rmtree(d)
    assert weights_fingerprint(d) is None


@pytest.mark.parametrize("missing", [True, False])
def test_exchange_reports_whether_it_swapped(tmp_path, missing):
    a = _dir(tmp_path, "a", "A")
    b = tmp_path / "b" if missing else _dir(tmp_path, "b", "B")
    assert fsio._exchange(a, b) is (not missing)
    if not missing:
        assert (a / "model.safetensors").read_text() == "B" and (b / "model.safetensors").read_text() == "A"
