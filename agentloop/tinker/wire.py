"""The Tinker wire format: what the SDK's bodies hold, decoded into our records, and the answers it parses.

Every JSON request body is validated by the SDK's own pydantic request types (`tinker.types`, the `tinker`
extra): a body the SDK could not have built is refused the way the SDK's server refuses it (400, the error shape
below). `forward_backward` arrives as protobuf (`application/x-protobuf`, `tinker.proto.tinker_public_pb2`), and
the two results the SDK only reads as protobuf (ForwardBackwardOutput, SampleResponse) are written as protobuf.

Map:
    Datum, FwdBwdRequest    a decoded forward_backward request (tokens, loss inputs as numpy arrays)
    decode_forward_backward the protobuf body -> FwdBwdRequest (zstd bodies included)
    encode_forward_backward our per-datum outputs + metrics -> the protobuf ForwardBackwardOutput
    SampledSeq, encode_sample  sampled sequences (+ prompt logprobs) -> the protobuf SampleResponse
    error_body              the API's error shape: {"error", "category", "detail"}
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

ErrorCategory = Literal["user", "server", "unknown"]


def error_body(message: str, category: ErrorCategory = "user") -> dict[str, Any]:
    """The API's error shape. A future's failure is `RequestFailedResponse` ({error, category}: the SDK raises
    RequestFailedError with the message); an HTTP error answer carries the same keys plus `detail`, the key the SDK
    prints in APIStatusError."""
    return {"error": message, "category": category, "detail": message}


class Datum(BaseModel):
    """One decoded Datum: the input tokens and its loss inputs (dense numpy arrays, by name)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    tokens: list[int]
    """The model input's tokens (every chunk an encoded-text chunk)."""
    inputs: dict[str, Any]
    """loss_fn_inputs by name -> numpy array (target_tokens int64, weights / logprobs / advantages float32)."""


class FwdBwdRequest(BaseModel):
    """A decoded forward_backward (or forward) request."""

    model_id: str
    """The training model's id (`<session>:train:<n>`)."""
    seq_id: int
    """Its place in the model's order of requests (the SDK numbers them from 1)."""
    loss_fn: str
    """cross_entropy | importance_sampling | ppo | ... (the others are refused by the backend, by name)."""
    loss_fn_config: dict[str, float | str] = Field(default_factory=dict)
    """Loss options (ppo: clip_low_threshold, clip_high_threshold)."""
    forward_only: bool = False
    """True for `forward` (and the first half of forward_backward_custom): no gradient is kept."""
    data: list[Datum]
    """The batch."""


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def _np_dtype(pb, code: int) -> Any:
    table = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if code not in table:
        raise ValueError(f"unsupported tensor dtype {pb.DType.Name(code)} in a loss_fn_inputs tensor")
    return table[code]


def _tensor(pb, msg: Any, name: str) -> Any:
    dt = _np_dtype(pb, msg.dtype)
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype=dt)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(shape) == 1:
            shape = [1, shape[0]]
            squeeze = True
        else:
            squeeze = False
        dense = np.zeros(shape, dtype=dt)
        for r in range(len(crow) - 1):
            dense[r, col[crow[r]:crow[r + 1]]] = values[crow[r]:crow[r + 1]]
        return dense[0] if squeeze else dense
    arr = np.frombuffer(msg.dense, dtype=dt).copy()
    if shape:
        arr = arr.reshape(shape)
    return arr


def decode_forward_backward(body: bytes, content_encoding: str | None = None) -> FwdBwdRequest:
    """The SDK's protobuf forward_backward body -> FwdBwdRequest. ValueError names what we cannot read (image or
    audio chunks: this service serves text models)."""
    pb = _pb()
    if content_encoding == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(body)
    data = []
    for d in msg.data:
        tokens: list[int] = []
        for ch in d.model_input:
            kind = ch.WhichOneof("chunk")
            if kind == "encoded_text":
                tokens.extend(np.frombuffer(ch.encoded_text.tokens, dtype=np.int32).tolist())
            else:
                raise ValueError(f"model_input chunk of kind {kind!r} is not supported: this service "
                                 "trains text models (encoded_text chunks only)")
        inputs = {name: _tensor(pb, t, name) for name, t in d.loss_fn_inputs.items()}
        data.append(Datum(tokens=tokens, inputs=inputs))
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    return FwdBwdRequest(model_id=msg.model_id, seq_id=int(msg.seq_id), loss_fn=msg.loss_fn,
                         loss_fn_config=config, forward_only=bool(msg.forward_only), data=data)


def encode_forward_backward(outputs: list[dict[str, Any]], metrics: dict[str, float]) -> bytes:
    """Per-datum outputs (name -> 1-D float32 numpy array, e.g. `logprobs`, `elementwise_loss`) and the batch's
    metrics -> the protobuf ForwardBackwardOutput (one ArrayRecord; each field batched with byte offsets)."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics={k: float(v) for k, v in metrics.items()})
    rec = msg.loss_fn_outputs.add()
    rec.type_tag = "ArrayRecord"
    rec.num_datums = len(outputs)
    for name in (outputs[0] if outputs else {}):
        arrays = [np.ascontiguousarray(o[name], dtype=np.float32).reshape(-1) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        bt = rec.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


class SampledSeq(BaseModel):
    """One sampled sequence."""

    tokens: list[int]
    """The generated token ids (the stop token included when the model emitted it)."""
    logprobs: list[float]
    """The server's logprob of each generated token."""
    stop_reason: Literal["stop", "length"]
    """stop: a stop token/string or EOS ended it; length: max_tokens did."""


def encode_sample(seqs: list[SampledSeq], prompt_logprobs: list[float | None] | None) -> bytes:
    """Sampled sequences (+ the prompt's logprobs, the first None) -> the protobuf SampleResponse."""
    pb = _pb()
    msg = pb.SampleResponse()
    for s in seqs:
        m = msg.sequences.add()
        m.stop_reason = pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        m.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        m.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray([np.nan if x is None else x for x in prompt_logprobs],
                                         dtype=np.float32).tobytes()
    return msg.SerializeToString()
