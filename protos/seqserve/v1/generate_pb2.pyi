from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("inputs", "input_ids", "cached_prompt", "parameters", "request_id", "priority", "length_hint", "eos_after_tokens")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LENGTH_HINT_FIELD_NUMBER: _ClassVar[int]
    EOS_AFTER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    inputs: str
    input_ids: TokenIds
    cached_prompt: str
    parameters: DecodingParameters
    request_id: str
    priority: int
    length_hint: int
    eos_after_tokens: int
    def __init__(self, inputs: _Optional[str] = ..., input_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., cached_prompt: _Optional[str] = ..., parameters: _Optional[_Union[DecodingParameters, _Mapping]] = ..., request_id: _Optional[str] = ..., priority: _Optional[int] = ..., length_hint: _Optional[int] = ..., eos_after_tokens: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodingParameters(_message.Message):
    __slots__ = ("max_new_tokens", "decoding_strategy", "do_sample", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "seed", "stop", "ignore_eos", "penalty_alpha", "logprobs", "num_beams", "length_penalty", "early_stopping", "num_return_sequences")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODING_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PENALTY_ALPHA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_BEAMS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    NUM_RETURN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    decoding_strategy: str
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    repetition_penalty: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    penalty_alpha: float
    logprobs: int
    num_beams: int
    length_penalty: float
    early_stopping: str
    num_return_sequences: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., decoding_strategy: _Optional[str] = ..., do_sample: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., penalty_alpha: _Optional[float] = ..., logprobs: _Optional[int] = ..., num_beams: _Optional[int] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[str] = ..., num_return_sequences: _Optional[int] = ...) -> None: ...

class ReturnedSequence(_message.Message):
    __slots__ = ("text", "token_ids", "score", "finish_reason")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    score: float
    finish_reason: FinishReason
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., score: _Optional[float] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("id", "text", "logprob")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    logprob: float
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "logprob", "top_logprobs")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token", "text", "finish_reason", "usage", "sequences", "tokens", "token_texts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token: Token
    text: str
    finish_reason: FinishReason
    usage: Usage
    sequences: _containers.RepeatedCompositeFieldContainer[ReturnedSequence]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    token_texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., token: _Optional[_Union[Token, _Mapping]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., sequences: _Optional[_Iterable[_Union[ReturnedSequence, _Mapping]]] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., token_texts: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("request_id", "generated_text", "finish_reason", "usage", "tokens", "sequences")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generated_text: str
    finish_reason: FinishReason
    usage: Usage
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    sequences: _containers.RepeatedCompositeFieldContainer[ReturnedSequence]
    def __init__(self, request_id: _Optional[str] = ..., generated_text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., sequences: _Optional[_Iterable[_Union[ReturnedSequence, _Mapping]]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model_id", "architecture", "vocab_size", "max_position_embeddings", "dtype", "device", "max_new_tokens_limit", "decoding_strategy", "max_rolling_batch_size", "max_sparsity", "max_splits", "kv_budget_tokens", "eos_token_ids")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    DECODING_STRATEGY_FIELD_NUMBER: _ClassVar[int]
    MAX_ROLLING_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SPARSITY_FIELD_NUMBER: _ClassVar[int]
    MAX_SPLITS_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    device: str
    max_new_tokens_limit: int
    decoding_strategy: str
    max_rolling_batch_size: int
    max_sparsity: float
    max_splits: int
    kv_budget_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_new_tokens_limit: _Optional[int] = ..., decoding_strategy: _Optional[str] = ..., max_rolling_batch_size: _Optional[int] = ..., max_sparsity: _Optional[float] = ..., max_splits: _Optional[int] = ..., kv_budget_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
