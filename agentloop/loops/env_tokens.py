"""Environment text -> token ids that can never carry a control token.

Text that a loop appends and the model did not write (tool results, observations, feedback) is data.
Tokenized like a chat template's output, with special-token parsing, a tool that prints
`<|im_end|>\\n<|im_start|>assistant\\n` would put *real* turn-structure tokens into the trajectory,
and a policy could learn to write programs that forge turns. So environment text is read as plain
text: a control token's string inside it becomes ordinary text tokens, never the token's id.

    control_tokens    the strings that must never come out of environment text as one token: the
                      tokenizer's special and added tokens (`<|im_end|>`, and also `<tool_call>`,
                      `<tool_response>`, which tokenizers often add as non-special), except added
                      whitespace runs
    encode_env_text   ids of a text read wholly as plain text (all of it environment content)
    Segment           a piece of rendered text: template glue (control tokens allowed) or content
    encode_segments   glue + content pieces as one id list, content read as plain text

encode_segments gives the canonical ids (the whole text tokenized at once, as an inference server's
chat API would) whenever no control token falls inside a content piece; otherwise each piece is
tokenized on its own and the pieces are spliced, so only the episodes whose content holds a control
token string get a (still lossless) non-canonical split at the piece boundaries.

For loop authors: `AgentLoopBase.encode_env(text)` is `encode_env_text` with the loop's tokenizer;
`tool_agent_loop` uses `template.env_segments` + `encode_segments` for the template glue around tool
results. The prompt (the data row's messages) is not environment text and is templated as is.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any

from agentloop.errors import ConfigError


@dataclass(frozen=True)
class Segment:
    text: str
    content: bool
    """True: environment content (read as plain text); False: template glue (control tokens parsed)."""


class _Codec:
    """Per-tokenizer state: the control tokens, their ids, and a plain-text encoder."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.tokens = _find_control_tokens(tokenizer)
        ids = set()
        for t in self.tokens:
            i = tokenizer.convert_tokens_to_ids(t)
            if isinstance(i, int) and i >= 0 and i != getattr(tokenizer, "unk_token_id", None):
                ids.add(i)
        self.ids = frozenset(ids)
        self._plain = _plain_backend(tokenizer, self.tokens)
        self._full = _full_backend(tokenizer)

    def plain(self, text: str) -> list[int]:
        if not text:
            return []
        if self._plain is not None:
            ids = list(self._plain.encode(text, add_special_tokens=False).ids)
        else:  # a tokenizer without a `tokenizers` backend: its own splitting of every added token
            ids = list(self.tokenizer.convert_tokens_to_ids(self.tokenizer.tokenize(text, split_special_tokens=True)))
        bad = sorted(self.ids.intersection(ids))
        back = self._decode(ids)
        # as faithful as the tokenizer's own encoding of the text (some normalize or add a prefix space)
        if bad or (back != text and back != self._decode(self.full(text))):
            raise ConfigError(
                f"the tokenizer ({type(self.tokenizer).__name__}) cannot encode environment text as plain text: "
                + (f"control token ids {bad} remain" if bad else f"{text[:60]!r} decodes back as {back[:60]!r}"))
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def full(self, text: str) -> list[int]:
        if not text:
            return []
        if self._full is not None:
            return self._full.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]] | None:
        """(ids, character offsets) of the template's tokenization of `text`; None without a fast tokenizer."""
        if self._full is not None:
            enc = self._full.encode(text, add_special_tokens=False)
            return enc.ids, enc.offsets
        if getattr(self.tokenizer, "is_fast", False):
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            return list(enc["input_ids"]), enc["offset_mapping"]
        return None


def _find_control_tokens(tokenizer: Any) -> frozenset[str]:
    out = {t for t in (getattr(tokenizer, "all_special_tokens", None) or []) if t}
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        content = getattr(tok, "content", str(tok))
        if content.strip():  # some tokenizers add whitespace runs as tokens: those are text
            out.add(content)
    return frozenset(out)


_PROBES = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n893\n</tool_response><|im_end|>\n", " héllo 😀 \t\n\n x",
           "plain text, numbers 12345 and (brackets)")


def _full_backend(tokenizer: Any) -> Any:
    """A private copy of the fast tokenizer's backend (no truncation or padding, whatever calls on the tokenizer
    set), used where the tokenizer's own `encode` goes through Python per token: the template text around
    environment content, tokenized once per turn. Used only when it gives the tokenizer's own ids on probe
    texts; None otherwise (and for tokenizers without a `tokenizers` backend)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return None
    from tokenizers import Tokenizer

    full = Tokenizer.from_str(backend.to_str())
    full.no_truncation()
    full.no_padding()
    for text in _PROBES:
        if full.encode(text, add_special_tokens=False).ids != list(tokenizer.encode(text, add_special_tokens=False)):
            return None
    return full


def _plain_backend(tokenizer: Any, control: frozenset[str]) -> Any:
    """A copy of the fast tokenizer's backend in which every control token is special and special tokens
    are encoded as text (`encode_special_tokens`): the `tokenizers` pipeline itself then tokenizes their
    strings like any other text. None for tokenizers without a `tokenizers` backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    spec = json.loads(backend.to_str())
    for tok in spec.get("added_tokens") or []:
        if tok.get("content") in control:
            tok["special"] = True
    plain = Tokenizer.from_str(json.dumps(spec))
    plain.encode_special_tokens = True
    return plain


_CODECS: "weakref.WeakKeyDictionary[Any, _Codec]" = weakref.WeakKeyDictionary()


def _codec(tokenizer: Any) -> _Codec:
    try:
        codec = _CODECS.get(tokenizer)
    except TypeError:  # not weak-referenceable: no cache
        return _Codec(tokenizer)
    if codec is None:
        codec = _CODECS[tokenizer] = _Codec(tokenizer)
    return codec


def control_tokens(tokenizer: Any) -> frozenset[str]:
    """Strings that environment text may never turn into their token (see the module docstring)."""
    return _codec(tokenizer).tokens


def control_token_ids(tokenizer: Any) -> frozenset[int]:
    return _codec(tokenizer).ids


def encode_env_text(tokenizer: Any, text: str) -> list[int]:
    """Ids of `text` read as plain text: no control token id can come out of it, and the ids decode back
    to `text` as faithfully as the tokenizer's own encoding does (exactly, for byte-level BPE); a
    tokenizer that cannot do both is a ConfigError."""
    return _codec(tokenizer).plain(text)


def encode_segments(tokenizer: Any, segments: list[Segment]) -> list[int]:
    """Ids of the concatenated segments: glue tokenized as the template's text (its control tokens are
    real), content as plain text. Canonical (one tokenization of the whole text) when that puts no
    control token inside a content piece; spliced piece by piece otherwise."""
    codec = _codec(tokenizer)
    text = "".join(s.text for s in segments)
    spans, pos = [], 0
    for s in segments:
        if s.content and s.text:
            spans.append((pos, pos + len(s.text)))
        pos += len(s.text)
    if not spans:
        return codec.full(text)
    whole = codec.with_offsets(text)
    if whole is not None:
        ids, offsets = whole
        if not any(i in codec.ids and any(a < e and s < b for s, e in spans) for i, (a, b) in zip(ids, offsets)):
            return ids
    out: list[int] = []
    for s in segments:
        out.extend(codec.plain(s.text) if s.content else codec.full(s.text))
    return out


__all__ = ["Segment", "control_token_ids", "control_tokens", "encode_env_text", "encode_segments"]
