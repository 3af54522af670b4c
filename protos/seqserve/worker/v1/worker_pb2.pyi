from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EarlyStopping(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EARLY_STOPPING_FALSE: _ClassVar[EarlyStopping]
    EARLY_STOPPING_TRUE: _ClassVar[EarlyStopping]
    EARLY_STOPPING_NEVER: _ClassVar[EarlyStopping]
EARLY_STOPPING_FALSE: EarlyStopping
EARLY_STOPPING_TRUE: EarlyStopping
EARLY_STOPPING_NEVER: EarlyStopping

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_id", "architecture", "vocab_size", "eos_token_ids", "max_position_embeddings", "dtype", "device", "kv_capacity_tokens", "steps_link_port", "kv_bytes_per_token", "swap_capacity_bytes", "swap_bytes_per_second", "prefill_tokens_per_second", "urgent_steps")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_LINK_PORT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SWAP_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAP_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    URGENT_STEPS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    architecture: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_position_embeddings: int
    dtype: str
    device: str
    kv_capacity_tokens: int
    steps_link_port: int
    kv_bytes_per_token: int
    swap_capacity_bytes: int
    swap_bytes_per_second: float
    prefill_tokens_per_second: float
    urgent_steps: bool
    def __init__(self, model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_position_embeddings: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., kv_capacity_tokens: _Optional[int] = ..., steps_link_port: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., swap_capacity_bytes: _Optional[int] = ..., swap_bytes_per_second: _Optional[float] = ..., prefill_tokens_per_second: _Optional[float] = ..., urgent_steps: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("strategy", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "seed", "penalty_alpha", "logprobs", "beam")
    class Strategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STRATEGY_GREEDY: _ClassVar[SamplingParams.Strategy]
        STRATEGY_SAMPLE: _ClassVar[SamplingParams.Strategy]
        STRATEGY_CONTRASTIVE: _ClassVar[SamplingParams.Strategy]
        STRATEGY_BEAM: _ClassVar[SamplingParams.Strategy]
    STRATEGY_GREEDY: SamplingParams.Strategy
    STRATEGY_SAMPLE: SamplingParams.Strategy
    STRATEGY_CONTRASTIVE: SamplingParams.Strategy
    STRATEGY_BEAM: SamplingParams.Strategy
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PENALTY_ALPHA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BEAM_FIELD_NUMBER: _ClassVar[int]
    strategy: SamplingParams.Strategy
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    repetition_penalty: float
    seed: int
    penalty_alpha: float
    logprobs: int
    beam: BeamParams
    def __init__(self, strategy: _Optional[_Union[SamplingParams.Strategy, str]] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., penalty_alpha: _Optional[float] = ..., logprobs: _Optional[int] = ..., beam: _Optional[_Union[BeamParams, _Mapping]] = ...) -> None: ...

class BeamParams(_message.Message):
    __slots__ = ("num_beams", "length_penalty", "early_stopping", "num_return_sequences", "max_new_tokens")
    NUM_BEAMS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    NUM_RETURN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_beams: int
    length_penalty: float
    early_stopping: EarlyStopping
    num_return_sequences: int
    max_new_tokens: int
    def __init__(self, num_beams: _Optional[int] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[_Union[EarlyStopping, str]] = ..., num_return_sequences: _Optional[int] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("sequence_id", "token_ids", "num_generated", "params", "pin_tokens", "prefill_end")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_END_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_generated: int
    params: SamplingParams
    pin_tokens: int
    prefill_end: int
    def __init__(self, sequence_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_generated: _Optional[int] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., pin_tokens: _Optional[int] = ..., prefill_end: _Optional[int] = ...) -> None: ...

class PrefillChunk(_message.Message):
    __slots__ = ("sequence_id", "end")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    end: int
    def __init__(self, sequence_id: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("sequence_ids",)
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    sequence_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "release", "prefill", "groups", "chunks", "finished", "swap_out", "swap_in", "prefetch", "unprefetch", "urgent")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    UNPREFETCH_FIELD_NUMBER: _ClassVar[int]
    URGENT_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    release: _containers.RepeatedScalarFieldContainer[int]
    prefill: _containers.RepeatedCompositeFieldContainer[NewSequence]
    groups: _containers.RepeatedCompositeFieldContainer[Group]
    chunks: _containers.RepeatedCompositeFieldContainer[PrefillChunk]
    finished: _containers.RepeatedCompositeFieldContainer[FinishedSequence]
    swap_out: _containers.RepeatedScalarFieldContainer[int]
    swap_in: _containers.RepeatedScalarFieldContainer[int]
    prefetch: _containers.RepeatedScalarFieldContainer[int]
    unprefetch: _containers.RepeatedScalarFieldContainer[int]
    urgent: bool
    def __init__(self, step_id: _Optional[int] = ..., release: _Optional[_Iterable[int]] = ..., prefill: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[Group, _Mapping]]] = ..., chunks: _Optional[_Iterable[_Union[PrefillChunk, _Mapping]]] = ..., finished: _Optional[_Iterable[_Union[FinishedSequence, _Mapping]]] = ..., swap_out: _Optional[_Iterable[int]] = ..., swap_in: _Optional[_Iterable[int]] = ..., prefetch: _Optional[_Iterable[int]] = ..., unprefetch: _Optional[_Iterable[int]] = ..., urgent: _Optional[bool] = ...) -> None: ...

class FinishedSequence(_message.Message):
    __slots__ = ("sequence_id", "generated_tokens", "exact")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    generated_tokens: int
    exact: bool
    def __init__(self, sequence_id: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., exact: _Optional[bool] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("id", "logprob")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    logprob: float
    def __init__(self, id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class SequenceToken(_message.Message):
    __slots__ = ("sequence_id", "token_id", "logprob", "top_logprobs", "cached_tokens", "beam_running", "beams", "predicted_output_tokens")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BEAM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    BEAMS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: int
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    cached_tokens: int
    beam_running: bool
    beams: _containers.RepeatedCompositeFieldContainer[BeamHypothesis]
    predicted_output_tokens: int
    def __init__(self, sequence_id: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., cached_tokens: _Optional[int] = ..., beam_running: _Optional[bool] = ..., beams: _Optional[_Iterable[_Union[BeamHypothesis, _Mapping]]] = ..., predicted_output_tokens: _Optional[int] = ...) -> None: ...

class BeamHypothesis(_message.Message):
    __slots__ = ("token_ids", "score")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    score: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., score: _Optional[float] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "tokens", "regroup_bytes", "kv_slots", "kv_tokens", "prefix_cache_bytes", "worker_seconds")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    REGROUP_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    tokens: _containers.RepeatedCompositeFieldContainer[SequenceToken]
    regroup_bytes: int
    kv_slots: int
    kv_tokens: int
    prefix_cache_bytes: int
    worker_seconds: float
    def __init__(self, step_id: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[SequenceToken, _Mapping]]] = ..., regroup_bytes: _Optional[int] = ..., kv_slots: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., prefix_cache_bytes: _Optional[int] = ..., worker_seconds: _Optional[float] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepsLinkHello(_message.Message):
    __slots__ = ("control_token",)
    CONTROL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    control_token: str
    def __init__(self, control_token: _Optional[str] = ...) -> None: ...

class StepsLinkError(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: str
    details: str
    def __init__(self, code: _Optional[str] = ..., details: _Optional[str] = ...) -> None: ...

class StepsLinkFrame(_message.Message):
    __slots__ = ("response", "error")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    response: StepResponse
    error: StepsLinkError
    def __init__(self, response: _Optional[_Union[StepResponse, _Mapping]] = ..., error: _Optional[_Union[StepsLinkError, _Mapping]] = ...) -> None: ...
