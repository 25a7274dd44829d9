"""The ``logprobs`` of a response in OpenAI's two shapes, from the engine's per-token values
(`generation.logprobs.TokenLogprob`: which distribution they are is said there and in
docs/server.md).

* chat completions: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}]}]}`` (``top_logprobs`` 0-20 alternatives per token);
* completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
  "text_offset"}`` (``logprobs`` 0-5 in OpenAI's API, up to 20 here as in vLLM).

A token's text is its own bytes decoded (a token holding part of a multi-byte character shows
U+FFFD, and ``bytes`` has the exact bytes, as OpenAI does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from constrained_spec.generation.logprobs import TokenLogprob


def _piece(decoded: Sequence[bytes], token_id: int) -> tuple[str, list[int]]:
    raw = decoded[token_id] if 0 <= token_id < len(decoded) else b""
    return raw.decode("utf-8", errors="replace"), list(raw)


def token_text(decoded: Sequence[bytes], token_id: int) -> str:
    """A token's text as the logprobs show it (its own bytes decoded)."""
    return _piece(decoded, token_id)[0]


def chat_logprobs(decoded: Sequence[bytes], entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object of ``entries`` (``decoded``: token id -> bytes)."""
    content = []
    for e in entries:
        text, raw = _piece(decoded, e.token_id)
        top = []
        for tid, lp in e.top:
            t, b = _piece(decoded, tid)
            top.append({"token": t, "logprob": lp, "bytes": b})
        content.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(decoded: Sequence[bytes], entries: Sequence[TokenLogprob],
                        offset: int = 0) -> dict[str, Any]:
    """OpenAI's (legacy) completions ``logprobs`` object of ``entries``; ``offset``: where the
    completion's text starts in the returned text (the echoed prompt's length)."""
    tokens, values, tops, offsets = [], [], [], []
    at = offset
    for e in entries:
        text, _ = _piece(decoded, e.token_id)
        tokens.append(text)
        values.append(e.logprob)
        tops.append({_piece(decoded, tid)[0]: lp for tid, lp in e.top})
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def within(decoded: Sequence[bytes], entries: Sequence[TokenLogprob], text: str) -> list[TokenLogprob]:
    """The leading ``entries`` whose bytes lie within ``text`` (a content cut at a stop string
    or a dropped tool call keeps the logprobs of what it kept, and a token straddling the cut)."""
    budget = len(text.encode("utf-8"))
    out, used = [], 0
    for e in entries:
        if used >= budget:
            break
        out.append(e)
        used += len(decoded[e.token_id]) if 0 <= e.token_id < len(decoded) else 0
    return out
