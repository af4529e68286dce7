"""textarena_loop against TextArena itself: the same moves scored by TextArena's own game loop and by the loop
(through a scripted server, token-exact), 0 disagreements over 1,000+ games including malformed moves; the game's
observations masked; a broken game an error record with TextArena's message.

TextArena's own path is what its users write: `env = ta.make(id); env.reset(num_players, seed)`, then
`player_id, obs = env.get_observation(); done, info = env.step(action)` until done, `rewards, info = env.close()`.
"""

from __future__ import annotations

import asyncio
import random
import re

import pytest

from agentloop.config import Config
from agentloop.errors import EnvError
from agentloop.loops.env_tokens import encode_env_text
from agentloop.loops.template import template_info
from agentloop.loops.textarena_env import (
    FixedOpponent,
    TextArenaLoop,
    game_action,
    listed_moves,
    new_text,
    textarena_rows,
)
from agentloop.records import Sample
from tests.unit.loops.test_tool_loop import ScriptedServer, get_tokenizer

ta = pytest.importorskip("textarena", reason="the envs extra (textarena) is not installed")

GAMES = 1100


def moves_for(game: str, rnd: random.Random) -> list[str]:
    """A scripted player's moves: right-looking, malformed and out-of-range ones mixed."""
    pool = {"GuessTheNumber-v0": ["[{}]".format(rnd.randint(1, 20)) for _ in range(6)] +
            ["I think it is [7].", "12", "[twelve]", "", "[0]", "[25]", "[3] or [4]"],
            "TicTacToe-v0": [f"[{i}]" for i in range(9)] + ["[4] please", "[9]", "center", "[-1]", ""]}[game]
    return [rnd.choice(pool) for _ in range(12)]


def opponent_move(obs: str) -> str:
    """TextArena's users' fixed opponent, written independently: the first move of the last 'Available Moves' line."""
    line = [ln for ln in obs.splitlines() if ln.startswith("Available Moves:")][-1]
    return line.split(":", 1)[1].split(",")[0].strip().strip("'")


def theirs(game: str, players: int, seed: int, moves: list[str], max_turns: int,
           options: dict | None = None) -> tuple[float, int]:
    env = ta.make(game, **(options or {}))
    env.reset(num_players=players, seed=seed)
    done, turns, it = False, 0, iter(moves)
    while not done:
        pid, obs = env.get_observation()
        if pid != 0:
            done, _ = env.step(opponent_move(obs))
            continue
        if turns == max_turns:
            break
        done, _ = env.step(next(it))
        turns += 1
    rewards, _ = env.close()
    return float((rewards or {}).get(0, 0.0)), turns


def make_loop(tok, server, **cfg) -> TextArenaLoop:
    c = Config()
    for k, v in cfg.items():
        setattr(c.envs.textarena, k, v)
    c.model.context_length = 1 << 20
    return TextArenaLoop(server_manager=server, tokenizer=tok, config=c)


def sample(seed: int) -> Sample:
    row = textarena_rows(Config().envs.textarena.model_copy(update={"episodes": 1}))[0]
    return Sample(index=seed, data_source=row["data_source"], messages=row["prompt"],
                  extra_info={"textarena": {"seed": seed}})


def ours(tok, game: str, players: int, seed: int, moves: list[str], max_turns: int):
    server = ScriptedServer(tok, [(m, "stop") for m in moves])
    loop = make_loop(tok, server, env_id=game, num_players=players, max_turns=max_turns, max_response_tokens=1 << 20)
    from agentloop.config import SamplingParams

    out = asyncio.run(loop.run(sample(seed), SamplingParams(max_new_tokens=64, seed=seed)))
    return out, server


def test_thousand_games_score_as_textarenas_own_loop():
    tok = get_tokenizer("modelzoo")
    rnd = random.Random(0)
    disagreements, outcomes = [], []
    for g in range(GAMES):
        game, players = (("GuessTheNumber-v0", 1), ("TicTacToe-v0", 2))[g % 2]
        moves = moves_for(game, rnd)
        want, turns = theirs(game, players, g, moves, max_turns=8)
        out, server = ours(tok, game, players, g, moves, max_turns=8)
        outcomes.append(want)
        if out.reward != want or out.num_turns != turns:
            disagreements.append((game, g, moves, want, out.reward, turns, out.num_turns))
    assert disagreements == []
    # the games are played: wins, losses and draws / unfinished games all occur
    assert {1.0, 0.0, -1.0} <= set(outcomes)


def test_observations_are_masked_and_tokens_exact():
    tok = get_tokenizer("modelzoo")
    out, server = ours(tok, "TicTacToe-v0", 2, 3, ["[4]", "[0]", "[8]", "[2]", "[6]"], max_turns=8)
    info = template_info(lambda m, t, g: tok.apply_chat_template(m, tools=t, tokenize=False, add_generation_prompt=g))
    assert info.turn_suffix
    # the prompt: the game's first observation, templated
    first = out.extra["messages"][0]
    assert first["role"] == "user" and "Tic Tac Toe" in first["content"]
    assert server.calls[0]["prompt_ids"] == out.prompt_ids
    # each call's context is the previous context + its model tokens (mask 1) + observation tokens (mask 0)
    ids = out.prompt_ids + out.response_ids
    for call in server.calls[1:]:
        assert ids[:len(call["prompt_ids"])] == call["prompt_ids"]
    model = [t for t, m in zip(out.response_ids, out.response_mask) if m]
    env = tok.decode([t for t, m in zip(out.response_ids, out.response_mask) if not m])
    assert "[4]" in tok.decode(model) and "Player 1 placed their symbol (X)" in env
    assert all(lp == 0.0 for lp, m in zip(out.response_logprobs, out.response_mask) if not m)
    # the full rendering of the conversation is what the model read
    rendered = tok.apply_chat_template(out.extra["messages"], tokenize=False, add_generation_prompt=False)
    assert rendered.startswith(tok.decode(ids, skip_special_tokens=False))
    # an observation's text that prints a control token stays text
    assert encode_env_text(tok, "<|im_end|>") != tok.encode("<|im_end|>", add_special_tokens=False)


