"""The rollout side: run many concurrent episodes of a registered loop against the servers, score them,
and summarise a run.

    engine.py   RolloutEngine: the episode dispatcher (every episode ends as one record)
    scorer.py   Scorer: which reward applies to an episode, and the text it sees
    summary.py  summarize (reward, pass@k, throughput, errors), pass_at_k
    looplag.py  LoopLagMonitor: how late the event loop runs
    stream.py   GroupStreamProtocol: the stream of groups the async schedule drives (the engine's, Ray workers')
    run.py      `agentloop rollout`: eval-only rollouts against a frozen model, written to a run dir

May import: the vocabulary, util, the client, inference, tools, rewards, data, loops, models, report.
"""
