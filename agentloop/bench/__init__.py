"""Benchmarks behind `agentloop bench`: a leaf that nothing else in the package imports.

    rollout.py   engine vs bare client, capacity
    tools.py     tool-loop episodes/s, time in tools vs generation
    gateway.py   your agent through the gateway vs tool_agent_loop, episodes/s on the same episodes
    train.py     learner tokens/s and MFU on synthetic batches; the time split of a train run

May import anything below it (train, rollout, report, models, ...).
"""
