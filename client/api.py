"""Python clients for seqserve: blocking (`Client`) and asyncio (`AsyncClient`).

    from client import Client
    with Client("127.0.0.1:8000") as c:
        for chunk in c.stream("Once upon a time", max_new_tokens=50):
            print(chunk.text, end="", flush=True)
        reply = c.generate("Once upon a time", max_new_tokens=50)

Against a server with TLS and a bearer token (docs/security.md):

    Client("server:8000", tls_ca_file="ca.pem", token=os.environ["SEQSERVE_TOKEN"])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Sequence

import grpc

from seqserve.v1 import generate_pb2, generate_pb2_grpc

FINISH_REASONS = {generate_pb2.FINISH_REASON_LENGTH: "length",
                  generate_pb2.FINISH_REASON_EOS: "eos",
                  generate_pb2.FINISH_REASON_STOP: "stop"}


@dataclass
class BeamSequence:
    """One returned beam search hypothesis."""

    text: str
    token_ids: list[int]
    score: float
    finish_reason: str


@dataclass
class Chunk:
    """One streamed message: a token and its text, or (final) the finish reason and counts."""

    text: str
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    sequences: list[BeamSequence] = field(default_factory=list)  # beam search, final chunk


@dataclass
class Reply:
    """A whole generation."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int = 0
    logprobs: list[float | None] = field(default_factory=list)
    # Beam search: the num_return_sequences best hypotheses, best first (the first is text).
    sequences: list[BeamSequence] = field(default_factory=list)


def build_request(prompt: str | Sequence[int], cached_prompt: str = "", request_id: str = "",
                  priority: int = 0, length_hint: int | None = None,
                  eos_after_tokens: int | None = None, **params: Any
                  ) -> generate_pb2.GenerateRequest:
    """A GenerateRequest for a text prompt or a list of token ids; keyword arguments are
    DecodingParameters fields (stop: list). `priority`: lower is more urgent;
    `length_hint` and `eos_after_tokens` as in generate.proto."""
    stop = params.pop("stop", None)
    if isinstance(params.get("early_stopping"), bool):  # the proto field is a string
        params["early_stopping"] = "true" if params["early_stopping"] else "false"
    dp = generate_pb2.DecodingParameters(**{k: v for k, v in params.items() if v is not None})
    if stop:
        dp.stop.extend([stop] if isinstance(stop, str) else stop)
    request = generate_pb2.GenerateRequest(cached_prompt=cached_prompt, parameters=dp,
                                           request_id=request_id, priority=priority)
    if length_hint is not None:
        request.length_hint = length_hint
    if eos_after_tokens is not None:
        request.eos_after_tokens = eos_after_tokens
    if isinstance(prompt, str):
        request.inputs = prompt
    else:
        request.input_ids.SetInParent()  # set even when empty, so the server can say so
        request.input_ids.ids.extend(prompt)
    return request


def response_tokens(msg: generate_pb2.GenerateResponse) -> list[generate_pb2.Token]:
    """The tokens of a streamed message: none, one (`token`) or several (`tokens`, when
    the stream fell behind and the server sent what piled up at once)."""
    if msg.HasField("token"):
        return [msg.token]
    return list(msg.tokens)


def _token_chunk(token: generate_pb2.Token, text: str) -> Chunk:
    chunk = Chunk(text=text, token_id=token.id)
    if token.HasField("logprob"):
        chunk.logprob = token.logprob
    chunk.top_logprobs = [(t.id, t.logprob) for t in token.top_logprobs]
    return chunk


def to_chunks(msg: generate_pb2.GenerateResponse) -> list[Chunk]:
    """The Chunks of a streamed message, one per token, so a message that carries several
    tokens reads as if they had come one by one."""
    if msg.tokens:
        return [_token_chunk(t, text) for t, text in zip(msg.tokens, msg.token_texts)]
    return [to_chunk(msg)]


def to_chunk(msg: generate_pb2.GenerateResponse) -> Chunk:
    """The Chunk of a message with at most one token (see to_chunks)."""
    chunk = Chunk(text=msg.text)
    if msg.HasField("token"):
        chunk = _token_chunk(msg.token, msg.text)
    if msg.finish_reason:
        chunk.finish_reason = FINISH_REASONS[msg.finish_reason]
        chunk.prompt_tokens = msg.usage.prompt_tokens
        chunk.generated_tokens = msg.usage.generated_tokens
        chunk.cached_tokens = msg.usage.cached_tokens
        chunk.sequences = [BeamSequence(s.text, list(s.token_ids), s.score,
                                        FINISH_REASONS[s.finish_reason]) for s in msg.sequences]
    return chunk


