"""textarena_loop: a TextArena game (`textarena.make(env_id)`, its default wrappers) played by the policy.

Per episode: `env = textarena.make(envs.textarena.env_id, **envs.textarena.env_kwargs)`, `env.reset(num_players,
seed=the row's seed)`, then TextArena's own loop: `player_id, observation = env.get_observation()`; the policy's
turn is generated (its text is the action, as TextArena's LLM agents send theirs, or with
envs.textarena.action_pattern set the pattern's last match in it: `game_action`), the fixed opponent's is
chosen from the moves the game lists; `done, info = env.step(action)` until done; `rewards, game_info =
env.close()` and the policy player's reward is the episode's reward (the game's outcome: a win 1, a loss -1 or
0 as the game defines it; a game cut by envs.textarena.max_turns scores what close() gives it, 0 when nothing).

Observations are environment tokens (mask 0). A TextArena observation is the player's whole game log so far, so
the conversation gets, after the first one, only what the log added since the policy's last turn (the game's
echo of its move, the opponent's move, the new board), as a user message; a log that does not extend the
previous one is shown whole. Game calls run in a thread (TextArena is synchronous), each under
envs.textarena.step_timeout_s, so neither a slow game nor the event loop starves the other.

Failures are error records (EnvError, TextArena's own message): the game cannot be made (an unknown id, a
missing resource such as NLTK's word lists), it raises in reset/step/close, an observation that is not text,
no move the fixed opponent can read. An invalid move by the policy is the game's business (TextArena penalises
it as its rules say), never an error.

    FixedOpponent    first_valid / random_valid: a move from the last "Available Moves" / "Valid moves" list
    new_text         the part of a cumulative observation the conversation has not shown yet
    game_action      the action a policy turn sends: the action_pattern's last match, or the whole text
    textarena_rows   the rows of `--env textarena:GAME` without a data file: one game each, seeded by its index
"""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any, Callable

from agentloop.config import SamplingParams
from agentloop.envs_config import TextArenaEnvConfig
from agentloop.errors import EnvError
from agentloop.loops.base import AgentLoopBase
from agentloop.loops.env_chat import EnvChat
from agentloop.loops.registry import register_agent_loop
from agentloop.records import AgentLoopOutput, Sample

SOURCE = "textarena"
"""data_source of the rows `textarena_rows` makes (the reward is the game's, set by the loop)."""

_MOVE_LIST = re.compile(r"(?:Available Moves|Valid moves|Valid Moves|Available moves)\s*:\s*(.*)")
_MOVE = re.compile(r"\[[^\[\]\s]+\]")


def listed_moves(observation: str) -> list[str]:
    """The moves of the last "Available Moves: '[0]', '[1]'" (or "Valid moves: ...") line of `observation`."""
    lines = _MOVE_LIST.findall(observation)
    return _MOVE.findall(lines[-1]) if lines else []


class FixedOpponent:
    """A fixed player for two-player games: `first_valid` plays the first listed move, `random_valid` a random one
    (seeded per episode)."""

    def __init__(self, kind: str, seed: int):
        self.kind, self.rng = kind, random.Random(seed)

    def __call__(self, observation: str) -> str:
        moves = listed_moves(observation)
        if not moves:
            raise EnvError("the fixed opponent found no listed moves (\"Available Moves: ...\") in the game's "
                           f"observation: {observation[-300:]!r}")
        return moves[0] if self.kind == "first_valid" else self.rng.choice(moves)


def new_text(observation: str, shown: str) -> str:
    """What `observation` adds to `shown` (all of it when it does not extend `shown`)."""
    return observation[len(shown):] if shown and observation.startswith(shown) else observation


def game_action(pattern: re.Pattern[str] | None, text: str) -> tuple[str, bool]:
    """(the action sent for a policy turn's `text`, whether `pattern` matched). The last match of `pattern` (its
    group 1 when it has groups; a match whose group 1 took no part is skipped); the whole `text` when `pattern` is
    None or nothing matches (the game then judges the text itself)."""
    if pattern is None:
        return text, True
    found = [m.group(1) if pattern.groups else m.group(0) for m in pattern.finditer(text)]
    found = [f for f in found if f is not None]
    return (found[-1], True) if found else (text, False)


def make_env(cfg: TextArenaEnvConfig) -> Any:
    try:
        import textarena
    except ImportError as e:
        raise EnvError(f"textarena is not installed: pip install 'agentloop[envs]' ({e})") from None
    try:
        return textarena.make(cfg.env_id, **cfg.env_kwargs)
    except Exception as e:  # noqa: BLE001 - TextArena's own message, in the episode's error record
        raise EnvError(f"textarena.make({cfg.env_id!r}): {type(e).__name__}: {e}") from None


