"""Logprobs at the gateway: the request's fields checked, the token texts filled in, OpenAI's shapes.

    gRPC  SamplingParams.logprobs / top_logprobs (0-20)  ->  TokenLogprob per token (with `top`)
    chat  logprobs: bool, top_logprobs: 0-20             ->  choice.logprobs = {"content": [...]}
    legacy completions  logprobs: 0-5                    ->  {"tokens", "token_logprobs", "top_logprobs",
                                                              "text_offset"}

The worker computes the numbers (gpu_worker/engine/sampler.py; which distribution: docs/logprobs.md)
and leaves the token texts empty; `with_text` fills them from the tokenizer here.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.detokenizer import TokenTexts
from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import inference_pb2 as pb

MAX_TOP_LOGPROBS = 20          # chat and gRPC
MAX_LEGACY_LOGPROBS = 5        # /v1/completions' integer `logprobs`


def check(sampling: pb.SamplingParams) -> None:
    """INVALID_ARGUMENT naming the field: top_logprobs out of 0-20, or asked without logprobs."""
    if not sampling.HasField("top_logprobs"):
        return
    if sampling.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument("sampling.top_logprobs", f"must be in 0..{MAX_TOP_LOGPROBS}")
    if sampling.top_logprobs and not sampling.logprobs:
        raise InvalidArgument("sampling.top_logprobs", "requires sampling.logprobs")


def with_text(entries: Iterable[pb.TokenLogprob], texts: TokenTexts) -> list[pb.TokenLogprob]:
    """Copies of the worker's entries with each token's text (and each alternative's) filled in."""
    out = []
    for entry in entries:
        filled = pb.TokenLogprob(token_id=entry.token_id, token=texts.text_of(entry.token_id), logprob=entry.logprob)
        filled.top.extend(pb.TopLogprob(token_id=t.token_id, token=texts.text_of(t.token_id), logprob=t.logprob)
                          for t in entry.top)
        out.append(filled)
    return out


# -- OpenAI HTTP ---------------------------------------------------------------------------------------------
def _integer(body: dict, name: str, top: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise InvalidArgument(name, f"must be an integer in 0..{top}")
    return value


def parse_chat(body: dict, sampling: pb.SamplingParams) -> None:
    """Chat's `logprobs` (bool) and `top_logprobs` (0-20, only with logprobs) into `sampling`."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidArgument("logprobs", "must be a boolean")
    top = _integer(body, "top_logprobs", MAX_TOP_LOGPROBS)
    if top and not wanted:
        raise InvalidArgument("top_logprobs", "requires logprobs: true")
    sampling.logprobs = bool(wanted)
    if top is not None and wanted:
        sampling.top_logprobs = top


def parse_completion(body: dict, sampling: pb.SamplingParams) -> None:
    """The legacy `logprobs` integer (0-5): the sampled token's logprob and this many alternatives."""
    top = _integer(body, "logprobs", MAX_LEGACY_LOGPROBS)
    if top is not None:
        sampling.logprobs = True
        sampling.top_logprobs = top


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_content(entries: Iterable[pb.TokenLogprob]) -> dict:
    """choice.logprobs of a chat completion (or of one chunk's tokens)."""
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": _bytes(e.token),
                         "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.token)}
                                          for t in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: Iterable[pb.TokenLogprob], offset: int) -> tuple[dict, int]:
    """choice.logprobs of a legacy completion (or one chunk of it), its tokens starting at character
    `offset` of the completion; and the offset after them."""
    shape: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        shape["tokens"].append(e.token)
        shape["token_logprobs"].append(e.logprob)
        shape["top_logprobs"].append({t.token: t.logprob for t in e.top})
        shape["text_offset"].append(offset)
        offset += len(e.token)
    return shape, offset
