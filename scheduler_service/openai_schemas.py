"""Request bodies of the OpenAI-compatible API (openai_api.py) as pydantic models, and their
mapping to the front end's decoding parameters.

Bodies are parsed strictly (a string where a number belongs is an error, not coerced) and
unknown fields are refused by name: OpenAI's fields that seqserve cannot honour get a 400
saying so, and seqserve's own parameters are accepted as extra body fields, as vLLM takes
its own. Every error becomes an `ApiError` whose `param` names the field.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from scheduler_service.frontend import MAX_CHOICES
from scheduler_service.params import MAX_LOGPROBS

# seqserve's parameters a body may carry beside OpenAI's (the extras vLLM-style clients send
# with `extra_body`).
SEQSERVE_EXTRAS = ("top_k", "penalty_alpha", "decoding_strategy", "repetition_penalty",
                   "ignore_eos", "typical_p", "num_beams", "length_penalty", "early_stopping",
                   "priority", "length_hint", "eos_after_tokens")
ROLES = ("system", "developer", "user", "assistant")


class ApiError(Exception):
    """An error answered as OpenAI's error object, with its HTTP status."""

    TYPES = {429: "rate_limit_exceeded", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500
                              else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


def _unsupported(name: str, why: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", f"{name} is not supported: {why}")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(BaseModel):
    """One part of a message's content: only text parts are served."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":
            raise _unsupported(f"a content part of type {value!r}",
                               "this server serves text-only models; send text parts")
        return value


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart]
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, value: str) -> str:
        if value in ("tool", "function"):
            raise _unsupported(f"role {value!r}", "this server has no tool calling")
        if value not in ROLES:
            raise PydanticCustomError("role", f"unknown role {value!r}; roles: "
                                      f"{', '.join(ROLES)}")
        return value

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)


class _Common(_Strict):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # seqserve's own parameters (SEQSERVE_EXTRAS)
    top_k: int | None = None
    penalty_alpha: float | None = None
    decoding_strategy: str | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    typical_p: float | None = None
    # Beam search (the best hypothesis is the choice; temperature is then ignored, as
    # Hugging Face generate ignores it without sampling)
    num_beams: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    # vLLM's extra parameter: lower is more urgent (option.scheduling_policy=priority).
    priority: int = 0
    # As generate.proto's 14 and 15 (params.TOKEN_COUNTS): the expected output length
    # (policy length-batched), and, for benchmarks, an end as by EOS after that many
    # tokens; the front end refuses a value < 1.
    length_hint: int | None = None
    eos_after_tokens: int | None = None

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value, info):
        if value:
            raise _unsupported(info.field_name, "the worker has no frequency or presence "
                               "penalty; send 0 or leave it out (repetition_penalty is "
                               "seqserve's)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value):
        if value:
            raise _unsupported("logit_bias", "send {} or leave it out")
        return value

    def max_new_tokens(self) -> tuple[int | None, str]:
        """(the limit asked for, the field it came from)."""
        return self.max_tokens, "max_tokens"


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    cached_prompt: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value):
        if isinstance(value, list) and (not value or any(v == [] for v in value)):
            raise PydanticCustomError("empty", "the prompt list and each token-id list "
                                      "inside it must be non-empty")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value):
        if value:
            raise _unsupported("echo", "the reply holds the completion only")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value):
        if value is not None and value > 1:
            raise _unsupported("best_of", "use n for several choices")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise _unsupported("suffix", "this server does not insert text")
        return value

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value, info):
        if value:
            raise _unsupported(info.field_name, "this server has no tool calling")
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value, info):
        if value is not None and value != "none":
            raise _unsupported(info.field_name, "this server has no tool calling")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value):
        if value is not None and value != {"type": "text"}:
            raise _unsupported("response_format", "only {\"type\": \"text\"} is served")
        return value

    def max_new_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


def decoding_params(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """The request's decoding parameters as the front end names them (params.resolve checks
    their ranges). temperature 0 means greedy, as in OpenAI and vLLM; a positive
    temperature means sampling unless decoding_strategy says otherwise."""
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    out: dict[str, Any] = {}
    limit, _ = req.max_new_tokens()
    if limit is not None:
        out["max_new_tokens"] = limit
    strategy = req.decoding_strategy
    if (req.num_beams or 1) > 1 and strategy is None:
        pass  # beam search: num_beams decides, whatever the temperature
    elif req.temperature == 0:
        if strategy not in (None, "greedy"):
            raise ApiError(400, f"temperature 0 means greedy decoding; with decoding_strategy "
                           f"{strategy!r} send a temperature > 0", "temperature")
        strategy = "greedy"
    elif req.temperature is not None:
        out["temperature"] = req.temperature
        strategy = strategy or "sample"
    if strategy is not None:
        out["decoding_strategy"] = strategy
    for name in ("top_p", "seed", "top_k", "penalty_alpha", "repetition_penalty", "ignore_eos",
                 "typical_p", "num_beams", "length_penalty", "early_stopping"):
        if getattr(req, name) is not None:
            out[name] = getattr(req, name)
    if req.stop is not None:
        out["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if req.logprobs:
            out["logprobs"] = req.top_logprobs or 0
    elif req.logprobs is not None:
        out["logprobs"] = req.logprobs
    return out


_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-.*)$")
_UNION_MESSAGES = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of "
              "token-id lists",
    "stop": "stop must be a string or a list of strings",
}


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse(model: type[_Strict], raw: bytes) -> _Strict:
    """The body as `model`, or an ApiError (400) naming the first field at fault."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        raise ApiError(400, f"the body is not valid JSON ({first['msg']})")
    if first["type"] == "model_type":
        raise ApiError(400, "the body must be a JSON object")
    # A value that fits no member of a union errs once per member: keep the deepest
    # errors and drop the members' tags from their locations.
    cleaned = [(tuple(p for p in e["loc"] if not (isinstance(p, str) and _UNION_TAG.match(p))),
                e) for e in errors]
    depth = max(len(loc) for loc, _ in cleaned)
    loc, err = next((loc, e) for loc, e in cleaned if len(loc) == depth)
    param = _param(loc) or None
    tagged = len(loc) != len(err["loc"])
    if err["type"] == "extra_forbidden":
        message = (f"unknown field {param!r}; seqserve's own parameters: "
                   f"{', '.join(SEQSERVE_EXTRAS)} (and cached_prompt, for completions)"
                   if len(loc) == 1 else
                   f"unknown field {param!r}")
    elif tagged and loc and loc[0] in _UNION_MESSAGES:
        message = _UNION_MESSAGES[loc[0]]
    else:
        message = " or ".join(dict.fromkeys(e["msg"] for lc, e in cleaned if lc == loc))
        if loc and not message.startswith(str(loc[-1])):
            message = f"{param}: {message}"
    raise ApiError(400, message, param)
