from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_LOW: _ClassVar[Priority]
    PRIORITY_NORMAL: _ClassVar[Priority]
    PRIORITY_HIGH: _ClassVar[Priority]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]

class ModelKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_KIND_UNSPECIFIED: _ClassVar[ModelKind]
    MODEL_KIND_CONCRETE: _ClassVar[ModelKind]
    MODEL_KIND_ALIAS: _ClassVar[ModelKind]
PRIORITY_UNSPECIFIED: Priority
PRIORITY_LOW: Priority
PRIORITY_NORMAL: Priority
PRIORITY_HIGH: Priority
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason
MODEL_KIND_UNSPECIFIED: ModelKind
MODEL_KIND_CONCRETE: ModelKind
MODEL_KIND_ALIAS: ModelKind

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json_schema", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json_schema: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json_schema: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("none", "auto", "required", "function_name")
    NONE_FIELD_NUMBER: _ClassVar[int]
    AUTO_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    none: bool
    auto: bool
    required: bool
    function_name: str
    def __init__(self, none: _Optional[bool] = ..., auto: _Optional[bool] = ..., required: _Optional[bool] = ..., function_name: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop", "seed", "repetition_penalty", "ignore_eos", "response_format", "top_logprobs", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    repetition_penalty: float
    ignore_eos: bool
    response_format: ResponseFormat
    top_logprobs: int
    logprobs: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., ignore_eos: _Optional[bool] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., top_logprobs: _Optional[int] = ..., logprobs: _Optional[bool] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("json_schema", "regex", "choice", "json_object")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    choice: ChoiceList
    json_object: bool
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., json_object: _Optional[bool] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "messages", "sampling", "request_id", "priority", "tools", "tool_choice", "n", "slo_ttft_ms", "slo_tpot_ms", "parallel_tool_calls")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingParams
    request_id: str
    priority: Priority
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    n: int
    slo_ttft_ms: int
    slo_tpot_ms: int
    parallel_tool_calls: bool
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., n: _Optional[int] = ..., slo_ttft_ms: _Optional[int] = ..., slo_tpot_ms: _Optional[int] = ..., parallel_tool_calls: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "queue_ms", "ttft_ms", "total_ms")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    queue_ms: float
    ttft_ms: float
    total_ms: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "index", "finish_reason", "usage", "tool_calls", "logprobs", "choice_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    index: int
    finish_reason: FinishReason
    usage: Usage
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    choice_index: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., index: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., choice_index: _Optional[int] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "tool_calls", "logprobs", "choice_index", "choices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    choice_index: int
    choices: _containers.RepeatedCompositeFieldContainer[CompleteChoice]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., choice_index: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[CompleteChoice, _Mapping]]] = ...) -> None: ...

class CompleteChoice(_message.Message):
    __slots__ = ("choice_index", "text", "token_ids", "finish_reason", "tool_calls", "logprobs")
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    choice_index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, choice_index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text", "messages")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RouteWeight(_message.Message):
    __slots__ = ("model", "weight")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    model: str
    weight: int
    def __init__(self, model: _Optional[str] = ..., weight: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "context_length", "kind", "routes", "is_default", "architecture", "weight_format")
    ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    id: str
    context_length: int
    kind: ModelKind
    routes: _containers.RepeatedCompositeFieldContainer[RouteWeight]
    is_default: bool
    architecture: str
    weight_format: str
    def __init__(self, id: _Optional[str] = ..., context_length: _Optional[int] = ..., kind: _Optional[_Union[ModelKind, str]] = ..., routes: _Optional[_Iterable[_Union[RouteWeight, _Mapping]]] = ..., is_default: _Optional[bool] = ..., architecture: _Optional[str] = ..., weight_format: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...
