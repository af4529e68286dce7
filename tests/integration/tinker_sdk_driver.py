"""The tinker SDK's own client calls against `agentloop tinker serve` (run as a child by test_tinker_real.py).

Prints one JSON line: every measurement the test asserts on. Code a Tinker user writes, nothing of agentloop's.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import tinker
from tinker import types


def datum(ids: list[int], weights: list[float] | None = None) -> types.Datum:
    w = weights if weights is not None else [1.0] * (len(ids) - 1)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": w})


def train_steps(tc, batch: list[types.Datum], lr: float, steps: int) -> list[float]:
    """`steps` rounds of cross-entropy forward_backward + optim_step on `batch`, sent back to back as a recipe
    does; each round's loss:sum."""
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(batch, "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
        op.result()
    return losses


def main(url: str) -> None:
    out: dict = {}
    sc = tinker.ServiceClient(base_url=url)
    base = sc.get_server_capabilities().supported_models[0].model_name
    tc = sc.create_lora_training_client(base_model=base, rank=8, seed=1)
    tok = tc.get_tokenizer()
    texts = ["What is 2 + 3? The answer is 5.", "The cat sat on the mat and slept."]
    batch = [datum(tok.encode(t)) for t in texts]
    out["ce_losses"] = train_steps(tc, batch, 5e-3, 4)

    # sampled logprobs of the saved weights vs a forward pass of the same tokens
    path = tc.save_weights_for_sampler("s1").result().path
    out["sampler_path"] = path
    sampler = sc.create_sampling_client(model_path=path)
    prompt = tok.encode("What is 2 + 3?")
    res = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2, include_prompt_logprobs=True,
                         sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0, seed=3)).result()
    diffs = []
    for seq in res.sequences:
        ids = prompt + list(seq.tokens)
        fwd = tc.forward([datum(ids, [0.0] * (len(ids) - 1))], "cross_entropy").result()
        lp = np.asarray(fwd.loss_fn_outputs[0]["logprobs"].data)[len(prompt) - 1:]
        diffs.append(float(np.max(np.abs(lp - np.asarray(seq.logprobs)))))
        if seq is res.sequences[0]:
            plp = np.asarray(fwd.loss_fn_outputs[0]["logprobs"].data)[:len(prompt) - 1]
            out["prompt_logprob_diff"] = float(np.max(np.abs(plp - np.asarray(res.prompt_logprobs[1:]))))
    out["sample_lens"] = [len(s.tokens) for s in res.sequences]
    out["sample_logprob_diff"] = max(diffs)
    out["prompt_logprobs_first"] = res.prompt_logprobs[0]

    # importance_sampling and ppo against a hand computation, on a fresh client (no gradients left over)
    tc2 = sc.create_lora_training_client(base_model=base, rank=4)
    d = batch[0]
    lp = np.asarray(tc2.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data)
    n = len(lp)
    rng = np.random.default_rng(0)
    old = lp + rng.uniform(-0.5, 0.5, n).astype(np.float32)
    adv = rng.normal(size=n).astype(np.float32)
    rl = types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": old.tolist(), "advantages": adv.tolist()})
    ratio = np.exp(lp - old)
    out["is_server"] = tc2.forward([rl], "importance_sampling").result().metrics["loss:sum"]
    out["is_hand"] = float(-(ratio * adv).sum())
    out["ppo_server"] = tc2.forward([rl], "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
                                    ).result().metrics["loss:sum"]
    out["ppo_hand"] = float(-np.minimum(ratio * adv, np.clip(ratio, 0.9, 1.1) * adv).sum())

    # forward_backward_custom: a client-side loss (here cross-entropy written by hand)
    def my_loss(data, logprobs_list):
        import torch

        loss = sum(-(lp_ * torch.tensor(dd.loss_fn_inputs["weights"].data)).sum() for dd, lp_ in zip(data, logprobs_list))
        return loss, {"mine": 1.0}

    cres = tc2.forward_backward_custom([d], my_loss).result()
    out["custom_loss"] = cres.metrics["loss:sum"]
    out["custom_hand"] = float(-lp.sum())
    out["custom_metric"] = cres.metrics.get("mine")

    # save_state / load_state round trip
    st = tc.save_state("st1").result().path
    before = np.asarray(tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data)
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    moved = np.asarray(tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data)
    tc.load_state(st).result()
    back = np.asarray(tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data)
    tc3 = sc.create_training_client_from_state(st)
    fresh = np.asarray(tc3.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data)
    out["state_moved"] = float(np.max(np.abs(moved - before)))
    out["state_back"] = float(np.max(np.abs(back - before)))
    out["state_fresh"] = float(np.max(np.abs(fresh - before)))

    # an unsupported call: the API's error shape, naming it
    try:
        tc.forward_backward([d], "cispo").result()
        out["unsupported"] = None
    except tinker.RequestFailedError as e:
        out["unsupported"] = str(e)

    # agentloop's extension: full weights (every weight trained; the sampler weights an HF directory the server
    # loads from disk), then the LoRA sampler again (the server's base weights are switched back for it)
    tf = sc.create_lora_training_client(base_model=base, rank=8, user_metadata={"agentloop_full_weights": "true"})
    out["full_ce_losses"] = train_steps(tf, batch, 1e-3, 3)
    fsampler = sc.create_sampling_client(model_path=tf.save_weights_for_sampler("full1").result().path)
    fres = fsampler.sample(types.ModelInput.from_ints(prompt), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0, seed=5)).result()
    ids = prompt + list(fres.sequences[0].tokens)
    fwd = tf.forward([datum(ids, [0.0] * (len(ids) - 1))], "cross_entropy").result()
    flp = np.asarray(fwd.loss_fn_outputs[0]["logprobs"].data)[len(prompt) - 1:]
    out["full_sample_logprob_diff"] = float(np.max(np.abs(flp - np.asarray(fres.sequences[0].logprobs))))
    again = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0, seed=3)).result()
    out["lora_again_same_as_before"] = list(again.sequences[0].tokens) == list(res.sequences[0].tokens)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
