"""Request validation before any work is queued. Every failure is INVALID_ARGUMENT
naming the field (`sampling.top_p: must be in (0, 1]`).

Two stages: `validate_request` (shape, ranges and sizes: cheap, before the quota; the
response_format's compile comes after it, gateway/response_format.py) and
`resolve_sampling` (lengths against the model's context and the tenant's cap,
once the prompt's token count is known).
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass

from gateway import choices, logprobs
from gateway.response_format import check_size
from gateway.tool_calls import check_tools
from llmserve.runtime.errors import InvalidArgument
from llmserve.v1 import inference_pb2 as pb
from llmserve.v1 import queue_pb2

ROLES = frozenset({"system", "user", "assistant", "tool"})
PRIORITY_VALUES = frozenset({pb.PRIORITY_UNSPECIFIED, pb.PRIORITY_LOW, pb.PRIORITY_NORMAL, pb.PRIORITY_HIGH})
# No braces (they would break Redis hash tags), no whitespace, printable ASCII.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]+")


@dataclass(frozen=True)
class RequestLimits:
    """Gateway-wide bounds on request shape (from GatewaySettings)."""

    max_prompt_bytes: int = 1_000_000
    max_messages: int = 512
    max_stop_strings: int = 8
    max_stop_chars: int = 64
    max_request_id_chars: int = 128
    default_max_new_tokens: int = 256
    max_response_format_bytes: int = 65_536   # a JSON schema / regex / all choices together
    max_response_format_choices: int = 1024


def _utf8_len(field: str, text: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument(field, "is not valid UTF-8") from None


def _check_messages(messages, limits: RequestLimits) -> int:
    if len(messages) > limits.max_messages:
        raise InvalidArgument("messages", f"at most {limits.max_messages} messages")
    total = 0
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role", f"must be one of {', '.join(sorted(ROLES))}")
        total += _utf8_len(f"messages[{i}].content", message.content)
    if total > limits.max_prompt_bytes:
        raise InvalidArgument("messages", f"contents exceed {limits.max_prompt_bytes} bytes")
    return total


def check_input(prompt: str, messages, limits: RequestLimits, prompt_field: str = "prompt") -> None:
    """Exactly one of prompt/messages, valid UTF-8, within the size limits."""
    if bool(prompt) == bool(messages):
        raise InvalidArgument(prompt_field, f"exactly one of {prompt_field} and messages must be set")
    if prompt and _utf8_len(prompt_field, prompt) > limits.max_prompt_bytes:
        raise InvalidArgument(prompt_field, f"exceeds {limits.max_prompt_bytes} bytes")
    if messages:
        _check_messages(messages, limits)


def _check_float(field: str, value: float, ok: bool, why: str) -> None:
    if math.isnan(value) or math.isinf(value) or not ok:
        raise InvalidArgument(field, why)


def _check_stops(stops, limits: RequestLimits) -> None:
    if len(stops) > limits.max_stop_strings:
        raise InvalidArgument("sampling.stop", f"at most {limits.max_stop_strings} stop strings")
    for i, stop in enumerate(stops):
        _utf8_len(f"sampling.stop[{i}]", stop)
        if not stop or len(stop) > limits.max_stop_chars:
            raise InvalidArgument(f"sampling.stop[{i}]", f"must be 1..{limits.max_stop_chars} characters")


def check_sampling(s: pb.SamplingParams, limits: RequestLimits) -> None:
    if s.HasField("temperature"):
        _check_float("sampling.temperature", s.temperature, s.temperature >= 0, "must be >= 0")
    if s.HasField("top_p"):
        _check_float("sampling.top_p", s.top_p, 0 < s.top_p <= 1, "must be in (0, 1]")
    if s.HasField("top_k") and s.top_k < 0:
        raise InvalidArgument("sampling.top_k", "must be >= 0")
    if s.HasField("repetition_penalty"):
        _check_float("sampling.repetition_penalty", s.repetition_penalty, s.repetition_penalty > 0, "must be > 0")
    if s.HasField("max_new_tokens") and s.max_new_tokens < 1:
        raise InvalidArgument("sampling.max_new_tokens", "must be >= 1")
    _check_stops(s.stop, limits)
    check_size(s.response_format, limits.max_response_format_bytes, limits.max_response_format_choices)
    logprobs.check(s)


def check_request_id(request_id: str, limits: RequestLimits) -> None:
    if not request_id:
        return
    if len(request_id) > limits.max_request_id_chars or not REQUEST_ID.fullmatch(request_id):
        raise InvalidArgument("request_id", f"must be 1..{limits.max_request_id_chars} characters of "
                                            "A-Z a-z 0-9 . _ : -")


def validate_request(request: pb.GenerateRequest, limits: RequestLimits) -> None:
    """Everything cheap enough to check before the quota admits the request (no compile, no tokenizing)."""
    check_request_id(request.request_id, limits)
    check_input(request.prompt, request.messages, limits)
    check_sampling(request.sampling, limits)
    choices.check(request)
    check_tools(request, limits.max_response_format_bytes)
    if request.priority not in PRIORITY_VALUES:
        raise InvalidArgument("priority", "unknown priority")


def resolve_sampling(s: pb.SamplingParams, prompt_tokens: int, context_length: int, tenant_cap: int,
                     limits: RequestLimits) -> queue_pb2.ResolvedSampling:
    """Defaults filled in; max_new_tokens checked against the tenant cap and the context left."""
    input_field = "prompt"
    room = context_length - prompt_tokens
    if room < 1:
        raise InvalidArgument(input_field, f"{prompt_tokens} prompt tokens leave no room in the "
                                           f"{context_length}-token context")
    if s.HasField("max_new_tokens"):
        if s.max_new_tokens > tenant_cap:
            raise InvalidArgument("sampling.max_new_tokens", f"exceeds the tenant cap of {tenant_cap}")
        if s.max_new_tokens > room:
            raise InvalidArgument("sampling.max_new_tokens", f"{prompt_tokens} prompt + {s.max_new_tokens} "
                                                             f"exceeds the {context_length}-token context")
        max_new = s.max_new_tokens
    else:
        max_new = min(limits.default_max_new_tokens, tenant_cap, room)
    return queue_pb2.ResolvedSampling(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        max_new_tokens=max_new,
        seed=s.seed if s.HasField("seed") else secrets.randbits(63),  # unset: not reproducible
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        response_format=s.response_format if s.HasField("response_format") else None,
        logprobs=s.logprobs, top_logprobs=s.top_logprobs if s.logprobs else 0,
    )
