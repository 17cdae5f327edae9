"""The drafter's clients of the scheduler and the verifier: protobuf stays here, plain types go out.

Python gRPC does not propagate deadlines: every call takes the caller's remaining time as timeout.
Downstream failures come back as PdflashError naming the hop.
"""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np

from pdflash import convert
from pdflash.errors import Unavailable, from_rpc_error
from pdflash.server import channel
from pdflash.types import DraftResult, ExpertUnion, FinishReason, SamplingParams
from pdflash.v1 import scheduler_pb2, scheduler_pb2_grpc, verifier_pb2, verifier_pb2_grpc


@dataclasses.dataclass
class TargetInfo:
    model: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_context: int
    byte_map: dict[int, list[int]]
    eos_token_ids: tuple[int, ...]
    max_block_size: int
    expert_cache_bytes: int = 0  # offloaded experts: the bytes of experts the verifier's cache can keep (0: no cache)


@dataclasses.dataclass
class PrefillOut:
    session_id: str
    first_token: int
    finished: FinishReason | None
    features: np.ndarray | None
    routed_union: ExpertUnion
    routed_bytes: int
    server_ms: float
    logprobs: list[float] | None = None  # with logprobs: first_token's
    top_logprobs: list[tuple[list[int], list[float]]] | None = None


@dataclasses.dataclass
class VerifyOut:
    tokens: list[int]
    num_accepted: int
    finished: FinishReason | None
    features: np.ndarray | None
    routed_union: ExpertUnion
    routed_bytes: int
    server_ms: float
    forward_ms: float
    offloaded: bool = False  # the verifier streamed offloaded experts for this verify (it reported their cache)
    logprobs: list[float] | None = None  # with logprobs: one per token
    top_logprobs: list[tuple[list[int], list[float]]] | None = None


@dataclasses.dataclass
class TicketInfo:
    ticket_id: str
    signature: str
    expires_at_unix: float
    waited_ms: float
    tokens: int = 0  # the demand admitted (for an ahead admission: the most the block may use)
    expert_bytes: int = 0
    deferred: bool = False  # an ahead admission that was not seated: no ticket, nothing held


def _finish(finished: bool, reason: int) -> FinishReason | None:
    return FinishReason(reason) if finished else None


