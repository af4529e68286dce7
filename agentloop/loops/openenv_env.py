"""openenv_loop: an OpenEnv environment server (any, by URL) as the environment of an episode.

OpenEnv serves an environment over HTTP; a session (one environment instance, its state kept server-side) is
the WebSocket at `/ws` that OpenEnv's own `EnvClient` opens, with JSON messages:

    -> {"type": "reset", "data": {seed, episode_id, ...}}     <- {"type": "observation", "data":
    -> {"type": "step", "data": {<action fields>}}                 {"observation": {...}, "reward": r, "done": d}}
    -> {"type": "close"}                                       <- {"type": "error", "data": {"message", "code"}}

(the stateless POST /reset and /step make a fresh environment per request, so an episode cannot run on them).
Per episode: open a session, reset (envs.openenv.reset + the row's extra_info["openenv"]["reset"], seed = the
episode's seed unless given), show the observation's text to the model as a message after the row's prompt,
then generate -> step({action_field: the model's text, **envs.openenv.action}) -> append the observation (mask 0,
role envs.openenv.observation_role) until the server says done or envs.openenv.max_turns; close the session.
The reward is the sum (or the last) of the steps' rewards, as the server gave them.

Failures are error records (EnvError, with the server's words): a server that is down or refuses the session
(OpenEnv's CAPACITY_REACHED when its max_concurrent_envs are taken), an error message, an answer past
envs.openenv.message_timeout_s, an observation with no text field (or several, and no observation_field set),
a reward that is not a number. Nothing from openenv-core is imported: the engine speaks its protocol (aiohttp).

    OpenEnvSession     one session: reset / step / close over the WebSocket, each under its deadline
    observation_text   the text shown to the model, from an observation
    openenv_rows       the rows of `--env openenv:URL` without a data file: a reset each
"""

from __future__ import annotations

import asyncio
import json
import weakref
from typing import TYPE_CHECKING, Any

import aiohttp

from agentloop.config import SamplingParams
from agentloop.envs_config import OpenEnvConfig
from agentloop.errors import EnvError
from agentloop.loops.base import AgentLoopBase
from agentloop.loops.env_chat import EnvChat
from agentloop.loops.registry import register_agent_loop
from agentloop.records import AgentLoopOutput, Sample
from agentloop.tools.registry import get_tool

if TYPE_CHECKING:
    from agentloop.server_manager import ServerManager

SOURCE = "openenv"
"""data_source of the rows `openenv_rows` makes (the reward is the server's, set by the loop)."""

_SESSIONS: "weakref.WeakKeyDictionary[ServerManager, aiohttp.ClientSession]" = weakref.WeakKeyDictionary()


def _http(sm: "ServerManager") -> aiohttp.ClientSession:
    """One aiohttp session per ServerManager (closed with it), for every OpenEnv session of its episodes."""
    s = _SESSIONS.get(sm)
    if s is None or s.closed:
        s = _SESSIONS[sm] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        sm.on_close(s.close)
    return s


def ws_url(url: str) -> str:
    """The session endpoint of a server URL (http -> ws, https -> wss), as OpenEnv's EnvClient makes it."""
    if url.startswith("https://"):
        url = "wss://" + url[len("https://"):]
    elif url.startswith("http://"):
        url = "ws://" + url[len("http://"):]
    return url.rstrip("/") + "/ws"