def collect(chunks) -> Reply:
    texts, ids, lps, last = [], [], [], None
    for c in chunks:
        texts.append(c.text)
        if c.token_id is not None:
            ids.append(c.token_id)
            lps.append(c.logprob)
        last = c
    return Reply(text="".join(texts), token_ids=ids, finish_reason=last.finish_reason,
                 prompt_tokens=last.prompt_tokens, generated_tokens=last.generated_tokens,
                 cached_tokens=last.cached_tokens, logprobs=lps, sequences=last.sequences)


def channel_credentials(tls_ca_file: str | None = None, tls_cert_file: str | None = None,
                        tls_key_file: str | None = None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting `tls_ca_file` (and presenting a client certificate when
    `tls_cert_file` and `tls_key_file` are given); None when no TLS file is given."""
    if not (tls_ca_file or tls_cert_file or tls_key_file):
        return None
    if bool(tls_cert_file) != bool(tls_key_file):
        raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")

    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(root_certificates=read(tls_ca_file),
                                        private_key=read(tls_key_file),
                                        certificate_chain=read(tls_cert_file))


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The `authorization: Bearer <token>` metadata sent on every call (None: no token)."""
    return (("authorization", f"Bearer {token}"),) if token else None


class Client:
    """Blocking client. `stream` yields Chunks as tokens arrive; `generate` returns a Reply.

    `tls_ca_file`: connect over TLS, trusting this CA (PEM); `tls_cert_file`/`tls_key_file`:
    a client certificate for servers that require one; `token`: the bearer token, sent as
    `authorization` metadata on every call; `channel_options`: gRPC channel arguments.
    """

    def __init__(self, address: str = "127.0.0.1:8000", timeout: float | None = None, *,
                 tls_ca_file: str | None = None, token: str | None = None,
                 tls_cert_file: str | None = None, tls_key_file: str | None = None,
                 channel_options: Sequence[tuple[str, Any]] = ()):
        creds = channel_credentials(tls_ca_file, tls_cert_file, tls_key_file)
        self.channel = (grpc.insecure_channel(address, options=channel_options) if creds is None
                        else grpc.secure_channel(address, creds, options=channel_options))
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.timeout = timeout
        self.metadata = auth_metadata(token)

    def stream(self, prompt: str | Sequence[int], **params: Any) -> Iterator[Chunk]:
        for msg in self.stub.Generate(build_request(prompt, **params), timeout=self.timeout,
                                      metadata=self.metadata):
            yield from to_chunks(msg)

    def generate(self, prompt: str | Sequence[int], **params: Any) -> Reply:
        return collect(self.stream(prompt, **params))

    def model_info(self) -> generate_pb2.ModelInfoResponse:
        return self.stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=self.timeout,
                                   metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client with the same methods and arguments as `Client`."""

    def __init__(self, address: str = "127.0.0.1:8000", timeout: float | None = None, *,
                 tls_ca_file: str | None = None, token: str | None = None,
                 tls_cert_file: str | None = None, tls_key_file: str | None = None,
                 channel_options: Sequence[tuple[str, Any]] = ()):
        creds = channel_credentials(tls_ca_file, tls_cert_file, tls_key_file)
        self.channel = (grpc.aio.insecure_channel(address, options=channel_options)
                        if creds is None
                        else grpc.aio.secure_channel(address, creds, options=channel_options))
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.timeout = timeout
        self.metadata = auth_metadata(token)

    async def stream(self, prompt: str | Sequence[int], **params: Any
                     ) -> AsyncIterator[Chunk]:
        call = self.stub.Generate(build_request(prompt, **params), timeout=self.timeout,
                                  metadata=self.metadata)
        async for msg in call:
            for chunk in to_chunks(msg):
                yield chunk

    async def generate(self, prompt: str | Sequence[int], **params: Any) -> Reply:
        return collect([c async for c in self.stream(prompt, **params)])

    async def model_info(self) -> generate_pb2.ModelInfoResponse:
        return await self.stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=self.timeout,
                                         metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