async def _call(fn: Callable[..., Any], what: str, timeout: float, *args: Any, **kwargs: Any) -> Any:
    try:
        return await asyncio.wait_for(asyncio.to_thread(fn, *args, **kwargs), timeout)
    except asyncio.TimeoutError:
        raise EnvError(f"TextArena {what} ran past envs.textarena.step_timeout_s={timeout:g}") from None
    except EnvError:
        raise
    except Exception as e:  # noqa: BLE001 - the game's failure, with its own message
        raise EnvError(f"TextArena {what} raised {type(e).__name__}: {e}") from None


def _observation(obs: Any) -> str:
    if not isinstance(obs, str):
        raise EnvError(f"TextArena observation is not text: {type(obs).__name__} {str(obs)[:200]}")
    return obs


@register_agent_loop("textarena_loop")
class TextArenaLoop(AgentLoopBase):
    """See the module doc; settings in `config.envs.textarena`."""

    async def run(self, sample: Sample, sampling_params: SamplingParams) -> AgentLoopOutput:
        cfg = self.config.envs.textarena
        row = sample.extra_info.get("textarena") or {}
        seed = int(row.get("seed", sampling_params.seed if sampling_params.seed is not None else sample.index))
        if cfg.policy_player >= cfg.num_players:
            raise EnvError(f"envs.textarena.policy_player={cfg.policy_player} with num_players={cfg.num_players}")
        timeout = cfg.step_timeout_s
        env = await _call(make_env, "make", timeout, cfg)
        opponent = FixedOpponent(cfg.opponent, seed)
        per_turn = cfg.max_tokens_per_turn or sampling_params.max_new_tokens
        messages = [m for m in sample.messages if m.get("role") != "user" or m.get("content")]
        if cfg.system_prompt and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        chat: EnvChat | None = None
        shown = ""
        turns = 0
        finish = "stop"
        metrics = {"opponent_moves": 0.0, "action_unmatched": 0.0}
        pattern = re.compile(cfg.action_pattern) if cfg.action_pattern is not None else None
        actions: list[str] = []
        await _call(env.reset, "reset", timeout, num_players=cfg.num_players, seed=seed)
        done = False
        while not done:
            player, obs = await _call(env.get_observation, "get_observation", timeout)
            obs = _observation(obs)
            if player != cfg.policy_player:
                done, _ = await _call(env.step, "step", timeout, opponent(obs))
                metrics["opponent_moves"] += 1
                continue
            if turns == cfg.max_turns:
                finish = "max_turns"
                break
            text, shown = new_text(obs, shown), obs
            if chat is None:
                chat = EnvChat(self, messages + [{"role": "user", "content": text}])
            else:
                await self.pace()
                limit = chat.add_observation(text, "user", cfg.max_response_tokens)
                if limit is not None:
                    finish = limit
                    break
            out, action = await chat.model_turn(sample, sampling_params, turns, per_turn, cfg.max_response_tokens)
            if out is None:
                finish = chat.limit or "token_budget"
                break
            if out.finish_reason == "abort":
                finish = "abort"
                break
            turns += 1
            action, matched = game_action(pattern, action)
            metrics["action_unmatched"] += not matched
            actions.append(action)
            done, _ = await _call(env.step, "step", timeout, action)
        rewards, game_info = await _call(env.close, "close", timeout)
        if chat is None:
            raise EnvError(f"TextArena {cfg.env_id}: the game ended before the policy's first turn")
        reward = float((rewards or {}).get(cfg.policy_player, 0.0))
        info = (game_info or {}).get(cfg.policy_player, {}) if isinstance(game_info, dict) else {}
        metrics.update(env_reward=reward, invalid_move=float(bool(info.get("invalid_move"))),
                       game_turns=float(info.get("turn_count", turns)))
        return chat.build(finish_reason=finish, reward=reward, metrics=metrics,
                          extra={"game_info": {str(k): v for k, v in (game_info or {}).items()},
                                 "solution_str": chat.messages[-1]["content"], "actions": actions})


def textarena_rows(cfg: TextArenaEnvConfig) -> list[dict[str, Any]]:
    """`cfg.episodes` rows, game i seeded by i, each an empty user turn (the game's first observation is the
    prompt) or the system prompt."""
    prompt = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else \
        [{"role": "user", "content": ""}]
    return [{"data_source": SOURCE, "prompt": prompt, "ability": cfg.env_id,
             "extra_info": {"index": i, "textarena": {"seed": i}}} for i in range(cfg.episodes)]


__all__ = ["FixedOpponent", "TextArenaLoop", "game_action", "listed_moves", "new_text", "textarena_rows"]