class OpenEnvSession:
    """One OpenEnv session (see the module doc); every answer under `cfg.message_timeout_s`."""

    def __init__(self, http: aiohttp.ClientSession, cfg: OpenEnvConfig):
        self.http, self.cfg = http, cfg
        self.ws: aiohttp.ClientWebSocketResponse | None = None

    async def open(self) -> None:
        url = ws_url(self.cfg.url or "")
        try:
            self.ws = await asyncio.wait_for(
                self.http.ws_connect(url, max_msg_size=int(self.cfg.max_message_mb * 1024 * 1024), heartbeat=None),
                self.cfg.connect_timeout_s)
        except asyncio.TimeoutError:
            raise EnvError(f"OpenEnv server {url}: no session within envs.openenv.connect_timeout_s="
                           f"{self.cfg.connect_timeout_s:g}") from None
        except (aiohttp.ClientError, OSError) as e:
            raise EnvError(f"OpenEnv server {url} is unreachable: {type(e).__name__}: {e}") from None

    async def _ask(self, kind: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self.ws is not None
        msg: dict[str, Any] = {"type": kind}
        if data is not None:
            msg["data"] = data
        try:
            await self.ws.send_str(json.dumps(msg))
            answer = await asyncio.wait_for(self.ws.receive(), self.cfg.message_timeout_s)
        except asyncio.TimeoutError:
            raise EnvError(f"OpenEnv server {self.cfg.url}: no answer to {kind} within "
                           f"envs.openenv.message_timeout_s={self.cfg.message_timeout_s:g}") from None
        except (aiohttp.ClientError, ConnectionError) as e:
            raise EnvError(f"OpenEnv server {self.cfg.url}: {kind} failed: {type(e).__name__}: {e}") from None
        if answer.type != aiohttp.WSMsgType.TEXT:
            raise EnvError(f"OpenEnv server {self.cfg.url} closed the session on {kind} ({answer.type.name}"
                           f"{': ' + str(answer.extra) if answer.extra else ''})")
        try:
            body = json.loads(answer.data)
        except json.JSONDecodeError as e:
            raise EnvError(f"OpenEnv server {self.cfg.url}: {kind} answer is not JSON ({e}): {answer.data[:200]!r}") \
                from None
        if not isinstance(body, dict):
            raise EnvError(f"OpenEnv server {self.cfg.url}: {kind} answer is not an object: {str(body)[:200]}")
        if body.get("type") == "error":
            err = body.get("data") or {}
            detail = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}"
                               for e in err.get("errors") or [] if isinstance(e, dict))
            code = f" ({err['code']})" if err.get("code") else ""
            raise EnvError(f"OpenEnv server {self.cfg.url}: {kind}: {err.get('message', err)}{code}"
                           f"{': ' + detail if detail else ''}")
        if not isinstance(body.get("data"), dict):
            raise EnvError(f"OpenEnv server {self.cfg.url}: {kind} answer has no data: {str(body)[:200]}")
        return body["data"]

    async def reset(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return await self._ask("reset", kwargs)

    async def step(self, action: dict[str, Any]) -> dict[str, Any]:
        return await self._ask("step", action)

    async def close(self) -> None:
        if self.ws is None or self.ws.closed:
            return
        try:
            await self.ws.send_str('{"type": "close"}')
        except (aiohttp.ClientError, ConnectionError):
            pass  # the server went away: nothing to tell it
        finally:
            await self.ws.close()


def observation_text(result: dict[str, Any], field: str | None) -> str:
    """The text of `result["observation"]` shown to the model: its `field`, else its only text field."""
    obs = result.get("observation")
    if not isinstance(obs, dict):
        raise EnvError(f"OpenEnv observation is not an object: {str(obs)[:200]}")
    if field is not None:
        if field not in obs:
            raise EnvError(f"OpenEnv observation has no field {field!r} (envs.openenv.observation_field); its fields: "
                           f"{sorted(obs)}")
        value = obs[field]
        if not isinstance(value, str):
            raise EnvError(f"OpenEnv observation field {field!r} is not text: {type(value).__name__} "
                           f"{str(value)[:100]}")
        return value
    texts = [k for k, v in obs.items() if isinstance(v, str)]
    if len(texts) != 1:
        raise EnvError(f"OpenEnv observation has {'no' if not texts else len(texts)} text field"
                       f"{'s' if len(texts) != 1 else ''} ({sorted(obs)}): set envs.openenv.observation_field")
    return obs[texts[0]]


def step_reward(result: dict[str, Any]) -> float:
    r = result.get("reward")
    if r is None:
        return 0.0
    if isinstance(r, bool) or not isinstance(r, (int, float)):
        raise EnvError(f"OpenEnv reward is not a number: {r!r}")
    return float(r)


@register_agent_loop("openenv_loop")
class OpenEnvLoop(AgentLoopBase):
    """See the module doc; settings in `config.envs.openenv`."""

    async def run(self, sample: Sample, sampling_params: SamplingParams) -> AgentLoopOutput:
        cfg = self.config.envs.openenv
        if not cfg.url:
            raise EnvError("openenv_loop needs the server: envs.openenv.url=http://host:port (or --env openenv:URL)")
        row = sample.extra_info.get("openenv") or {}
        reset = {**cfg.reset, **(row.get("reset") or {})}
        if "seed" not in reset and sampling_params.seed is not None:
            reset["seed"] = sampling_params.seed
        schemas = [get_tool(n)(self.config.tools).schema for n in cfg.tools] or None
        per_turn = cfg.max_tokens_per_turn or sampling_params.max_new_tokens
        session = OpenEnvSession(_http(self.server_manager), cfg)
        rewards: list[float] = []
        metrics = {"env_steps": 0.0}
        finish = "max_turns"
        try:
            await session.open()
            first = await session.reset(reset)
            messages = [m for m in sample.messages if m.get("role") != "user" or m.get("content")]
            messages.append({"role": "user", "content": observation_text(first, cfg.observation_field)})
            chat = EnvChat(self, messages, tools=schemas)
            if first.get("done"):
                raise EnvError(f"OpenEnv server {cfg.url}: the episode was done at reset")
            for turn in range(cfg.max_turns):
                out, text = await chat.model_turn(sample, sampling_params, turn, per_turn, cfg.max_response_tokens)
                if out is None:
                    finish = chat.limit or "token_budget"
                    break
                if out.finish_reason == "abort":
                    finish = "abort"
                    break
                result = await session.step({**cfg.action, cfg.action_field: text})
                metrics["env_steps"] += 1
                rewards.append(step_reward(result))
                if result.get("done"):
                    finish = "stop"
                    break
                if turn == cfg.max_turns - 1:
                    break
                await self.pace()
                limit = chat.add_observation(observation_text(result, cfg.observation_field), cfg.observation_role,
                                             cfg.max_response_tokens)
                if limit is not None:
                    finish = limit
                    break
        finally:
            await session.close()
        reward = (sum(rewards) if cfg.reward == "sum" else rewards[-1]) if rewards else 0.0
        metrics["env_reward"] = reward
        return chat.build(finish_reason=finish, reward=reward, metrics=metrics,
                          extra={"env_rewards": rewards, "solution_str": text if rewards else ""})


def openenv_rows(cfg: OpenEnvConfig) -> list[dict[str, Any]]:
    """`cfg.episodes` rows, row i resetting with seed i (unless envs.openenv.reset gives one), each the system
    prompt (if any) before the reset observation."""
    rows = []
    for i in range(cfg.episodes):
        prompt = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else \
            [{"role": "user", "content": ""}]
        rows.append({"data_source": SOURCE, "prompt": prompt, "ability": "openenv",
                     "extra_info": {"index": i, "openenv": {"reset": {"seed": i}}}})
    return rows


__all__ = ["OpenEnvLoop", "OpenEnvSession", "observation_text", "openenv_rows", "step_reward", "ws_url"]
