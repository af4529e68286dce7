"""The parts of the ServerManager (agentloop.server_manager, its public face), one role each, each testable alone
on a ManagerState of its own.

Map:
    state           ManagerState: what the parts share (the Router, the pause state, counters, connections, the
                    admin and probe HTTP calls, gauges)
    data_plane      DataPlane: generate (routing, retries, continuation after an interrupt), SGLang's answer parsed
    control_plane   ControlPlane: pause, resume, flushes, weight updates, the expected version, push targets
    health          Health: probes, ejection, re-admission once a server serves the expected weights (resync)
    followers       Followers: managers in other processes that mirror this one's pauses and versions
    capacity        Capacity: each server's cap on concurrent requests, from what it reports

Who calls whom: the ServerManager wires them; DataPlane -> Capacity.on_full; ControlPlane -> Followers.tell and
Health.readmit; Followers.follow -> ControlPlane.expect_version and Health.readmit. Each part reaches the others
only through what it was handed.
"""
