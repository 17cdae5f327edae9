"""The stub server: the public `pdflash.v1.Drafter` API without a model, for tests of clients.

It is the drafter's front door without the round loop behind it: the same server shell (health, reflection,
the decode-error interceptor: pdflash.server), the same bearer-token check and TLS (pdflash.tls), the same
request checks, request-id echo, running-request registry and messages (drafter_svc.api). What it streams
comes from a script (pdflash.testing.config.Script): the prompt echoed or a fixed text, in chunks with a
delay between them, a fault with the drafter's rich details after N chunks, or a stall; or from a
transcript recorded from a real stack (pdflash.testing.transcript). `--record` makes it a proxy that writes
such a transcript.

`pdflash stub` serves one in the foreground; `StubServer` runs one on a thread of the calling process.
Imports neither torch nor transformers (tests/test_testing.py checks).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import sys
import threading
import time

import grpc

from drafter_svc import api
from drafter_svc.loop import Request, Usage
from drafter_svc.tokens import TextStream
from pdflash import config as cfgmod
from pdflash.errors import (STATUS_DETAILS_KEY, FieldViolation, InvalidArgument, PdflashError, ResourceExhausted,
                            Unavailable, abort_with)
from pdflash.logging import get_logger
from pdflash.server import ServiceHost, channel, serve_until_signal
from pdflash.testing import tokenizer as tokmod
from pdflash.testing.config import METADATA_PREFIX, SCRIPT_FIELDS, Script, StubConfig, script_of
from pdflash.testing.transcript import Call, Transcript, Writer, request_key
from pdflash.tls import BearerAuth, channel_credentials, server_credentials
from pdflash.types import DrafterKind, FinishReason
from pdflash.v1 import drafter_pb2, drafter_pb2_grpc

log = get_logger("pdflash.stub")
SERVICE = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
DEMO_VOCAB_SIZE = 4096  # the embedded demo model's: the byte tokenizer's default vocabulary
RECEIVED_KEPT = 1000


@dataclasses.dataclass(frozen=True)
class Received:
    """A Generate the stub was sent, as it arrived."""

    request: drafter_pb2.GenerateRequest
    metadata: dict[str, str]


def fault_error(script: Script) -> PdflashError:
    """The scripted fault as the error the drafter would raise: same status, same kind of details."""
    code = grpc.StatusCode[script.fault.upper()]
    message = script.fault_message or f"stub fault: {code.name}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(message, [FieldViolation(script.fault_field or "(stub)", message)])
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(message, retry_after_s=script.retry_after_s)
    err = PdflashError(message)
    err.code = code
    return err


def options_like(info: drafter_pb2.ModelInfoResponse) -> dict:
    """StubConfig options that make a stub claim, and check requests against, what a server's ModelInfo says."""
    kinds = [DrafterKind(k).name.lower() for k in info.drafters]
    return dict(
        model=info.model, architecture=info.architecture, vocab_size=info.vocab_size, drafters=",".join(kinds),
        default_drafter=DrafterKind(info.default_drafter).name.lower(), block_size=info.block_size,
        max_block_size=info.max_block_size, max_tokens_limit=info.max_tokens_limit, max_prompt_tokens=info.max_prompt_tokens,
    )


def limits_of(cfg: StubConfig, vocab_size: int) -> api.Limits:
    """What requests are checked against, from the options."""
    kinds = [DrafterKind[k.upper()] for k in cfg.kinds()]
    if cfg.default_drafter:
        default = DrafterKind[cfg.default_drafter.upper()]
    elif DrafterKind.HYBRID in kinds:  # as the drafter picks: hybrid with DFlash, else n-gram
        default = DrafterKind.HYBRID
    else:
        default = DrafterKind.NGRAM if DrafterKind.NGRAM in kinds else kinds[0]
    return api.Limits(
        max_prompt_tokens=cfg.max_prompt_tokens, max_tokens_limit=cfg.max_tokens_limit,
        default_max_tokens=cfg.default_max_tokens, block_size=cfg.block_size, max_block_size=cfg.max_block_size,
        vocab_size=vocab_size, max_context=cfg.max_context, drafters={k: None for k in kinds}, default_drafter=default,
    )


async def _pause(abort: asyncio.Event, seconds: float) -> bool:
    """Sleep (at least yield), ending early on Abort; True when aborted."""
    if seconds <= 0:
        await asyncio.sleep(0)
        return abort.is_set()
    try:
        await asyncio.wait_for(abort.wait(), seconds)
        return True
    except asyncio.TimeoutError:
        return False


