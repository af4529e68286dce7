"""A Tinker-compatible service: `agentloop tinker serve` speaks the wire protocol of the `tinker` SDK, so
tinker-cookbook recipes run unchanged against agentloop's learner code and a real SGLang server
(docs/tinker.md).

Map (one concept per module; arrows point down):
    server.py    the aiohttp service: the SDK's /api/v1 paths, auth, sessions, checkpoints' tinker:// paths
    futures.py   request ids and the retrieve_future long poll; a training model's seq_id order
    backend.py   the training model (torch, agentloop's LoRA layers or full weights), Adam, state files
    losses.py    Tinker's losses (cross_entropy, importance_sampling, ppo), a registry by name
    sampler.py   the SGLang server we launch: adapters by name, full-weights snapshots from disk, /generate
    wire.py      protobuf and JSON shapes of the SDK: decode forward_backward, encode outputs, the error shape
    config.py    TinkerServiceConfig (the command's settings)

Add a loss: write `fn(logprobs, loss_fn_inputs, loss_fn_config) -> summed loss` in losses.py and put it in LOSSES.
"""
