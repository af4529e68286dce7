"""Each part of the ServerManager alone (agentloop.client): a ManagerState of its own, the part, and stubs for the
HTTP calls and the collaborators it was handed; no manager, no server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentloop.client.capacity import Capacity
from agentloop.client.control_plane import ControlPlane
from agentloop.client.followers import Followers
from agentloop.client.health import Health
from agentloop.client.state import ManagerState
from agentloop.config import ManagerConfig
from agentloop.errors import RequestError, ServerError

URLS = ["http://a", "http://b"]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def state(**cfg: Any) -> tuple[ManagerState, list[str]]:
    said: list[str] = []
    return ManagerState(URLS, ManagerConfig(**cfg), initial_version=0, on_event=said.append), said


def test_the_control_plane_ejects_the_server_that_fails_a_broadcast_and_goes_on():
    s, said = state()
    calls: list[tuple[str, str]] = []

    async def admin_post(url, path, payload, timeout=None):
        calls.append((url, path))
        if url == "http://b":
            raise RequestError("refused", server=url, status=500)
        return {"ok": True}

    s.admin_post = admin_post
    control = ControlPlane(s, followers=Followers(s, expect_version=lambda v: None, readmit=lambda i: False),
                           readmit=lambda i: False)
    assert run(control.broadcast("/pause_generation", {"mode": "abort"})) == [{"ok": True}]
    assert [srv.healthy for srv in s.router.servers] == [True, False]
    assert s.needs_continue == {1} and s.stats["admin_failures"] == 1 and "http://b failed /pause_generation" in said[0]
    # with every server failing it is an error
    async def down(url, path, payload, timeout=None):
        raise RequestError("down", server=url)

    s.admin_post = down
    with pytest.raises(ServerError, match="failed on 1/1"):
        run(control.broadcast("/continue_generation", {}))


def test_the_control_plane_tells_followers_before_a_pause_reaches_the_servers():
    s, _ = state()
    order: list[str] = []

    async def admin_post(url, path, payload, timeout=None):
        order.append(path)

    s.admin_post = admin_post
    followers = Followers(s, expect_version=lambda v: None, readmit=lambda i: False)

    async def hook(st):
        order.append(f"told paused={not st['unpaused']} interrupts={st['interrupts']}")

    followers.add(hook)
    control = ControlPlane(s, followers=followers, readmit=lambda i: False)
    run(control.pause("abort"))
    assert order == ["told paused=True interrupts=1", "/pause_generation", "/pause_generation"]
    assert not s.unpaused.is_set() and s.paused == {0, 1}


def test_followers_mirror_a_leader_and_ignore_an_older_state():
    leader, _ = state()
    leader.interrupts, leader.pauses = 3, 4
    leader.unpaused.clear()
    leader.router.set_version(0, 7)
    lead = Followers(leader, expect_version=lambda v: None, readmit=lambda i: False)
    older, newer = lead.state(), lead.state()
    s, _ = state()
    expected: list[int] = []
    mirror = Followers(s, expect_version=expected.append, readmit=lambda i: False)
    mirror.follow(newer)
    assert (s.interrupts, s.pauses, s.unpaused.is_set(), s.router.servers[0].version) == (3, 4, False, 7)
    s.interrupts = 99
    mirror.follow(older)  # an older state never undoes a newer one
    assert s.interrupts == 99 and expected == []


def test_health_readmits_an_ejected_server_only_at_the_expected_version():
    s, said = state()
    for i in range(2):
        s.router.set_version(i, 2)
    s.router.expect(2)
    s.router.eject(1)  # failed probes: out, at the expected version as far as anyone knows
    answers = {"/health_generate": True, "/model_info": {"weight_version": "1"}}

    async def get_ok(url, path, timeout):
        return answers[path]

    s.get_ok = get_ok
    health = Health(s)
    run(health.try_readmit(1))
    assert not s.router.servers[1].healthy and s.router.servers[1].stale and "expected 2: kept out" in said[-1]
    answers["/model_info"] = {"weight_version": "2"}
    run(health.try_readmit(1))
    assert s.router.servers[1].healthy and s.stats["readmissions"] == 1


def test_capacity_sizes_each_server_from_what_it_reports():
    s, said = state()
    infos = {"http://a": {"max_running_requests": 48}, "http://b": None}

    async def get_ok(url, path, timeout):
        return infos[url]

    s.get_ok = get_ok
    cap = Capacity(s)
    run(cap.size_from_servers())
    assert [s.router.capacity(i) for i in range(2)] == [48, 256]  # b said nothing: the default stays
    assert cap.sized == {0} and said == ["server http://a: up to 48 concurrent requests (its max_running_requests)"]
    fixed, _ = state(max_inflight_per_server=8)
    fixed.get_ok = get_ok
    run(Capacity(fixed).size_from_servers())  # a cap for all is never overridden
    assert [fixed.router.capacity(i) for i in range(2)] == [8, 8]