def _usage(prompt_tokens: int, chunk_sizes: list[int], verify_ms: float) -> Usage:
    """Usage of the shape the drafter reports: the first token from prefill, then one round per chunk, every draft accepted."""
    rounds = max(0, len(chunk_sizes) - 1)
    completion = sum(chunk_sizes)
    accepted = max(0, completion - (1 if chunk_sizes else 0) - rounds)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, rounds=rounds, draft_tokens=accepted,
                 accepted_draft_tokens=accepted, verify_ms=verify_ms)


@dataclasses.dataclass
class _Sent:
    """What a stream got out: the token count of each chunk, and whether Abort ended it."""

    sizes: list[int] = dataclasses.field(default_factory=list)
    aborted: bool = False


class StubServicer(drafter_pb2_grpc.DrafterServicer):
    """pdflash.v1.Drafter answered by script or from a transcript."""

    def __init__(self, cfg: StubConfig):
        self.tokenizer = tokmod.load(cfg.tokenizer)
        self.transcript = Transcript(cfg.replay) if cfg.replay else None
        info = self.transcript.model_info if self.transcript is not None else None
        if info is not None:  # the recorded server's limits, so its refusals replay as they were
            cfg = dataclasses.replace(cfg, **options_like(info))
            cfg = dataclasses.replace(cfg, default_max_tokens=min(cfg.default_max_tokens, cfg.max_tokens_limit))
        self.cfg = cfg
        vocab = cfg.vocab_size or (self.tokenizer.vocab_size if cfg.tokenizer else DEMO_VOCAB_SIZE)
        self.limits = limits_of(cfg, vocab)
        self.info = info or api.model_info_message(self.limits, cfg.model, cfg.architecture,
                                                   chat_template=self.tokenizer.chat_ids is not None)
        self.script = script_of(cfg)
        self.running = api.RunningRequests()
        self.received: collections.deque[Received] = collections.deque(maxlen=RECEIVED_KEPT)
        self.received_lock = threading.Lock()  # appended on the server's loop, read from the test's thread
        self.verbose = False  # a log line per call (`pdflash stub`); quiet inside a test process

    def _script_for(self, context) -> Script:
        """The script, with this call's `pdflash-stub-*` metadata applied."""
        overrides = {}
        for key, value in context.invocation_metadata() or ():
            if not key.startswith(METADATA_PREFIX):
                continue
            name = key[len(METADATA_PREFIX):].replace("-", "_")
            if name not in SCRIPT_FIELDS:
                known = ", ".join(METADATA_PREFIX + n.replace("_", "-") for n in SCRIPT_FIELDS)
                raise InvalidArgument(f"invalid stub metadata: {key!r} is no script option; known: {known}",
                                      [FieldViolation(key, "not a script option of the stub")])
            try:
                overrides[name] = cfgmod.parse_option(Script, name, value, key)
            except cfgmod.ConfigError as e:
                raise InvalidArgument(f"invalid stub metadata: {e}", [FieldViolation(key, str(e))]) from None
        if not overrides:
            return self.script
        script = dataclasses.replace(self.script, **overrides)
        try:
            script.validate_script()
        except cfgmod.ConfigError as e:
            raise InvalidArgument(f"invalid stub metadata: {e}", [FieldViolation("metadata", str(e))]) from None
        return script

    def _completion(self, req: Request, script: Script) -> tuple[list[int], FinishReason]:
        """The scripted tokens: the text (or the prompt), to max_tokens, a stop token or the context's end."""
        source = self.tokenizer.encode_ids(script.text) if script.text else list(req.prompt)
        room = min(req.max_tokens, self.limits.max_context - len(req.prompt))
        out: list[int] = []
        i = 0
        while len(out) < room:
            if i == len(source):
                if not req.ignore_eos:
                    return out, FinishReason.STOP  # the "model" ended its text
                i = 0
            out.append(source[i])
            i += 1
            if out[-1] in req.stop_token_ids:
                return out, FinishReason.STOP
        return out, FinishReason.LENGTH if room == req.max_tokens else FinishReason.CONTEXT

    async def Generate(self, request, context):
        request_id = api.request_id(request, context)
        try:
            api.check_request_id(request_id)
        except InvalidArgument as e:  # never echoed: it may not even be valid metadata
            await abort_with(context, e)
        context.set_trailing_metadata(((api.REQUEST_ID_KEY, request_id),))
        with self.received_lock:
            self.received.append(Received(request, {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}))
        registered = False
        try:
            script = self._script_for(context)
            req, _kind = api.parse_generate(request, request_id, self.limits, self.tokenizer.encode_ids, self.tokenizer.chat_ids)
            abort = self.running.start(request_id, self.cfg.max_concurrent)
            registered = True
            if self.verbose:
                log.info("generate", request_id=request_id, prompt_tokens=len(req.prompt), max_tokens=req.max_tokens,
                         source="transcript" if self.transcript is not None else "text" if script.text else "echo")
            if self.transcript is not None:
                stream = self._replayed(request_id, req, self.transcript.answer(request), script, abort)
            else:
                stream = self._scripted(request_id, req, script, abort)
            async for msg in stream:
                yield msg
        except _Recorded as e:  # goes out exactly as recorded, not through pdflash.errors' mapping
            await _abort_as_recorded(context, e)
        except PdflashError as e:
            if self.verbose:
                log.info("generate failed", request_id=request_id, code=e.code.name, error=e.message)
            await abort_with(context, e)
        finally:
            if registered:
                self.running.finish(request_id)

    async def _scripted(self, request_id: str, req: Request, script: Script, abort: asyncio.Event):
        tokens, reason = self._completion(req, script)
        size = min(script.chunk_tokens, req.block_size)
        groups = [tokens[:1]] + [tokens[i:i + size] for i in range(1, len(tokens), size)]
        text = TextStream(self.tokenizer, req.prompt, req.stop)  # (the stop sequences as the drafter applies them)
        chunks, stopped = [], None
        for r, g in enumerate(groups):
            ids, piece, stopped = text.add(g)
            # a script is certain of its tokens: log-probability 0, and no alternative
            lps = [0.0] * len(ids) if req.logprobs else None
            tops = [([t], [0.0]) for t in ids] if req.top_logprobs else None
            chunks.append(api.chunk_message(request_id, ids, piece, r, lps, tops))
            if stopped is not None:
                break
        final_text = ""
        if stopped is None:
            final_text, stopped = text.finish()
        if stopped is not None:
            reason = FinishReason.STOP
        sent = _Sent()
        t0 = time.perf_counter()
        async for msg in self._paced(chunks, script, abort, sent):
            yield msg
        reason = FinishReason.ABORTED if sent.aborted else reason
        yield api.final_message(request_id, reason, _usage(len(req.prompt), sent.sizes, (time.perf_counter() - t0) * 1e3),
                                "" if sent.aborted else final_text, None if sent.aborted else stopped)

    async def _replayed(self, request_id: str, req: Request, call: Call, script: Script, abort: asyncio.Event):
        chunks, final = [], None
        for recorded in call.responses:
            msg = drafter_pb2.GenerateResponse()
            msg.CopyFrom(recorded)
            msg.request_id = request_id
            if msg.HasField("chunk"):
                chunks.append(msg)
            else:
                final = msg
        sent = _Sent()
        async for msg in self._paced(chunks, script, abort, sent):
            yield msg
        if sent.aborted or (final is None and call.code == "OK"):
            yield api.final_message(request_id, FinishReason.ABORTED, _usage(len(req.prompt), sent.sizes, 0.0), "")
            return
        if final is not None:
            yield final
            return
        raise _Recorded(call)

    async def _paced(self, chunks, script: Script, abort: asyncio.Event, sent: "_Sent"):
        """Stream chunks by the script: the delay between them, the fault or stall after N of them; stop on
        Abort (sent.aborted). A fault or stall set beyond the last chunk comes after it."""
        for i in range(len(chunks) + 1):
            if script.fault and i == min(script.fault_after, len(chunks)):
                raise fault_error(script)
            if script.stall_after >= 0 and i == min(script.stall_after, len(chunks)):
                await abort.wait()  # until Abort, or the client's deadline or cancel ends the call
                sent.aborted = True
                return
            if i == len(chunks):
                return
            if abort.is_set() or (i > 0 and await _pause(abort, script.delay_ms / 1e3)):
                sent.aborted = True
                return
            sent.sizes.append(len(chunks[i].chunk.token_ids))
            yield chunks[i]

    async def Abort(self, request, context):
        try:
            return api.abort(self.running, request)
        except InvalidArgument as e:
            await abort_with(context, e)

    async def Tokenize(self, request, context):
        try:  # (messages: the byte tokenizer's chat format; a tokenizer file's refuse them, as a model without a template)
            return api.tokenize_message(request, self.limits, self.tokenizer.encode_ids, self.tokenizer.chat_ids)
        except PdflashError as e:
            await abort_with(context, e)

    async def Detokenize(self, request, context):
        try:
            return api.detokenize_message(request, self.limits,
                                          lambda ids, skip: self.tokenizer.decode(ids, skip_special_tokens=skip))
        except PdflashError as e:
            await abort_with(context, e)

    async def ModelInfo(self, request, context):
        return self.info


