"""tinker-cookbook's own loops against `agentloop tinker serve` (a child of test_tinker_real.py, which runs the
math_rl recipe as its own CLI).

    sft URL MODEL LOG_DIR DATA.jsonl   tinker_cookbook.supervised.train.main (the loop recipes/sl_basic.py runs) on a
                                       conversation file (FromConversationFileBuilder; a missing DATA is written from
                                       6 conversations of the cookbook's example_data: 4 train, 2 held out), so each
                                       epoch is the same batch of 4 and its NLL must fall
    rollout URL MODEL                  the case of the cookbook's rollout-semantics regression tests
                                       (rl/rollout_semantics_regression_test.py, not shipped in its wheel) that
                                       depends on the sampler, with our SamplingClient in place of their scripted
                                       completer: a `length` stop ends the episode with context_overflow_reward
                                       before the env's step runs (nothing graded)

Only configuration here, the cookbook's code unchanged: the model is the service's local path, the renderer the
generic `role_colon` (the cookbook's renderer table knows hub names only), sizes small enough for the tiny model on
a CPU. The cookbook's tokenizer path needs tml_renderers (not on PyPI at the version it pins) only for the
o200k/h200k/Kimi tokenizer families, not for a local HF tokenizer.
"""

from __future__ import annotations

import asyncio
import sys


def sft(url: str, model: str, log_path: str, data: str, steps: int = 4) -> None:
    from pathlib import Path

    import datasets
    import tinker_cookbook
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    if not Path(data).exists():  # 6 conversations of the cookbook's own example file: 4 to train on, 2 held out
        example = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
        Path(data).write_text("".join(example.read_text().splitlines(keepends=True)[:6]))
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name="role_colon",
                                            max_length=256, batch_size=4,
                                            train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    # an offline GPU machine without datasets has benchmarks/gpu_shims' stand-in, which refuses any use
    kind = _in_memory_builder() if getattr(datasets, "__agentloop_standin__", False) else FromConversationFileBuilder
    builder = kind(common_config=common, file_path=data, test_size=2)
    config = train.Config(log_path=log_path, model_name=model, recipe_name="recipe_sl_basic",
                          renderer_name="role_colon", base_url=url, lora_rank=8, learning_rate=5e-3,
                          lr_schedule="constant", num_epochs=steps, max_steps=steps, save_every=2,
                          eval_every=2,
                          dataset_builder=builder)
    asyncio.run(train.main(config))


def _in_memory_builder():
    """FromConversationFileBuilder's split and batching without `datasets` (the offline GPU machines lack it and
    pyarrow): the same file, the cookbook's own conversation_to_datum and renderer, the first `test_size`
    conversations held out (FromConversationFileBuilder shuffles first; the sizes here make that moot)."""
    import json

    import chz
    from tinker_cookbook.supervised.data import conversation_to_datum
    from tinker_cookbook.supervised.types import ChatDatasetBuilder, SupervisedDataset

    class Batches(SupervisedDataset):
        def __init__(self, datums: list, batch_size: int) -> None:
            self.datums, self.batch_size = datums, batch_size

        def get_batch(self, index: int) -> list:
            return self.datums[index * self.batch_size:(index + 1) * self.batch_size]

        def __len__(self) -> int:
            return len(self.datums) // self.batch_size

        def set_epoch(self, seed: int = 0) -> None:
            pass

    @chz.chz
    class InMemory(ChatDatasetBuilder):
        file_path: str
        test_size: int = 0

        def __call__(self):
            cfg = self.common_config
            convs = [json.loads(ln)["messages"] for ln in open(self.file_path) if ln.strip()]
            datums = [conversation_to_datum(c, self.renderer, cfg.max_length, cfg.train_on_what) for c in convs]
            test, train = datums[:self.test_size], datums[self.test_size:]
            return Batches(train, cfg.batch_size), (Batches(test, len(test)) if test else None)

    return InMemory


def rollout(url: str, model: str) -> None:
    import json

    import tinker
    from tinker_cookbook.completers import TinkerTokenCompleter
    from tinker_cookbook.renderers import get_renderer
    from tinker_cookbook.rl.rollouts import do_single_rollout
    from tinker_cookbook.tokenizer_utils import get_tokenizer
    from tinker_cookbook.tool_use.agent_tool_message_env import build_agent_tool_env

    graded = []

    async def reward_fn(history: list) -> tuple[float, dict[str, float]]:  # the cookbook's RewardFn
        graded.append(history)
        return 0.7, {"graded": 1.0}

    async def go() -> dict:
        sc = tinker.ServiceClient(base_url=url)
        sampler = await sc.create_sampling_client_async(base_model=model)
        policy = TinkerTokenCompleter(sampler, max_tokens=3)
        env = build_agent_tool_env(renderer=get_renderer("role_colon", get_tokenizer(model)), tools=[],
                                   initial_messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                   reward_fn=reward_fn)
        traj = await do_single_rollout(policy, env)
        final = traj.transitions[-1]
        return {"transitions": len(traj.transitions), "reward": final.reward, "done": final.episode_done,
                "max_tokens_reached": final.metrics.get("max_tokens_reached"), "ac_len": len(final.ac.tokens),
                "logprobs": len(final.ac.maybe_logprobs or []), "graded": len(graded)}

    print("RESULT " + json.dumps(asyncio.run(go())), flush=True)


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    {"sft": sft, "rollout": rollout}[cmd](*rest)
