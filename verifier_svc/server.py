"""Start the verifier: load the model (health NOT_SERVING meanwhile), then serve."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses

import torch

from pdflash import config as cfgmod, torch_thread
from pdflash.defaults import default_target_dir
from pdflash.logging import get_logger
from pdflash.metrics import VerifierMetrics, start_metrics_server_logged
from pdflash.server import ServiceHost, run_service, serve_until_signal, stop_on_failure
from pdflash.tickets import TicketSigner
from pdflash.tls import server_credentials
from pdflash.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_svc import warmup
from verifier_svc.config import VerifierConfig
from verifier_svc.engine import PagedKVOptions, VerifierCore
from verifier_svc.model import load_target
from verifier_svc.servicer import VerifierServicer

log = get_logger("pdflash.verifier")
SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name


@dataclasses.dataclass
class RunningVerifier:
    host: ServiceHost
    core: VerifierCore | None
    port: int
    _sweeper: asyncio.Task | None = None
    metrics_server: object | None = None
    servicer: VerifierServicer | None = None
    metrics: VerifierMetrics | None = None

    async def stop(self, grace: float = 1.0) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self.host.stop(grace)
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


async def _sweep(core: VerifierCore) -> None:
    while True:
        await asyncio.sleep(1.0)
        for sid in core.sessions.expire():
            log.info("session expired", session_id=sid)


async def start(cfg: VerifierConfig) -> RunningVerifier:
    host = ServiceHost([SERVICE])
    metrics = VerifierMetrics()
    metrics_server = start_metrics_server_logged(cfg.metrics_port, cfg.host, metrics, log)
    servicer = VerifierServicer(metrics=metrics, signer=TicketSigner(cfg.ticket_secret), max_pending=cfg.max_pending)
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, host.server)
    port = host.add_port(f"{cfg.host}:{cfg.port}", server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_ca))
    await host.start()  # health answers NOT_SERVING while the model loads
    log.info("verifier listening", address=f"{cfg.host}:{port}", phase="loading",
             tls="mutual" if cfg.tls_ca else "on" if cfg.tls_cert else "off", tickets="checked" if cfg.ticket_secret else "not checked")
    try:
        model_dir = cfg.model or str(await asyncio.to_thread(default_target_dir))
        verify_threads, prefill_threads = cfg.thread_counts(torch_thread.usable_cores())
        threads = await torch_thread.run(torch_thread.configure, verify_threads)
        target = await torch_thread.run(load_target, model_dir, resolve_device(cfg.device), cfg.dtype, cfg.kernels, cfg.experts,
                                        cfg.expert_cache_gb, cfg.expert_prefetch, cfg.expert_cache_mode, cfg.expert_eviction)
        if target.expert_cache is not None:
            target.expert_cache.arrival_share = cfg.expert_arrival_share
            target.expert_cache.guess_width = cfg.expert_guess_width  # before VerifierCore captures the graphs
            if hasattr(target.expert_cache, "fill_overlap"):  # the device-managed cache (the host one copies per layer)
                target.expert_cache.fill_overlap = cfg.expert_fill_overlap
        # on the torch thread: on CUDA it captures the verify forward's graphs (seconds; health answers meanwhile)
        core = await torch_thread.run(VerifierCore, target, cfg.max_sessions, cfg.session_ttl_s, cfg.max_block_size,
                                      cfg.max_tokens_limit, prefill_threads=prefill_threads,
                                      paged_kv=PagedKVOptions(cfg.paged_kv, cfg.kv_cache_gb, cfg.cuda_graphs,
                                                              prefill_graphs=cfg.prefill_graphs),
                                      max_wave_sessions=cfg.wave_sessions(target.device.type),
                                      prefill_chunk=cfg.prefill_chunk)
        core.max_wave_sessions = cfg.wave_sessions(target.device.type, core.wave_forward)  # (auto: where a wave is one forward)
        if cfg.verify_inline(target.device.type, threads):  # threads: the verify forwards' count in effect
            if target.device.type == "cpu":
                torch.set_num_threads(threads)  # OpenMP's thread count is per thread: this one's, as the torch thread's
            servicer.inline_verify = True
        if cfg.warmup_wanted(target.device.type):  # first uses paid now, while health still answers NOT_SERVING
            await torch_thread.run(warmup.warm, core, warmup.feature_layers(cfg.warmup_layer_ids(), cfg.model))
    except BaseException:
        await stop_on_failure(host, metrics_server and metrics_server.close)
        raise
    servicer.core = core
    metrics.sessions_alive.set_function(lambda: len(core.sessions))
    await host.set_serving(True)
    log.info(
        "verifier ready",
        model=target.name,
        architecture=target.architecture,
        moe_layers=len(target.moe_layers),
        experts_per_layer=target.experts_per_layer,
        total_expert_bytes=target.total_expert_bytes,
        device=str(target.device),
        batch_invariant=target.batch_invariant,
        paged_kv=core.pool is not None,
        cuda_graphs=core.graphs is not None,
        experts_format=target.experts_format,
        torch_threads=threads,
        prefill_threads=prefill_threads or threads,
        colocated=cfg.colocated,
        inline_verify=servicer.inline_verify,
        verify_waves=(f"up to {core.max_wave_sessions} sessions a forward" if core.max_wave_sessions > 1 and core.wave_forward
                      else f"up to {core.max_wave_sessions} sessions, one forward after another" if core.max_wave_sessions > 1
                      else "off"),
        prefill_waves=(f"up to {core.max_wave_sessions} prompts a forward" if servicer.prefill_waves else "off"),
        prefill_graphs=bool(core.graphs is not None and core.graphs.prefill_buckets),
        warmup_seconds=round(core.warmup_seconds, 2),
        prefill_chunk=(f"{core.prefill_chunk} tokens" if core.chunked_prefill else
                       "the whole prompt" + (" (chunks need the paged KV and a position-table RoPE)" if core.prefill_chunk else "")),
    )
    return RunningVerifier(host, core, port, asyncio.create_task(_sweep(core)), metrics_server, servicer, metrics)


async def serve(cfg: VerifierConfig) -> None:
    running = await start(cfg)
    await serve_until_signal(running.host, cfg.grace_s, on_stop=lambda: running.stop(0))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfgmod.add_arguments(parser, VerifierConfig)


def run(args: argparse.Namespace) -> int:
    return run_service(VerifierConfig, serve, "verifier", args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdflash serve-verifier", description="Serve the pdflash verifier")
    add_arguments(parser)
    return run(parser.parse_args(argv))
