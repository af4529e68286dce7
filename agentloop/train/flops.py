"""The FLOP model of a training step and the GPUs' peak throughput: what MFU and the learner's row cost use.

FLOP model (PaLM, appendix B). N = parameters that take part in matmuls: all parameters, less the
input embedding when it is not tied to the LM head (a lookup costs no FLOPs); norms and biases are
counted too (negligible). For one sequence of S input tokens (prompt + response - 1: the last token
is only a target) in a model with L layers and hidden size H:
    training pass (forward + backward)   6*N*S + 12*L*H*S^2
    forward-only pass                    2*N*S +  4*L*H*S^2
The attention term is the QK^T and AV matmuls without causal halving, as in PaLM (so does MFU in
most reports). A row that shares a prompt of p positions among responses of k_i positions counts the
pairs its episodes need, the prompt's own once: p^2 + sum((p + k_i)^2 - p^2) (the learner's
batch/computed_tokens_sq); pairs a dense mask computes but masks out are work, not model FLOPs.
    MFU = step FLOPs / step wall time / (ranks * peak dense bf16 FLOP/s per GPU)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PEAK_TFLOPS: dict[str, float] = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,
    "H200": 989.0,
    "H20": 148.0,
    "A100": 312.0,
}
"""Dense bf16 tensor-core TFLOP/s per GPU (vendor datasheets, no sparsity), matched as substrings of
the device name, longest key first ("H100 PCIe" before "H100"). Other GPUs: `--peak-tflops`."""



def flop_params(model: Any) -> int:
    """N of the FLOP model: unique parameters, less the input embedding when it is not the LM head.

    Works on FSDP2-sharded models: a DTensor's numel is its global size.
    """
    total = sum(p.numel() for p in model.parameters())
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is not None and (head is None or head.weight is not emb.weight):
        total -= emb.weight.numel()
    return int(total)



def sequence_flops(n_params: int, layers: int, hidden: int, seq_len: int, *, backward: bool) -> float:
    """FLOPs of one pass over a sequence of `seq_len` input tokens (see the module doc)."""
    if backward:
        return 6.0 * n_params * seq_len + 12.0 * layers * hidden * seq_len**2
    return 2.0 * n_params * seq_len + 4.0 * layers * hidden * seq_len**2



def step_flops(n_params: int, layers: int, hidden: int, seq_lens: list[int], *, train_passes: int = 1,
               forward_passes: int = 0) -> dict[str, float]:
    """Model FLOPs of one step over sequences of `seq_lens` input tokens: train, forward, total."""
    return step_flops_from_sums(n_params, layers, hidden, float(sum(seq_lens)), float(sum(s * s for s in seq_lens)),
                                train_passes=train_passes, forward_passes=forward_passes)



def step_flops_from_sums(n_params: int, layers: int, hidden: int, tokens: float, tokens_sq: float, *,
                         train_passes: int = 1, forward_passes: int = 0) -> dict[str, float]:
    """`step_flops` from the sum of row lengths and the attention term (sum of squared sequence lengths,
    a shared prompt's own pairs once; the FLOP model is linear in both), for rows that are not one
    sequence each (shared prompts)."""
    train = train_passes * (6.0 * n_params * tokens + 12.0 * layers * hidden * tokens_sq)
    fwd = forward_passes * (2.0 * n_params * tokens + 4.0 * layers * hidden * tokens_sq)
    return {"train": train, "forward": fwd, "total": train + fwd}



def peak_tflops(device_name: str | None, override: float | None = None) -> float | None:
    """Peak dense bf16 TFLOP/s of one device: `override`, else PEAK_TFLOPS by name, else None."""
    if override is not None:
        return override
    if not device_name:
        return None
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return PEAK_TFLOPS[key]
    return None


@dataclass(frozen=True)
class RowCost:
    """Forward cost of a row of L real tokens under a dense attention mask: per_token*L + per_pair*L^2.

    From the FLOP model above: per_token = 2N (N = parameters in matmuls),
    per_pair = 4 * layers * hidden (QK^T and AV for every query-key pair, masked or not).
    """

    per_token: float
    per_pair: float

    def row(self, length: int) -> float:
        return self.per_token * length + self.per_pair * length * length

    def sharing_pays(self, prompt: int, responses: list[int]) -> bool:
        """One shared row (prompt + segments) costs less than a row per response."""
        shared = self.row(prompt + sum(responses))
        return shared < sum(self.row(prompt + n) for n in responses)


def row_cost(model: Any) -> RowCost:
    """`RowCost` of an HF causal LM (per_token = 2N, per_pair = 4 * layers * hidden)."""
    c = model.config
    return RowCost(per_token=2.0 * flop_params(model), per_pair=4.0 * c.num_hidden_layers * c.hidden_size)
