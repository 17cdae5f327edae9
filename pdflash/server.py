"""What every pdflash gRPC server shares: options, health, reflection, start-up and SIGTERM shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdflash.errors import FieldViolation, InvalidArgument, abort_with
from pdflash.logging import get_logger

log = get_logger("pdflash.server")

# Explicit on both ends (gRPC's default receive limit is 4 MiB): room for large feature tensors. A
# bigger message is refused by gRPC itself with RESOURCE_EXHAUSTED ("... larger than max ...").
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Keepalive that tolerates client pings. Reconnect backoff capped at 1 s: a restarted peer is used
# again within a second, not after gRPC's default backoff of up to two minutes.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
SERVER_OPTIONS: list[tuple[str, int]] = CHANNEL_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


class _Undecodable:
    def __init__(self, error: Exception):
        self.error = error


class DecodeErrors(grpc.aio.ServerInterceptor):
    """A request that does not decode gets INVALID_ARGUMENT with a field violation, not UNKNOWN.

    (gRPC's aio server reports a failing deserializer as UNKNOWN "Unexpected DecodeError".) Only the
    pdflash services' methods are wrapped (unary requests, and request streams such as
    Verifier.VerifyStream, where the first undecodable message ends the stream); health and reflection
    are left as they are.
    """

    def __init__(self) -> None:
        # method -> (handler, its wrapper): built once per method, not per call (a handler seen for the
        # first time, e.g. an interceptor's refusal, is wrapped afresh and not kept).
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or handler.request_deserializer is None
                or (handler.request_streaming and not handler.response_streaming)
                or not handler_call_details.method.startswith("/pdflash.")):
            return handler
        method = handler_call_details.method
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = self._wrap(handler, method)
        if known is None:
            self._wrapped[method] = (handler, wrapped)
        return wrapped

    @staticmethod
    def _wrap(handler, method: str):
        decode = handler.request_deserializer

        def deserializer(data: bytes):
            try:
                return decode(data)
            except Exception as e:  # protobuf's DecodeError, or anything a deserializer raises
                return _Undecodable(e)

        async def refuse(context, bad: _Undecodable) -> None:
            what = f"not a valid request message for {method}: {bad.error}"
            await abort_with(context, InvalidArgument(f"invalid request: {what}", [FieldViolation("(message)", what)]))

        kw = dict(request_deserializer=deserializer, response_serializer=handler.response_serializer)
        if handler.request_streaming:  # and response streaming (the only kind the services have)
            inner_bidi = handler.stream_stream

            async def stream_stream(request_iterator, context):
                async def checked():
                    async for request in request_iterator:
                        if isinstance(request, _Undecodable):
                            await refuse(context, request)
                        yield request

                async for response in inner_bidi(checked(), context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)
        if handler.response_streaming:
            inner = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, _Undecodable):
                    await refuse(context, request)
                async for response in inner(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
        inner_unary = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, _Undecodable):
                await refuse(context, request)
            return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)


class ServiceHost:
    """An aio server with health and reflection for the named services.

    Health: "" and each service name start NOT_SERVING; `set_serving()` flips them once the service
    is ready; shutdown flips them back before the listener stops.
    """

    def __init__(self, service_names: Sequence[str], interceptors: Sequence[grpc.aio.ServerInterceptor] = ()):
        self.service_names = list(service_names)
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[*interceptors, DecodeErrors()])  # auth answers before decoding
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port: int | None = None

    def add_port(self, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
        try:
            if credentials is None:
                port = self.server.add_insecure_port(address)
            else:
                port = self.server.add_secure_port(address, credentials)
        except RuntimeError:  # grpcio raises this when the port is taken (older releases returned 0)
            port = 0
        if port == 0:
            raise OSError(f"could not bind {address}: the port is in use, or the address is not one of this host's")
        self.port = port
        return port

    async def start(self) -> None:
        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def set_serving(self, serving: bool = True) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def serve_until_signal(
    host: ServiceHost,
    grace: float,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    stop_event: asyncio.Event | None = None,
) -> None:
    """Block until SIGTERM/SIGINT (or stop_event), then: NOT_SERVING -> stop(grace) -> on_stop()."""
    stop = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    await stop.wait()
    log.info("shutting down", grace_s=grace, services=host.service_names)
    await host.stop(grace)
    if on_stop is not None:
        await on_stop()
    log.info("stopped", services=host.service_names)


async def stop_on_failure(host: ServiceHost, *closers) -> None:
    """Undo a start-up that failed half-way: stop the listener (so no grpc object outlives the event loop,
    which printed "Event loop is closed" tracebacks at exit) and close what was opened (callables, awaited
    when they return an awaitable; None entries are skipped)."""
    try:
        await host.stop(0)
    except Exception:  # noqa: BLE001 - best effort on the way out; the start-up error is what matters
        pass
    for close in closers:
        if close is None:
            continue
        try:
            result = close()
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                await result
        except Exception:  # noqa: BLE001
            pass


def channel(target: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)


TERMINATION_LOG_ENV = "PDFLASH_TERMINATION_LOG"


def failure_reason(error: BaseException) -> str:
    """One line saying why a service failed: the message of the errors pdflash raises on purpose (bad
    options, a checkpoint that does not load or fit, upstream services that never answered), the
    exception's type too for anything else."""
    from pdflash.config import ConfigError
    from pdflash.errors import PdflashError

    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, (ConfigError, PdflashError, OSError, ValueError)):
        return text
    return f"{type(error).__name__}: {text}"


def write_termination_log(reason: str) -> None:
    """Leave `reason` where the process's supervisor reads it: the file named by $PDFLASH_TERMINATION_LOG
    (like Kubernetes' terminationMessagePath; `pdflash up` sets it for each service)."""
    path = os.environ.get(TERMINATION_LOG_ENV)
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(reason + "\n")
    except OSError:
        pass


def run_service(config_cls, serve, service: str, args, command: str = "") -> int:
    """The `pdflash serve-<service>` body shared by the three services (and `pdflash stub`: `command`): options
    from flags / environment / config file, logging, the effective configuration logged, serve until a signal.
    Returns an exit code.

    A failure (bad options, a model that does not load, a port in use, upstream services that never
    answer) is one line, logged and left in the termination log, and exit code 2 (options) or 1; the
    traceback is logged only at --log-level debug."""
    import sys

    from pdflash import config as cfgmod
    from pdflash.logging import configure

    command = command or f"serve-{service}"

    def refuse(reason: str) -> int:
        print(f"pdflash {command}: configuration error: {reason}", file=sys.stderr)
        write_termination_log(f"configuration error: {reason}")
        return 2

    try:
        cfg = cfgmod.from_sources(config_cls, args)
    except cfgmod.ConfigError as e:
        return refuse(str(e))
    configure(cfg.log_level)
    if getattr(cfg, "cpus", ""):  # the stub (pdflash.testing) has no --cpus
        cores = cfgmod.parse_cpus(cfg.cpus)
        try:
            os.sched_setaffinity(0, cores)
        except (OSError, AttributeError) as e:  # a core this process may not use, or not Linux
            return refuse(f"--cpus {cfg.cpus!r}: cannot run on cores {sorted(cores)}: {e}")
    log.info("effective configuration", service=service, **cfgmod.describe(cfg))
    try:
        asyncio.run(serve(cfg))
    except Exception as e:  # noqa: BLE001 - every failure becomes one line and an exit code
        reason = failure_reason(e)
        log.error("cannot serve", service=service, error=reason, exc_info=cfg.log_level.lower() == "debug")
        write_termination_log(reason)
        return 2 if isinstance(e, cfgmod.ConfigError) else 1
    return 0
