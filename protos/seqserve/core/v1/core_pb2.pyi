from seqserve.worker.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_EOS: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ERROR: FinishReason

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("worker", "state")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    worker: _worker_pb2.InfoResponse
    state: CoreState
    def __init__(self, worker: _Optional[_Union[_worker_pb2.InfoResponse, _Mapping]] = ..., state: _Optional[_Union[CoreState, _Mapping]] = ...) -> None: ...

class CoreState(_message.Message):
    __slots__ = ("ready", "kv_budget_tokens")
    READY_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    kv_budget_tokens: int
    def __init__(self, ready: _Optional[bool] = ..., kv_budget_tokens: _Optional[int] = ...) -> None: ...

class OutputsRequest(_message.Message):
    __slots__ = ("frontend",)
    FRONTEND_FIELD_NUMBER: _ClassVar[int]
    frontend: str
    def __init__(self, frontend: _Optional[str] = ...) -> None: ...

class CoreEvent(_message.Message):
    __slots__ = ("outputs", "state")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    outputs: StepOutputs
    state: CoreState
    def __init__(self, outputs: _Optional[_Union[StepOutputs, _Mapping]] = ..., state: _Optional[_Union[CoreState, _Mapping]] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("sequence_ids", "token_ids", "scored", "finished", "waiting")
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    sequence_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    scored: _containers.RepeatedCompositeFieldContainer[ScoredToken]
    finished: _containers.RepeatedCompositeFieldContainer[Finished]
    waiting: int
    def __init__(self, sequence_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., scored: _Optional[_Iterable[_Union[ScoredToken, _Mapping]]] = ..., finished: _Optional[_Iterable[_Union[Finished, _Mapping]]] = ..., waiting: _Optional[int] = ...) -> None: ...

class ScoredToken(_message.Message):
    __slots__ = ("sequence_id", "token_id", "logprob", "top_logprobs")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_worker_pb2.TopLogprob]
    def __init__(self, sequence_id: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[_worker_pb2.TopLogprob, _Mapping]]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("sequence_id", "reason", "error", "cached_tokens", "beams")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BEAMS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    reason: FinishReason
    error: str
    cached_tokens: int
    beams: _containers.RepeatedCompositeFieldContainer[_worker_pb2.BeamHypothesis]
    def __init__(self, sequence_id: _Optional[int] = ..., reason: _Optional[_Union[FinishReason, str]] = ..., error: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., beams: _Optional[_Iterable[_Union[_worker_pb2.BeamHypothesis, _Mapping]]] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("frontend", "sequences")
    FRONTEND_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    frontend: str
    sequences: _containers.RepeatedCompositeFieldContainer[NewRequest]
    def __init__(self, frontend: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("sequence_id", "request_id", "prompt_ids", "decoding", "sampling_seed", "pin_tokens", "priority", "length_hint", "eos_after_tokens", "arrival_time")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SEED_FIELD_NUMBER: _ClassVar[int]
    PIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LENGTH_HINT_FIELD_NUMBER: _ClassVar[int]
    EOS_AFTER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    decoding: Decoding
    sampling_seed: int
    pin_tokens: int
    priority: int
    length_hint: int
    eos_after_tokens: int
    arrival_time: float
    def __init__(self, sequence_id: _Optional[int] = ..., request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., decoding: _Optional[_Union[Decoding, _Mapping]] = ..., sampling_seed: _Optional[int] = ..., pin_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., length_hint: _Optional[int] = ..., eos_after_tokens: _Optional[int] = ..., arrival_time: _Optional[float] = ...) -> None: ...

class Decoding(_message.Message):
    __slots__ = ("max_new_tokens", "strategy", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "ignore_eos", "penalty_alpha", "logprobs", "num_beams", "length_penalty", "early_stopping", "num_return_sequences")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PENALTY_ALPHA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_BEAMS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    NUM_RETURN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    strategy: _worker_pb2.SamplingParams.Strategy
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    repetition_penalty: float
    ignore_eos: bool
    penalty_alpha: float
    logprobs: int
    num_beams: int
    length_penalty: float
    early_stopping: _worker_pb2.EarlyStopping
    num_return_sequences: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., strategy: _Optional[_Union[_worker_pb2.SamplingParams.Strategy, str]] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., ignore_eos: _Optional[bool] = ..., penalty_alpha: _Optional[float] = ..., logprobs: _Optional[int] = ..., num_beams: _Optional[int] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[_Union[_worker_pb2.EarlyStopping, str]] = ..., num_return_sequences: _Optional[int] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("sequence_ids", "stopped")
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    sequence_ids: _containers.RepeatedScalarFieldContainer[int]
    stopped: bool
    def __init__(self, sequence_ids: _Optional[_Iterable[int]] = ..., stopped: _Optional[bool] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RefusalRequest(_message.Message):
    __slots__ = ("code",)
    CODE_FIELD_NUMBER: _ClassVar[int]
    code: str
    def __init__(self, code: _Optional[str] = ...) -> None: ...

class RefusalResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricsResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: bytes
    def __init__(self, text: _Optional[bytes] = ...) -> None: ...
