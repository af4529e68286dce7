"""The planning room: what `agentloop train --dry-run` and every run's start decide before anything starts, in
seconds, from the config, the data, the model's config.json and its tokenizer (never its weights).

Map:
    checks      data, rewards, chat template, prompts, model, tools: one Check each
    inventory   the machine: the visible GPUs (from a child process) or those the config names
    memory      the GPU memory plan: learner peak, server KV pool, placement (pure numbers)
    meta        the model built on the meta device (accelerate.init_empty_weights): its exact parameter count
    defaults    the keys the plan sizes, the user's value where one was set
    render      the plan's lines, plan.json, and the measured numbers next to it
    preflight   all of it in order: Preflight, run_preflight
"""
