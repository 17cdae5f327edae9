"""A small synchronous client of the public API, used by `pdflash generate`, benchmarks and tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import grpc

from pdflash.errors import FieldViolation, check
from pdflash.server import CHANNEL_OPTIONS
from pdflash.tls import bearer_metadata, channel_credentials
from pdflash.types import DrafterKind
from pdflash.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from pdflash.validation import generate_violations, logprobs_violations, messages_violations, seconds_violation


@dataclasses.dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: drafter_pb2.Usage
    timings: drafter_pb2.PhaseTimings
    chunks: int
    stop_sequence: str = ""  # the stop sequence that ended the text (finish_reason "stop"), else ""
    logprobs: list[float] | None = None  # with logprobs: one per token id
    top_logprobs: list[list[tuple[int, float]]] | None = None  # with top_logprobs: [(id, logprob), ...] per token id


def _chat_messages(conversation: Sequence[Mapping[str, str]]) -> list[drafter_pb2.ChatMessage]:
    """[{"role", "content"}, ...] (checked by `messages_violations`) -> the request's ChatMessage entries."""
    return [drafter_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in conversation]


class Client:
    """`token`: the drafter's bearer token. TLS: `tls_ca` checks the server (empty with a client
    certificate = the system's roots); `tls_cert`/`tls_key` identify this client to a mutual-TLS
    server; or pass ready `credentials`."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        credentials: grpc.ChannelCredentials | None = None,
        metadata=(),
        *,
        token: str = "",
        tls_ca: str = "",
        tls_cert: str = "",
        tls_key: str = "",
    ):
        if credentials is None:
            credentials = channel_credentials(tls_ca, tls_cert, tls_key)
        self.channel = (
            grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
            if credentials is not None
            else grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        )
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)
        self.metadata = tuple(metadata) + bearer_metadata(token)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def request(
        prompt: str | list[int] | Sequence[Mapping[str, str]],
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        drafter: str | DrafterKind = DrafterKind.UNSPECIFIED,
        block_size: int = 0,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        request_id: str = "",
        fixed_width: bool = False,
        stop: Sequence[str] = (),
        logprobs: bool = False,
        top_logprobs: int = 0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
    ) -> drafter_pb2.GenerateRequest:
        """A GenerateRequest. Every value is checked before it reaches a protobuf field: a value the field
        cannot hold, or one no server accepts, raises `pdflash.errors.InvalidArgument` whose field violations
        use the server's words (`pdflash.validation`). `stop`: stop sequences (the text ends before the first one
        generated; finish reason "stop", `Completion.stop_sequence` names it). `logprobs`: each token's log-probability
        under the target model (`Completion.logprobs`), with `top_logprobs` (0-20) the likeliest tokens a position.
        Penalties (greedy too): `repetition_penalty` (transformers' semantics, 1 = off), `presence_penalty` and
        `frequency_penalty` (OpenAI's, 0 = off); the output is plain decoding's with them.
        `prompt`: text, token ids, or a conversation ([{"role": "user", "content": "..."}, ...]: the model's chat
        template makes the prompt; ModelInfo's chat_template says whether it has one)."""
        chat = not isinstance(prompt, str) and bool(prompt) and all(isinstance(m, Mapping) for m in prompt)
        prompt_tokens = () if isinstance(prompt, str) or chat else list(prompt)
        v = generate_violations(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                block_size=block_size, stop_token_ids=list(stop_token_ids or ()),
                                prompt_tokens=prompt_tokens, request_id=request_id, stop=stop,
                                repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty)
        v.extend(logprobs_violations(logprobs, top_logprobs))
        if chat:
            v.extend(messages_violations(prompt))
        kind = None
        if isinstance(drafter, str):
            kind = DrafterKind.__members__.get(drafter.upper())
        elif drafter in DrafterKind._value2member_map_:
            kind = DrafterKind(drafter)
        if kind is None:
            v.append(FieldViolation("drafter", f"unknown drafter kind {drafter!r}; choose one of "
                                               f"{', '.join(k.name.lower() for k in DrafterKind)}"))
        check(v, "invalid Generate request")
        sampling = common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                             repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                             frequency_penalty=frequency_penalty)
        if seed is not None:
            sampling.seed = seed
        req = drafter_pb2.GenerateRequest(
            request_id=request_id,
            max_tokens=max_tokens,
            sampling=sampling,
            drafter=int(kind),
            block_size=block_size,
            stop_token_ids=stop_token_ids or [],
            ignore_eos=ignore_eos,
            fixed_width=fixed_width,
            stop=list(stop),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
        if isinstance(prompt, str):
            req.prompt = prompt
        elif chat:
            req.messages.messages.extend(_chat_messages(prompt))
        else:
            req.prompt_tokens.ids.extend(prompt_tokens)
        return req

    def stream(self, req: drafter_pb2.GenerateRequest, timeout: float | None = None) -> Iterator[drafter_pb2.GenerateResponse]:
        if timeout is not None:
            check([v for v in (seconds_violation("timeout", timeout),) if v is not None], "invalid Generate call")
        return self.stub.Generate(req, timeout=timeout, metadata=self.metadata)

    def generate(self, prompt: str | list[int] | Sequence[Mapping[str, str]], timeout: float | None = 300.0, **kw) -> Completion:
        req = self.request(prompt, **kw)
        ids: list[int] = []
        text: list[str] = []
        lps: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        chunks = 0
        final = None
        rid = ""
        for msg in self.stream(req, timeout=timeout):
            rid = msg.request_id
            if msg.HasField("chunk"):
                chunks += 1
                ids.extend(msg.chunk.token_ids)
                text.append(msg.chunk.text)
                lps.extend(msg.chunk.logprobs)
                tops.extend(list(zip(t.token_ids, t.logprobs)) for t in msg.chunk.top_logprobs)
            else:
                final = msg.final
                text.append(final.text)
        if final is None:
            raise RuntimeError("stream ended without a final message")
        return Completion(
            request_id=rid,
            token_ids=ids,
            text="".join(text),
            finish_reason=common_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower(),
            usage=final.usage,
            timings=final.timings,
            chunks=chunks,
            stop_sequence=final.stop_sequence,
            logprobs=lps if req.logprobs else None,
            top_logprobs=tops if req.top_logprobs else None,
        )

    def tokenize(self, prompt: str | Sequence[Mapping[str, str]], timeout: float = 10.0) -> drafter_pb2.TokenizeResponse:
        """The token ids Generate would take for this prompt (text, or a conversation through the model's chat
        template): `.ids`, `.count`, `.fits_prompt`."""
        req = drafter_pb2.TokenizeRequest()
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            check(messages_violations(prompt), "invalid Tokenize request")
            req.messages.messages.extend(_chat_messages(prompt))
        return self.stub.Tokenize(req, timeout=timeout, metadata=self.metadata)

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True, timeout: float = 10.0) -> str:
        req = drafter_pb2.DetokenizeRequest(ids=list(ids), skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(req, timeout=timeout, metadata=self.metadata).text

    def model_info(self, timeout: float = 10.0) -> drafter_pb2.ModelInfoResponse:
        return self.stub.ModelInfo(drafter_pb2.ModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def abort(self, request_id: str, timeout: float = 10.0) -> bool:
        return self.stub.Abort(drafter_pb2.AbortRequest(request_id=request_id), timeout=timeout, metadata=self.metadata).aborted