class _Recorded(PdflashError):
    """A recorded call that ended with an error status: replayed as recorded, details included."""

    def __init__(self, call: Call):
        super().__init__(call.message)
        self.code = grpc.StatusCode[call.code]
        self.details = call.details


async def _abort_as_recorded(context, err: _Recorded) -> None:
    from google.rpc import status_pb2
    from grpc_status import rpc_status

    if err.details:
        await context.abort_with_status(rpc_status.to_status(status_pb2.Status.FromString(err.details)))
    await context.abort(err.code, err.message)


# -- record ---------------------------------------------------------------------------------------------

_NOT_FORWARDED = ("user-agent", "content-type", "te", "grpc-accept-encoding", "grpc-encoding", "grpc-timeout")


def _forwarded(metadata) -> tuple[tuple[str, str | bytes], ...]:
    """The client's own metadata (authorization, x-request-id, ...), not the transport's."""
    return tuple((k, v) for k, v in metadata or () if not k.startswith(":") and k not in _NOT_FORWARDED)


class RecordingServicer(drafter_pb2_grpc.DrafterServicer):
    """Proxies every call to the real drafter and appends each Generate with its answer to a transcript.

    Statuses, details and trailing metadata pass through as the upstream sent them. A stream the client
    cancelled is not recorded (it has no answer to replay)."""

    def __init__(self, upstream: drafter_pb2_grpc.DrafterStub, writer: Writer):
        self.upstream = upstream
        self.writer = writer
        self.verbose = False

    @classmethod
    async def connect(cls, cfg: StubConfig) -> "RecordingServicer":
        ch = channel(cfg.upstream, channel_credentials(cfg.upstream_tls_ca, cfg.upstream_tls_cert, cfg.upstream_tls_key))
        upstream = drafter_pb2_grpc.DrafterStub(ch)
        deadline = time.monotonic() + cfg.upstream_wait_s
        while True:  # UNAVAILABLE while the drafter starts: wait for its ModelInfo
            try:
                info = await upstream.ModelInfo(drafter_pb2.ModelInfoRequest(), wait_for_ready=True,
                                                timeout=max(0.1, deadline - time.monotonic()))
                break
            except grpc.aio.AioRpcError as e:
                if time.monotonic() >= deadline or e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    await ch.close()
                    raise Unavailable(f"--upstream {cfg.upstream}: no ModelInfo after {cfg.upstream_wait_s:.0f}s: "
                                      f"{e.code().name}: {e.details()}") from None
                await asyncio.sleep(0.2)
        return cls(upstream, Writer(cfg.record, cfg.upstream, info))

    async def Generate(self, request, context):
        call = self.upstream.Generate(request, metadata=_forwarded(context.invocation_metadata()), timeout=context.time_remaining())
        responses: list[drafter_pb2.GenerateResponse] = []
        try:
            async for msg in call:
                responses.append(msg)
                yield msg
            context.set_trailing_metadata(tuple(await call.trailing_metadata() or ()))
            self._write(Call(request, responses))
        except grpc.aio.AioRpcError as e:
            trailers = tuple(e.trailing_metadata() or ())
            details = next((v for k, v in trailers if k == STATUS_DETAILS_KEY), b"")
            self._write(Call(request, responses, e.code().name, e.details() or "", details))
            await context.abort(e.code(), e.details() or "", trailing_metadata=trailers)
        finally:
            call.cancel()  # the client went away mid-stream: so does the upstream call (no-op once it ended)

    def _write(self, call: Call) -> None:
        call.request = drafter_pb2.GenerateRequest.FromString(request_key(call.request))
        self.writer.write(call)
        if self.verbose:
            log.info("recorded", call=self.writer.calls, code=call.code, responses=len(call.responses))

    async def _unary(self, method, request, context):
        try:
            return await method(request, metadata=_forwarded(context.invocation_metadata()), timeout=context.time_remaining())
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "", trailing_metadata=tuple(e.trailing_metadata() or ()))

    async def Abort(self, request, context):
        return await self._unary(self.upstream.Abort, request, context)

    async def ModelInfo(self, request, context):
        return await self._unary(self.upstream.ModelInfo, request, context)

    async def Tokenize(self, request, context):
        return await self._unary(self.upstream.Tokenize, request, context)

    async def Detokenize(self, request, context):
        return await self._unary(self.upstream.Detokenize, request, context)