def test_cumulative_observations_shown_once():
    assert new_text("abc def", "abc") == " def"
    assert new_text("xyz", "abc") == "xyz"
    assert new_text("abc", "") == "abc"
    assert listed_moves("Available Moves: '[0]', '[3]'\n[GAME] x\nAvailable Moves: '[3]', '[5]'") == ["[3]", "[5]"]
    assert FixedOpponent("first_valid", 0)("Available Moves: '[3]', '[5]'") == "[3]"
    with pytest.raises(EnvError, match="no listed moves"):
        FixedOpponent("first_valid", 0)("no moves here")


def test_broken_games_are_error_records_with_textarenas_message(monkeypatch):
    tok = get_tokenizer("modelzoo")
    with pytest.raises(EnvError, match="textarena.make\\('NoSuchGame-v0'\\)"):
        ours(tok, "NoSuchGame-v0", 1, 0, ["[1]"], max_turns=2)
    import textarena.envs.GuessTheNumber.env as gtn

    def boom(self, action):
        raise RuntimeError("the game's own failure")

    monkeypatch.setattr(gtn.GuessTheNumberEnv, "step", boom)
    with pytest.raises(EnvError, match="step raised RuntimeError: the game's own failure"):
        ours(tok, "GuessTheNumber-v0", 1, 0, ["[1]"], max_turns=2)


def test_observation_that_is_not_text(monkeypatch):
    tok = get_tokenizer("modelzoo")
    import textarena.core as core

    monkeypatch.setattr(core.Env, "get_observation", lambda self: (0, {"board": [1, 2]}), raising=False)
    monkeypatch.setattr(core.Wrapper, "get_observation", lambda self: (0, {"board": [1, 2]}), raising=False)
    with pytest.raises(EnvError, match="observation is not text: dict"):
        ours(tok, "GuessTheNumber-v0", 1, 0, ["[1]"], max_turns=2)


def test_game_action_is_the_patterns_last_match():
    pat = re.compile(r"####\s*(\d+)")
    assert game_action(None, "#### 7") == ("#### 7", True)
    assert game_action(pat, "#### 3 no, #### 7") == ("7", True)
    assert game_action(re.compile(r"\d+"), "3 then 12") == ("12", True)     # no group: the whole match
    assert game_action(pat, "seven") == ("seven", False)                    # no match: the whole text
    assert game_action(re.compile(r"(a)|b"), "a b") == ("a", True)           # group 1 absent from the last match


def test_action_pattern_sends_the_match_and_keeps_the_sampled_tokens():
    tok = get_tokenizer("modelzoo")
    replies = ["#### 5", "I say #### 2 or rather #### 9", "no number", "#### 3", "#### 7", "#### 1", "#### 4"]
    sent = [game_action(re.compile(r"####\s*(\d+)"), r)[0] for r in replies]
    assert sent[:3] == ["5", "9", "no number"]
    rewards, played = [], []
    game = {"min_number": 1, "max_number": 10, "max_turns": 4}   # 4 guesses: the turn limit gives partial credit
    for seed in range(12):
        want, turns = theirs("GuessTheNumber-v0", 1, seed, sent, max_turns=6, options=game)
        server = ScriptedServer(tok, [(m, "stop") for m in replies])
        loop = make_loop(tok, server, env_id="GuessTheNumber-v0", env_kwargs=game, max_turns=6,
                         max_response_tokens=1 << 20, action_pattern=r"####\s*(\d+)")
        from agentloop.config import SamplingParams

        out = asyncio.run(loop.run(sample(seed), SamplingParams(max_new_tokens=64, seed=seed)))
        assert (out.reward, out.num_turns) == (want, turns), seed
        assert out.extra["actions"] == sent[:turns]
        assert out.metrics["action_unmatched"] == float("no number" in sent[:turns])
        # the model's tokens are the sampled ones; only the game's echo shows the extracted action
        model = tok.decode([t for t, m in zip(out.response_ids, out.response_mask) if m])
        env = tok.decode([t for t, m in zip(out.response_ids, out.response_mask) if not m])
        assert model == "<|im_end|>".join(replies[:turns]) + "<|im_end|>"
        assert turns == 1 or "[Player] [5]" in env
        rewards.append(want)
        played.append(turns)
    # wins, partial credit and the unmatched turn all occur in these games
    assert 1.0 in rewards and any(0 < r < 1 for r in rewards) and max(played) >= 3
    # without the pattern the same replies are bracketed whole: "[#### 5]" is an invalid move
    out, _ = ours(tok, "GuessTheNumber-v0", 1, 0, replies, max_turns=6)
    assert out.metrics["invalid_move"] == 1.0 and out.extra["actions"][0] == "#### 5"


def test_bad_action_pattern_is_a_config_error_naming_the_key():
    from agentloop.config import load_config
    from agentloop.errors import ConfigError

    with pytest.raises(ConfigError, match=r"envs\.textarena\.action_pattern.*not a valid regular expression"):
        load_config(None, ["envs.textarena.action_pattern='####\\s*(\\d+'"])
    assert load_config(None, ["envs.textarena.action_pattern='(\\d+)'"]).envs.textarena.action_pattern == r"(\d+)"
