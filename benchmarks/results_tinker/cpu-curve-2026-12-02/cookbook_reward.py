"""The cookbook's arithmetic reward for `agentloop train` (benchmarks/cpu_tinker_curve.py's)."""
import asyncio
import functools

from transformers import AutoTokenizer

MODEL = '/root/.cache/agentloop/models/arith-warm-1dbf6cd7ad21'
MAX_TOKENS = 10


@functools.lru_cache(maxsize=1)
def _renderer():
    from tinker_cookbook import renderers
    tok = AutoTokenizer.from_pretrained(MODEL)
    return tok, renderers.get_renderer("role_colon", tokenizer=tok)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
    tok, renderer = _renderer()
    ids = tok.encode(solution_str, add_special_tokens=False)
    ended = STOP_TEXT in solution_str or (tok.eos_token and tok.eos_token in solution_str)
    if not ended:  # cut at max_tokens: the cookbook ends the episode with its flat context_overflow_reward
        return {"score": -0.1, "correct": 0.0, "format": 0.0, "cut": 1.0}
    env = ArithmeticEnv(int(extra_info["x"]), int(extra_info["y"]), renderer=renderer,
                        convo_prefix=ArithmeticEnv.standard_fewshot_prefix())
    step = asyncio.run(env.step(ids))
    return {"score": float(step.reward), "correct": float(step.metrics["correct"]),
            "format": float(step.metrics["format"]), "cut": 0.0}


STOP_TEXT = '\n\nUser:'
