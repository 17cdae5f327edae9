"""Start the drafter (public front door): tokenizer and drafters, wait for the upstream services, serve."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time

from pdflash import config as cfgmod, torch_thread
from pdflash.defaults import default_drafter_for, default_target_dir
from pdflash.errors import PdflashError, Unavailable
from pdflash.logging import get_logger
from pdflash.metrics import DrafterMetrics, start_metrics_server_logged
from pdflash.server import ServiceHost, run_service, serve_until_signal, stop_on_failure
from pdflash.tls import BearerAuth, channel_credentials, server_credentials
from pdflash.types import DrafterKind
from pdflash.v1 import drafter_pb2, drafter_pb2_grpc
from drafter_svc.clients import SchedulerClient, VerifierClient
from drafter_svc.config import DrafterConfig
from drafter_svc.drafters import make_factory
from drafter_svc.servicer import DrafterServicer, FrontDoor
from drafter_svc.tokens import load_tokenizer

log = get_logger("pdflash.drafter")
SERVICE = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


@dataclasses.dataclass
class RunningDrafter:
    host: ServiceHost
    door: FrontDoor
    port: int
    metrics_server: object | None = None

    async def stop(self, grace: float = 1.0) -> None:
        await self.host.stop(grace)
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        await self.door.verifier.close()
        await self.door.scheduler.close()


async def _wait_upstream(verifier: VerifierClient, scheduler: SchedulerClient, wait_s: float):
    deadline = time.monotonic() + wait_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            info = await verifier.model_info(timeout=max(0.5, min(5.0, deadline - time.monotonic())), wait_for_ready=True)
            await scheduler.wait_ready(timeout=max(0.5, deadline - time.monotonic()))
            return info
        except PdflashError as e:  # UNAVAILABLE while the verifier loads its model
            last = e
            log.info("waiting for upstream services", error=e.message)
            await asyncio.sleep(0.5)
    raise Unavailable(f"scheduler/verifier not ready after {wait_s:.0f}s: {last}")


def build_factories(cfg: DrafterConfig, model_dir: str) -> tuple[dict[DrafterKind, object], DrafterKind, str]:
    if cfg.drafter or cfg.no_dflash:
        drafter_dir = cfg.drafter
    else:
        default, why = default_drafter_for(cfg.model)
        drafter_dir = str(default or "")
        if why:
            log.warning("no DFlash drafter for this model", reason=why, model=model_dir)
    factories: dict[DrafterKind, object] = {
        DrafterKind.NONE: make_factory("none", model_dir),
        DrafterKind.NGRAM: make_factory("ngram", model_dir, max_n=3),
    }
    if drafter_dir:
        dflash = make_factory("dflash", model_dir, drafter_dir, device=cfg.torch_device(), dtype=cfg.torch_dtype(),
                              cuda_graphs=cfg.drafter_cuda_graphs)
        factories[DrafterKind.DFLASH] = dflash
        from drafter_svc.drafters.hybrid import HybridFactory

        factories[DrafterKind.HYBRID] = HybridFactory(dflash, min_match=cfg.ngram_min_match)
    if cfg.default_drafter:
        default = DrafterKind[cfg.default_drafter.upper()]
        if default not in factories:
            raise cfgmod.ConfigError(f"--default-drafter {cfg.default_drafter}: needs a DFlash drafter (--drafter DIR)")
    else:
        default = DrafterKind.HYBRID if drafter_dir else DrafterKind.NGRAM
    return factories, default, drafter_dir


def _is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


async def start(cfg: DrafterConfig) -> RunningDrafter:
    # Health and reflection stay open (see pdflash.tls.BearerAuth); the Drafter service needs the token.
    interceptors = [BearerAuth(cfg.auth_token, [SERVICE])] if cfg.auth_token else []
    host = ServiceHost([SERVICE], interceptors=interceptors)
    metrics = DrafterMetrics()
    metrics_server = start_metrics_server_logged(cfg.metrics_port, cfg.host, metrics, log)
    servicer = DrafterServicer(metrics=metrics)
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, host.server)
    port = host.add_port(f"{cfg.host}:{cfg.port}", server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_ca))
    await host.start()
    log.info("drafter listening", address=f"{cfg.host}:{port}", phase="loading",
             tls="mutual" if cfg.tls_ca else "on" if cfg.tls_cert else "off", auth="bearer token" if cfg.auth_token else "off")
    if not _is_loopback(cfg.host) and not cfg.tls_cert:
        log.warning("serving other machines without TLS: prompts, tokens" + (" and the bearer token" if cfg.auth_token else "")
                    + " travel in plaintext; set --tls-cert/--tls-key")
    verifier = scheduler = None
    try:
        model_dir = cfg.model or str(await asyncio.to_thread(default_target_dir))
        tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
        threads = await torch_thread.run(torch_thread.configure, cfg.torch_threads)
        factories, default, drafter_dir = await torch_thread.run(build_factories, cfg, model_dir)
        upstream = channel_credentials(cfg.upstream_tls_ca, cfg.upstream_tls_cert, cfg.upstream_tls_key)
        verifier, scheduler = VerifierClient(cfg.verifier, upstream), SchedulerClient(cfg.scheduler, upstream)
        log.info("waiting for upstream", verifier=cfg.verifier, scheduler=cfg.scheduler, phase="connecting")
        target = await _wait_upstream(verifier, scheduler, cfg.upstream_wait_s)
        if len(tokenizer) > target.vocab_size:
            raise cfgmod.ConfigError(
                f"tokenizer of {model_dir} has {len(tokenizer)} tokens but the verifier's model has {target.vocab_size}: "
                "the drafter and the verifier must serve the same checkpoint"
            )
        servicer.door = FrontDoor(cfg, tokenizer, factories, default, verifier, scheduler, target, drafter_dir)
        await host.set_serving(True)
        device, dtype = servicer.door.dflash_placement()
        log.info("drafter ready", model=target.model, drafters=[k.name.lower() for k in factories], default=default.name.lower(),
                 block_size=cfg.block_size, torch_threads=threads, dflash_device=device, dflash_dtype=dtype)
    except BaseException:
        await stop_on_failure(host, metrics_server and metrics_server.close, verifier and verifier.close,
                              scheduler and scheduler.close)
        raise
    return RunningDrafter(host, servicer.door, port, metrics_server)


async def serve(cfg: DrafterConfig) -> None:
    running = await start(cfg)
    await serve_until_signal(running.host, cfg.grace_s, on_stop=lambda: running.stop(0))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfgmod.add_arguments(parser, DrafterConfig)


def run(args: argparse.Namespace) -> int:
    return run_service(DrafterConfig, serve, "drafter", args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdflash serve-drafter", description="Serve the pdflash drafter (public API)")
    add_arguments(parser)
    return run(parser.parse_args(argv))
