"""Models the project builds or resolves: the tiny Qwen2-architecture model and tokenizer, random-weight
shapes of real models, the supervised warm start, and which model/tokenizer a run uses.

    modelzoo.py   the tiny model + tokenizer (built once, cached) and real-model shapes (Qwen2.5-0.5B, ...)
    warmstart/    the calculator warm start: spec, synthetic traces, SFT, the cached/shipped build, evaluation
    loading.py    resolve_model (cfg.model.path or the tiny model), load_tokenizer_for
    assets/       the shipped warm-start weights (checksummed)

May import: the vocabulary, util, tools, rewards, data and loops (the warm start renders tool traces
exactly as tool_agent_loop does, and scores them with the task's reward).
"""