class VerifierClient:
    def __init__(self, target: str, credentials: grpc.ChannelCredentials | None = None):
        self.target = target
        self.channel = channel(target, credentials)
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def model_info(self, timeout: float | None = None, wait_for_ready: bool = False) -> TargetInfo:
        try:
            r = await self.stub.GetModelInfo(verifier_pb2.VerifierModelInfoRequest(), timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"verifier {self.target}") from None
        return TargetInfo(
            model=r.model,
            architecture=r.architecture,
            num_layers=r.num_layers,
            hidden_size=r.hidden_size,
            vocab_size=r.vocab_size,
            max_context=r.max_context,
            byte_map={le.layer: list(le.expert_bytes) for le in r.expert_bytes},
            eos_token_ids=tuple(r.eos_token_ids),
            max_block_size=r.max_block_size,
            expert_cache_bytes=r.expert_cache_bytes,
        )

    async def prefill(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        stop_token_ids: list[int],
        ignore_eos: bool,
        feature_layer_ids: list[int],
        timeout: float | None,
        logprobs: bool = False,
        top_logprobs: int = 0,
    ) -> PrefillOut:
        req = verifier_pb2.PrefillRequest(
            request_id=request_id,
            prompt_tokens=prompt,
            sampling=convert.sampling_to_pb(sampling),
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            feature_layer_ids=feature_layer_ids,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
        try:
            r = await self.stub.Prefill(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "verifier Prefill") from None
        return PrefillOut(
            session_id=r.session_id,
            first_token=r.first_token,
            finished=_finish(r.finished, r.finish_reason),
            features=convert.array_from_pb(r.features) if r.HasField("features") else None,
            routed_union=convert.union_from_pb(r.routed_union),
            routed_bytes=r.routed_bytes,
            server_ms=r.timings.total_ms,
            logprobs=list(r.logprobs) or None,
            top_logprobs=convert.top_logprobs_from_pb(r.top_logprobs),
        )

    async def verify(
        self, request_id: str, draft: DraftResult, ticket: TicketInfo | None, return_features: bool, timeout: float | None
    ) -> VerifyOut:
        try:
            r = await self.stub.Verify(_verify_request(request_id, draft, ticket, return_features), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "verifier Verify") from None
        return _verify_out(r)

    def open_verify_stream(self, timeout: float | None) -> "VerifyStream":
        """A VerifyStream for one session's rounds; `timeout` bounds the whole stream (the request's deadline)."""
        return VerifyStream(self.stub.VerifyStream(timeout=timeout))

    async def end(self, session_id: str, timeout: float = 5.0) -> bool:
        try:
            r = await self.stub.EndSession(verifier_pb2.EndSessionRequest(session_id=session_id), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "verifier EndSession") from None
        return r.ended


def _verify_request(request_id: str, draft: DraftResult, ticket: TicketInfo | None, return_features: bool) -> verifier_pb2.VerifyRequest:
    req = verifier_pb2.VerifyRequest(request_id=request_id, draft=convert.draft_to_pb(draft), return_features=return_features)
    if ticket is not None:
        req.ticket_id = ticket.ticket_id
        req.ticket_signature = ticket.signature
        req.ticket_expires_at_unix = ticket.expires_at_unix
        if ticket.tokens:  # the demand admitted; ahead of drafting it may exceed the block
            req.ticket_tokens = ticket.tokens
            req.ticket_expert_bytes = ticket.expert_bytes
    return req


def _verify_out(r: verifier_pb2.VerifyResult) -> VerifyOut:
    return VerifyOut(
        tokens=list(r.accepted_tokens),
        num_accepted=r.num_accepted_drafts,
        finished=_finish(r.finished, r.finish_reason),
        features=convert.array_from_pb(r.features) if r.HasField("features") else None,
        routed_union=convert.union_from_pb(r.routed_union),
        routed_bytes=r.routed_bytes,
        server_ms=r.timings.total_ms,
        forward_ms=r.timings.forward_ms,
        offloaded=r.HasField("expert_cache"),
        logprobs=list(r.logprobs) or None,
        top_logprobs=convert.top_logprobs_from_pb(r.top_logprobs),
    )


class VerifyStream:
    """One session's rounds over one Verifier.VerifyStream call: one request, one answer, in turn.

    `verify` has VerifierClient.verify's signature (the per-call timeout is ignored: the stream carries
    the request's deadline); `send` then `receive` is the same in two steps, so a caller can do other
    work once the request is on its way. After an error or a cancelled round the stream is unusable:
    `cancel` it.
    """

    def __init__(self, call):
        self.call = call

    async def verify(
        self, request_id: str, draft: DraftResult, ticket: TicketInfo | None, return_features: bool, timeout: float | None = None
    ) -> VerifyOut:
        await self.send(request_id, draft, ticket, return_features)
        return await self.receive()

    async def send(self, request_id: str, draft: DraftResult, ticket: TicketInfo | None, return_features: bool) -> None:
        """Returns once gRPC has taken the request (it is on its way to the verifier)."""
        try:
            await self.call.write(_verify_request(request_id, draft, ticket, return_features))
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "verifier VerifyStream") from None

    async def receive(self) -> VerifyOut:
        """The answer to the request sent last."""
        try:
            r = await self.call.read()
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "verifier VerifyStream") from None
        if r is grpc.aio.EOF:
            raise Unavailable("verifier VerifyStream: the verifier closed the stream without an answer")
        return _verify_out(r)

    def cancel(self) -> None:
        self.call.cancel()


class SchedulerClient:
    def __init__(self, target: str, credentials: grpc.ChannelCredentials | None = None):
        self.target = target
        self.channel = channel(target, credentials)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def admit(
        self, request_id: str, draft: DraftResult, timeout: float | None, reserve_tokens: int = 0, release: tuple[str, ...] = ()
    ) -> TicketInfo:
        """Admit a drafted block; or, with reserve_tokens > 0, reserve the round ahead of drafting
        (never waits; the answer may be `deferred`). `release`: tickets to give back first."""
        try:
            demand = dataclasses.replace(draft, draft_dists=())  # (the scheduler admits a demand: no distributions)
            t = await self.stub.Admit(
                scheduler_pb2.AdmitRequest(request_id=request_id, draft=convert.draft_to_pb(demand), reserve_tokens=reserve_tokens,
                                           release_ticket_ids=release),
                timeout=timeout,
            )
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "scheduler Admit") from None
        return TicketInfo(t.ticket_id, t.signature, t.expires_at_unix, t.waited_ms, int(t.tokens), int(t.expert_bytes), t.deferred)

    async def release(self, ticket_id: str, timeout: float = 5.0) -> bool:
        try:
            r = await self.stub.Release(scheduler_pb2.ReleaseRequest(ticket_id=ticket_id), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "scheduler Release") from None
        return r.released

    async def wait_ready(self, timeout: float) -> None:
        try:
            await self.stub.GetStats(scheduler_pb2.StatsRequest(), timeout=timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"scheduler {self.target}") from None
