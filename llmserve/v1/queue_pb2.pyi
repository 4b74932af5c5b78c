from llmserve.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResolvedSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "seed", "repetition_penalty", "stop_token_ids", "response_format", "logprobs", "top_logprobs", "tool_grammar")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int
    repetition_penalty: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    response_format: _inference_pb2.ResponseFormat
    logprobs: bool
    top_logprobs: int
    tool_grammar: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., response_format: _Optional[_Union[_inference_pb2.ResponseFormat, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., tool_grammar: _Optional[str] = ...) -> None: ...

class WorkItem(_message.Message):
    __slots__ = ("request_id", "tenant", "model", "prompt_token_ids", "sampling", "priority", "deadline_unix_ms", "arrival_unix_ms", "enqueued_unix_ms", "events_key", "cancel_key", "generated_token_ids", "deliveries", "cache_salt", "dispatch_epoch", "tenant_weight", "trace_context", "n", "choices", "slo_ttft_ms", "slo_tpot_ms")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ENQUEUED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_KEY_FIELD_NUMBER: _ClassVar[int]
    CANCEL_KEY_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: ResolvedSampling
    priority: _inference_pb2.Priority
    deadline_unix_ms: int
    arrival_unix_ms: int
    enqueued_unix_ms: int
    events_key: str
    cancel_key: str
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    deliveries: int
    cache_salt: str
    dispatch_epoch: int
    tenant_weight: float
    trace_context: _containers.ScalarMap[str, str]
    n: int
    choices: _containers.RepeatedCompositeFieldContainer[ChoiceProgress]
    slo_ttft_ms: int
    slo_tpot_ms: int
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[ResolvedSampling, _Mapping]] = ..., priority: _Optional[_Union[_inference_pb2.Priority, str]] = ..., deadline_unix_ms: _Optional[int] = ..., arrival_unix_ms: _Optional[int] = ..., enqueued_unix_ms: _Optional[int] = ..., events_key: _Optional[str] = ..., cancel_key: _Optional[str] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., deliveries: _Optional[int] = ..., cache_salt: _Optional[str] = ..., dispatch_epoch: _Optional[int] = ..., tenant_weight: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., n: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[ChoiceProgress, _Mapping]]] = ..., slo_ttft_ms: _Optional[int] = ..., slo_tpot_ms: _Optional[int] = ...) -> None: ...

class ChoiceProgress(_message.Message):
    __slots__ = ("index", "generated_token_ids")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., generated_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("batch_id", "items", "created_unix_ms")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    items: _containers.RepeatedCompositeFieldContainer[WorkItem]
    created_unix_ms: int
    def __init__(self, batch_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[WorkItem, _Mapping]]] = ..., created_unix_ms: _Optional[int] = ...) -> None: ...

class EventError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "finish_reason", "error", "prompt_tokens", "cached_prompt_tokens", "admitted_unix_ms", "worker_id", "final", "dispatch_epoch", "logprobs", "choice_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _inference_pb2.FinishReason
    error: EventError
    prompt_tokens: int
    cached_prompt_tokens: int
    admitted_unix_ms: int
    worker_id: str
    final: bool
    dispatch_epoch: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_inference_pb2.TokenLogprob]
    choice_index: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_inference_pb2.FinishReason, str]] = ..., error: _Optional[_Union[EventError, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., admitted_unix_ms: _Optional[int] = ..., worker_id: _Optional[str] = ..., final: _Optional[bool] = ..., dispatch_epoch: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_inference_pb2.TokenLogprob, _Mapping]]] = ..., choice_index: _Optional[int] = ...) -> None: ...

class WorkerHeartbeat(_message.Message):
    __slots__ = ("worker_id", "model", "free_blocks", "total_blocks", "block_size", "running", "waiting", "max_running", "draining", "sent_unix_ms", "cached_prefix_hashes", "admin_address", "architecture", "weight_format", "preemptible_seqs", "preemptible_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    ADMIN_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIBLE_SEQS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIBLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    free_blocks: int
    total_blocks: int
    block_size: int
    running: int
    waiting: int
    max_running: int
    draining: bool
    sent_unix_ms: int
    cached_prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    admin_address: str
    architecture: str
    weight_format: str
    preemptible_seqs: int
    preemptible_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., max_running: _Optional[int] = ..., draining: _Optional[bool] = ..., sent_unix_ms: _Optional[int] = ..., cached_prefix_hashes: _Optional[_Iterable[int]] = ..., admin_address: _Optional[str] = ..., architecture: _Optional[str] = ..., weight_format: _Optional[str] = ..., preemptible_seqs: _Optional[int] = ..., preemptible_blocks: _Optional[int] = ...) -> None: ...
