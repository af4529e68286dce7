"""The README and every page under docs/, read as a user reads them: each `agentloop` command of their ```bash
blocks is accepted by the CLI's own parser and its settings (`--config` file, flags, `key.sub=value`) load into
the config tree as that command would load them; every repository file a command names exists; every ```python
block compiles; every relative link (and its #anchor) resolves; the README's map lists every page once.

Nothing is started: servers, learners and data sets are the integration tests' (and GPU acceptance's) business.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

from agentloop.cli import TRAIN_PRESET, _env_overrides, _flag_overrides, _value_options, make_parser, overrides_last
from agentloop.config import load_config

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
REPO_DIRS = ("scripts/", "benchmarks/", "configs/", "examples/", "agentloop/", "tests/", "docs/", ".ci/")


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(page: Path, lang: str) -> list[tuple[int, str]]:
    """(first line number, text) of each ```lang block."""
    out, start, lines = [], None, page.read_text().split("\n")
    for i, line in enumerate(lines):
        if start is None and line.strip() == f"```{lang}":
            start = i + 1
        elif start is not None and line.strip() == "```":
            out.append((start + 1, "\n".join(lines[start:i]) + "\n"))
            start = None
    return out


def commands(page: Path) -> list[tuple[str, list[str]]]:
    """Every simple command of the page's bash blocks, as argv, with its place (`page:line`): continuations
    joined, comments dropped, split at `&&`, `&`, `|`, `;`, leading `VAR=value` assignments dropped."""
    out = []
    for first, text in blocks(page, "bash"):
        lineno, pending, pending_at = first, "", first
        for line in text.split("\n"):
            if not pending:
                pending_at = lineno
            lineno += 1
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            lex = shlex.shlex(pending + line, posix=True, punctuation_chars="();|&")
            lex.whitespace_split, lex.commenters = True, "#"
            pending, argv = "", []
            for tok in [*lex, ";"]:
                if tok in ("&&", "&", "|", "||", ";"):
                    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
                        argv.pop(0)
                    if argv:
                        out.append((f"{_name(page)}:{pending_at}", argv))
                    argv = []
                else:
                    argv.append(tok)
    return out


def agentloop_commands() -> list[tuple[str, list[str]]]:
    return [(at, argv) for page in PAGES for at, argv in commands(page)
            if argv[0] in ("agentloop", ".venv/bin/agentloop")]


def test_the_readme_keeps_the_two_commands_and_maps_every_page_once():
    text = README.read_text()
    assert "bash scripts/run.sh" in text and "bash scripts/test.sh" in text
    mapped = re.findall(r"^- \[docs/([\w.-]+\.md)\]\(docs/\1\): \S", text, flags=re.M)
    assert sorted(mapped) == sorted(p.name for p in PAGES[1:]), "the README's map: one line per docs/ page"


def test_every_page_has_commands_and_the_parser_sees_them():
    """The extraction itself: each page with a bash block yields commands, and the README's main-job and test
    commands are among them (a parse that found nothing would pass every test below)."""
    found = {(at.split(":")[0], tuple(argv)) for page in PAGES for at, argv in commands(page)}
    assert ("README.md", ("bash", "scripts/run.sh")) in found and ("README.md", ("bash", "scripts/test.sh")) in found
    for page in PAGES:
        assert not blocks(page, "bash") or commands(page), _name(page)
    assert len(agentloop_commands()) >= 80


@pytest.mark.parametrize("at,argv", agentloop_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_agentloop_command_parses_and_its_settings_load(at, argv):
    parser = make_parser()
    tokens = [t for t in argv[1:] if t != "..."]  # `agentloop train --dry-run ... key=value`: the line above's flags
    try:
        args = parser.parse_args(overrides_last(tokens, _value_options(parser)))
    except SystemExit:
        pytest.fail(f"{at}: the CLI refuses `{shlex.join(argv)}`")
    if not hasattr(args, "overrides"):
        return
    if args.command not in ("rollout", "train") and getattr(args, "bench", None) is None:
        return
    config = args.config or (ROOT / "agentloop" / TRAIN_PRESET if args.command == "train" else None)
    if config is not None and not Path(config).is_absolute():
        config = ROOT / config
        assert config.is_file(), f"{at}: no such config file {args.config}"
    overrides = _env_overrides(args) + list(args.overrides) + _flag_overrides(args)
    load_config(config, overrides)  # unknown keys and bad values raise, naming the key


def _repo_paths(argv: list[str]) -> list[str]:
    out = []
    for tok in argv:
        for part in [tok, tok.split("=", 1)[-1], *tok.split()]:
            part = part.split(":")[0] if re.match(r"^[\w./-]+\.py:\w+$", part) else part  # file.py:function
            if part.startswith(REPO_DIRS) and "<" not in part and "*" not in part:
                out.append(part)
    return out


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_repository_file_a_command_names_exists(page):
    missing = [(at, p) for at, argv in commands(page) for p in _repo_paths(argv) if not (ROOT / p).exists()]
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_python_block_compiles(page):
    for first, code in blocks(page, "python"):
        try:
            ast.parse(code)
        except SyntaxError as e:
            pytest.fail(f"{_name(page)}:{first + (e.lineno or 1) - 1}: {e.msg}")


def test_the_agent_example_is_the_shipped_file_wherever_it_is_shown():
    example = (ROOT / "examples" / "calculator_agent.py").read_text()
    for page in (README, ROOT / "docs" / "gateway.md"):
        text = page.read_text()
        section = text[text.index("## Bring your own agent"):]
        code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
        assert code in example, f"{_name(page)}: the example is no longer examples/calculator_agent.py"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings (outside code blocks)."""
    out, fence = set(), False
    for line in page.read_text().split("\n"):
        fence ^= line.startswith("```")
        if not fence and (m := re.match(r"^#{1,6} (.*)", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+://|^mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(target)
    assert bad == [], f"{_name(page)}: links that lead nowhere"
