"""The floor under a round's hops: a bare gRPC aio bidi-stream ping-pong between two processes on loopback.

The server answers each message after busy-working `busy` ms on its event loop (a stand-in for a verify
forward), so the client idles that long before each answer, as the drafter does while the verifier
computes. Reports the round trip beyond the busy time. On the 2-core VM the idle adds the cost of
waking an idle core (benchmarks/README.md, "Round hops").

    python benchmarks/grpc_pingpong.py [--busy-ms 0 1 5] [--n 600] [--modes stream unary]

--modes: `stream`, one message each way on one bidi stream (the verify stream's hop); `unary`, one unary call a round
trip (the scheduler's Admit hop). Each row also gives the CPU time a round trip costs the client and the server
process (what bounds a service's rounds a second when many sessions share it).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import pathlib
import statistics
import sys
import time

import grpc

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _ident(x: bytes) -> bytes:
    return x


async def _serve(addr: str, busy_s: float, ready) -> None:
    async def bidi(requests, context):
        async for m in requests:
            t = time.perf_counter()
            while time.perf_counter() - t < busy_s:
                pass
            yield m

    async def unary(m, context):
        t = time.perf_counter()
        while time.perf_counter() - t < busy_s:
            pass
        return m

    handler = grpc.method_handlers_generic_handler(
        "pp.P", {"B": grpc.stream_stream_rpc_method_handler(bidi, request_deserializer=_ident, response_serializer=_ident),
                 "U": grpc.unary_unary_rpc_method_handler(unary, request_deserializer=_ident, response_serializer=_ident)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(addr)
    await server.start()
    ready.set()
    await server.wait_for_termination()


def _server(addr: str, busy_s: float, ready) -> None:
    asyncio.run(_serve(addr, busy_s, ready))


async def _client(addr: str, busy_s: float, n: int, mode: str = "stream", on_start=None) -> tuple[list[float], float]:
    """Round trips beyond the server's busy time, and the client process's CPU seconds over the timed ones."""
    async with grpc.aio.insecure_channel(addr) as ch:
        msg = b"x" * 200
        if mode == "stream":
            call = ch.stream_stream("/pp.P/B", request_serializer=_ident, response_deserializer=_ident)()

            async def once():
                await call.write(msg)
                await call.read()
        else:
            stub = ch.unary_unary("/pp.P/U", request_serializer=_ident, response_deserializer=_ident)
            call = None

            async def once():
                await stub(msg)
        for _ in range(50):  # warm-up
            await once()
        if on_start is not None:
            on_start()
        out, cpu0 = [], time.process_time()
        for _ in range(n):
            t0 = time.perf_counter()
            await once()
            out.append(time.perf_counter() - t0 - busy_s)
        cpu = time.process_time() - cpu0
        if call is not None:
            call.cancel()
        return out, cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy-ms", type=float, nargs="+", default=[0.0, 1.0, 5.0])
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--modes", nargs="+", choices=("stream", "unary"), default=["stream"])
    args = ap.parse_args(argv)
    from benchmarks.service_probe import cpu_seconds
    from pdflash.stack import free_ports

    print("| mode | server busy ms | round trip beyond it, p50 us | mean us | client CPU us a round trip | server CPU us (busy time taken out) |")
    print("|---|---|---|---|---|---|")
    for mode in args.modes:
        for busy in args.busy_ms:
            addr = f"127.0.0.1:{free_ports(1)[0]}"
            # spawn, never fork: a forked child of a process whose gRPC core already runs threads (a test process
            # with live channels) may never answer, and the client then waited forever (a CI run hung here once)
            ctx = mp.get_context("spawn")
            ready = ctx.Event()
            proc = ctx.Process(target=_server, args=(addr, busy / 1e3, ready))
            proc.start()
            server_cpu = []
            try:
                if not ready.wait(60):
                    raise RuntimeError(f"the ping-pong server on {addr} did not start within 60 s")
                rtt, client_cpu = asyncio.run(asyncio.wait_for(
                    _client(addr, busy / 1e3, args.n, mode, on_start=lambda: server_cpu.append(cpu_seconds(proc.pid))),
                    timeout=120))
                server_cpu.append(cpu_seconds(proc.pid))
            finally:
                proc.kill()
                proc.join()
            server = ((server_cpu[1] - server_cpu[0]) / args.n - busy / 1e3) * 1e6 if None not in server_cpu else float("nan")
            print(f"| {mode} | {busy:g} | {statistics.median(rtt) * 1e6:.0f} | {statistics.mean(rtt) * 1e6:.0f} | "
                  f"{client_cpu / args.n * 1e6:.0f} | {server:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
