"""Start the scheduler: options -> core -> gRPC server (health, reflection) -> SERVING; SIGTERM drains.

Entry points: `main(argv)` ("pdflash serve-scheduler" on its own), and `add_arguments(parser)` +
`run(args)` for the pdflash CLI; `start(cfg)` for tests and embedding (port 0 picks a free port).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

from pdflash import config as cfgmod
from pdflash import logging as plogging
from pdflash.metrics import SchedulerMetrics, start_metrics_server_logged
from pdflash.server import ServiceHost, run_service, serve_until_signal
from pdflash.tls import channel_credentials, server_credentials
from pdflash.v1 import scheduler_pb2_grpc
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core import SchedulerCore
from scheduler_svc.hints import PrefetchHints
from scheduler_svc.servicer import SERVICE_NAME, SchedulerServicer

log = plogging.get_logger("pdflash.scheduler")


@dataclasses.dataclass
class RunningScheduler:
    cfg: SchedulerConfig
    host: ServiceHost
    core: SchedulerCore
    port: int
    metrics_server: object | None = None
    hints: PrefetchHints | None = None

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING -> waiting Admits answer UNAVAILABLE -> stop(grace) -> stop the expiry task."""
        await self.host.set_serving(False)
        self.core.close()
        await self.host.stop(self.cfg.grace_s if grace is None else grace)
        await self.core.stop()
        if self.hints is not None:
            await self.hints.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None


async def start(cfg: SchedulerConfig) -> RunningScheduler:
    core = SchedulerCore(cfg)
    metrics = SchedulerMetrics()
    core.metrics = metrics
    metrics.budget_tokens_in_use.set_function(lambda: core.stats().tokens_in_use)
    metrics.budget_bytes_in_use.set_function(lambda: core.stats().bytes_in_use)
    metrics.queue_length.set_function(lambda: core.stats().waiting)
    metrics_server = start_metrics_server_logged(cfg.metrics_port, cfg.host, metrics, log)
    hints = None
    if cfg.verifier:
        hints = PrefetchHints(cfg.verifier, channel_credentials(cfg.upstream_tls_ca, cfg.upstream_tls_cert, cfg.upstream_tls_key),
                              metrics=metrics)
    host = ServiceHost([SERVICE_NAME])
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(core, hints), host.server)
    port = host.add_port(f"{cfg.host}:{cfg.port}", server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_ca))
    await core.start()
    await host.start()
    await host.set_serving(True)
    log.info(
        "scheduler serving",
        address=f"{cfg.host}:{port}",
        token_budget=cfg.token_budget,
        byte_budget=cfg.byte_budget or "unlimited",
        lease_s=cfg.lease_s,
        tls="mutual" if cfg.tls_ca else "on" if cfg.tls_cert else "off",
        tickets="signed" if cfg.ticket_secret else "unsigned",
        prefetch_hints=cfg.verifier or "off",
    )
    return RunningScheduler(cfg=cfg, host=host, core=core, port=port, metrics_server=metrics_server, hints=hints)


async def serve(cfg: SchedulerConfig, stop_event: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or stop_event), then drain and stop."""
    running = await start(cfg)
    stop = stop_event or asyncio.Event()

    async def close_admission_on_stop() -> None:
        await stop.wait()
        running.core.close()  # waiting Admits answer UNAVAILABLE now instead of at the end of the grace

    closer = asyncio.create_task(close_admission_on_stop())
    try:
        await serve_until_signal(running.host, cfg.grace_s, on_stop=running.core.stop, stop_event=stop)
    finally:
        closer.cancel()
        await running.core.stop()
        if running.hints is not None:
            await running.hints.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfgmod.add_arguments(parser, SchedulerConfig)


def run(args: argparse.Namespace) -> int:
    return run_service(SchedulerConfig, serve, "scheduler", args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdflash serve-scheduler", description="Serve the pdflash verify-admission scheduler")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
