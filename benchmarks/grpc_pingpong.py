"""The floor under a round's hops: a bare gRPC aio bidi-stream ping-pong between two processes on loopback.

The server answers each message after busy-working `busy` ms on its event loop (a stand-in for a verify
forward), so the client idles that long before each answer, as the drafter does while the verifier
computes. Reports the round trip beyond the busy time. On the 2-core VM the idle adds the cost of
waking an idle core (benchmarks/README.md, "Round hops").

    python benchmarks/grpc_pingpong.py [--busy-ms 0 1 5] [--n 600]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time

import grpc


def _ident(x: bytes) -> bytes:
    return x


async def _serve(addr: str, busy_s: float, ready) -> None:
    async def bidi(requests, context):
        async for m in requests:
            t = time.perf_counter()
            while time.perf_counter() - t < busy_s:
                pass
            yield m

    handler = grpc.method_handlers_generic_handler(
        "pp.P", {"B": grpc.stream_stream_rpc_method_handler(bidi, request_deserializer=_ident, response_serializer=_ident)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(addr)
    await server.start()
    ready.set()
    await server.wait_for_termination()


def _server(addr: str, busy_s: float, ready) -> None:
    asyncio.run(_serve(addr, busy_s, ready))


async def _client(addr: str, busy_s: float, n: int) -> list[float]:
    async with grpc.aio.insecure_channel(addr) as ch:
        call = ch.stream_stream("/pp.P/B", request_serializer=_ident, response_deserializer=_ident)()
        msg = b"x" * 200
        for _ in range(50):  # warm-up
            await call.write(msg)
            await call.read()
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await call.write(msg)
            await call.read()
            out.append(time.perf_counter() - t0 - busy_s)
        call.cancel()
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy-ms", type=float, nargs="+", default=[0.0, 1.0, 5.0])
    ap.add_argument("--n", type=int, default=600)
    args = ap.parse_args(argv)
    from pdflash.stack import free_ports

    print("| server busy ms | round trip beyond it, p50 us | mean us |\n|---|---|---|")
    for busy in args.busy_ms:
        addr = f"127.0.0.1:{free_ports(1)[0]}"
        ready = mp.Event()
        proc = mp.Process(target=_server, args=(addr, busy / 1e3, ready))
        proc.start()
        try:
            ready.wait(30)
            rtt = asyncio.run(_client(addr, busy / 1e3, args.n))
        finally:
            proc.kill()
            proc.join()
        print(f"| {busy:g} | {statistics.median(rtt) * 1e6:.0f} | {statistics.mean(rtt) * 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