# -- serving --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RunningStub:
    host: ServiceHost
    servicer: StubServicer | RecordingServicer
    port: int

    async def stop(self, grace: float = 0.0) -> None:
        await self.host.stop(grace)
        if isinstance(self.servicer, RecordingServicer):
            self.servicer.writer.close()


async def start(cfg: StubConfig) -> RunningStub:
    """Build, bind and start a stub; SERVING at once (nothing to load)."""
    interceptors = [BearerAuth(cfg.auth_token, [SERVICE])] if cfg.auth_token else []
    servicer = await RecordingServicer.connect(cfg) if cfg.record else StubServicer(cfg)
    host = ServiceHost([SERVICE], interceptors=interceptors)
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, host.server)
    port = host.add_port(f"{cfg.host}:{cfg.port}", server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_ca))
    await host.start()
    await host.set_serving(True)
    return RunningStub(host, servicer, port)


def _mode(cfg: StubConfig) -> str:
    if cfg.record:
        return f"recording {cfg.upstream} to {cfg.record}"
    if cfg.replay:
        return f"replaying {cfg.replay}"
    return "scripted: " + ("text" if cfg.text else "echo")


async def serve(cfg: StubConfig) -> None:
    running = await start(cfg)
    running.servicer.verbose = True
    address = f"{cfg.host}:{running.port}"
    print(f"pdflash stub listening on {address}", flush=True)  # stdout: how a script learns the port of --port 0
    log.info("stub ready", address=address, mode=_mode(cfg), tls="mutual" if cfg.tls_ca else "on" if cfg.tls_cert else "off",
             auth="bearer token" if cfg.auth_token else "off")
    await serve_until_signal(running.host, cfg.grace_s, on_stop=lambda: running.stop(0))


def run(args: argparse.Namespace) -> int:
    """`pdflash stub`."""
    from pdflash.server import run_service

    try:
        return run_service(StubConfig, serve, "stub", args, command="stub")
    except (PdflashError, ValueError) as e:  # --record: no upstream; --replay: not a transcript
        print(f"pdflash stub: {getattr(e, 'message', e)}", file=sys.stderr)
        return 1


# -- in a Python process ----------------------------------------------------------------------------------


class StubServer:
    """A stub on a thread of this process: `with StubServer(text="hi") as stub: Client(stub.address)`.

    Options are StubConfig's (the flags of `pdflash stub`, as keyword arguments); the port defaults to 0
    (a free one). `script` (or `configure(**script_options)`) changes what later calls get; `received`
    lists the Generate requests sent so far. `client` is a ready pdflash Client (closed by `stop`)."""

    def __init__(self, config: StubConfig | None = None, **options):
        base = config if config is not None else StubConfig(port=0)
        self.config = dataclasses.replace(base, **options)
        self.config.validate()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._running: RunningStub | None = None
        self._client = None
        self.port: int | None = None

    @classmethod
    def like(cls, info: drafter_pb2.ModelInfoResponse, **options) -> "StubServer":
        """A stub that claims what a real server's ModelInfo says (model, vocabulary, drafters, limits)."""
        return cls(**{**options_like(info), **options})

    @property
    def address(self) -> str:
        host = self.config.host
        return f"{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "StubServer":
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(ready,), name="pdflash-stub", daemon=True)
        self._thread.start()
        try:
            self._running = ready.result(timeout)
        except BaseException:
            self.stop()
            raise
        self.port = self._running.port
        return self

    def _main(self, ready: concurrent.futures.Future) -> None:
        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                running = await start(self.config)
            except BaseException as e:
                ready.set_exception(e)
                return
            ready.set_result(running)
            await self._stop.wait()
            await running.stop(self._grace)

        self._grace = 0.0
        asyncio.run(main())

    def stop(self, grace: float = 0.0) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._grace = grace
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop ended meanwhile (a failed start)
                pass
        self._thread.join()
        self._thread = None

    def __enter__(self) -> "StubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def servicer(self) -> StubServicer:
        if self._running is None or not isinstance(self._running.servicer, StubServicer):
            raise RuntimeError("the stub is not started, or records (no script)")
        return self._running.servicer

    @property
    def script(self) -> Script:
        return self.servicer.script

    @script.setter
    def script(self, script: Script) -> None:
        script.validate_script()
        self.servicer.script = script

    def configure(self, **script_options) -> Script:
        """Change some script options for later calls (the others stay); returns the new script."""
        self.script = dataclasses.replace(self.script, **script_options)
        return self.script

    @property
    def received(self) -> list[Received]:
        with self.servicer.received_lock:
            return list(self.servicer.received)

    @property
    def client(self):
        """A pdflash Client of this stub (with its bearer token; plaintext unless you make your own for TLS)."""
        if self._client is None:
            from pdflash.client import Client

            self._client = Client(self.address, token=self.config.auth_token)
        return self._client


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdflash stub")
    cfgmod.add_arguments(parser, StubConfig)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
