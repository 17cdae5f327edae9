"""`pdflash`: the one entry point. Serve each service, start all three, generate, probe health."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time

from pdflash.config import SWITCH, ConfigError, switch_value
from pdflash.devices import DTYPES

EPILOG = """Every option is also an environment variable PDFLASH_<OPTION> (e.g. PDFLASH_PORT) and a key of
the optional --config YAML/JSON file. Default ports: drafter (public) 50051, scheduler 50052,
verifier 50053."""


def _add_stack_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="", help="target checkpoint directory (default: the embedded demo model)")
    p.add_argument("--drafter", default="", help="DFlash drafter directory (default: the embedded demo drafter, if shipped)")
    p.add_argument("--no-dflash", action="store_true", help="n-gram drafting only")
    p.add_argument("--no-pin", action="store_true",
                   help="leave the drafter and scheduler free to run on any core (default: pinned to the last core, the one "
                        "the co-located verifier leaves them)")
    p.add_argument("--host", default="127.0.0.1", help="drafter (public) bind address")
    p.add_argument("--port", type=_number, default=50051, help="drafter (public) port")
    p.add_argument("--scheduler-port", type=_number, default=50052, help="scheduler port (loopback; default 50052)")
    p.add_argument("--verifier-port", type=_number, default=50053, help="verifier port (loopback; default 50053)")
    p.add_argument("--metrics-port", type=_number, default=9101,
                   help="the drafter's Prometheus /metrics port; the scheduler and the verifier take the next two "
                        "(default 9101: 9101-9103; -1 = no metrics)")
    p.add_argument("--log-dir", default=None, help="write each service's log to DIR/<service>.log instead of the terminal")
    p.add_argument("--startup-timeout", type=_number, default=300.0, help="seconds the services may take to become ready")
    v = p.add_argument_group("verifier", "the target's device and kernels (as serve-verifier's options of the same names)")
    v.add_argument("--device", default="auto", help="torch device of the verifier: auto (cuda when available), cpu, cuda, cuda:N")
    v.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto = float32 on CPU, bfloat16 on GPU")
    v.add_argument("--kernels", default="auto", choices=["auto", "on", "off"],
                   help="batch-invariant Triton kernels (exact greedy output at every block width): auto = on CUDA")
    v.add_argument("--experts", default="native", choices=["native", "mxfp4"],
                   help="routed experts in the checkpoint's dtype, or quantized to MXFP4 at load")
    v.add_argument("--expert-cache-gb", type=_number, default=0.0,
                   help="with --experts mxfp4: keep the experts in host memory and serve them from a device cache of this "
                        "many GiB (0 = every expert resident)")
    v.add_argument("--expert-prefetch", default="union,layer", choices=["union,layer", "union", "layer", "none"],
                   metavar="{union,layer|union|layer|none}",
                   help="offloaded experts, what streams in ahead of need: a verify's projected union, the next layer's "
                        "experts predicted by its router, both (union,layer: the default), or none")
    v.add_argument("--expert-cache-mode", default="device", choices=["device", "host"],
                   help="offloaded experts: the cache decides on the device inside the forward's CUDA graph, or on the "
                        "host with one stop per layer")
    v.add_argument("--expert-eviction", default="lru", choices=["lru", "cyclic"],
                   help="offloaded experts, which cached expert a miss replaces: the least recently used, or cyclic (experts "
                        "not routed at their layer's latest lookup first, then those of the layer needed last in the forward)")
    v.add_argument("--expert-arrival-share", type=_number, default=0.5, metavar="SHARE",
                   help="offloaded experts with union prefetch: the most of the cache's slots a Verify's projected union "
                        "(or the scheduler's hint for an admitted demand) may take before its forward, 0-1 (0 = nothing "
                        "ahead of the forward)")
    v.add_argument("--expert-guess-width", type=_number, default=0, metavar="N",
                   help="offloaded experts with layer prefetch: how many of the next layer's router picks per token its "
                        "guess fetches while this layer computes (0 = auto: a quarter of the router's top_k, at least 1)")
    v.add_argument("--no-expert-fill-overlap", dest="expert_fill_overlap", action="store_false",
                   help="offloaded experts (device-managed cache): copy a layer's missing experts before any of its GEMMs "
                        "instead of while its resident experts' GEMMs run (the same output either way)")
    v.add_argument("--kv-cache-gb", type=_number, default=0.0, metavar="GIB",
                   help="size of the verifier's paged KV pool in GiB (0 = automatic: a quarter of the free GPU memory, "
                        "0.25 on a CPU)")
    v.add_argument("--prefill-chunk", type=_number, default=0, metavar="TOKENS",
                   help="prompt tokens one prefill forward takes on the paged KV (0 = the whole prompt): verifies waiting "
                        "for the device run between a long prompt's chunks; the output is the same either way")
    v.add_argument("--no-prefill-graphs", dest="prefill_graphs", action="store_false",
                   help="prefills of up to 512 tokens (prompts, --prefill-chunk chunks) run eagerly instead of replaying "
                        "CUDA graphs (the same output; an eager forward pays ~20-30 ms of host time)")
    v.add_argument("--max-wave-sessions", type=_number, default=0, metavar="N",
                   help="multi-session verify waves: the verifies of up to N sessions waiting for the device share one "
                        "forward (on the paged KV, each session's answer bit-identical to its own verify's), and so do "
                        "up to N prompts waiting to be prefilled; 1 = off; "
                        "0 (default) = auto: 8 on CUDA, 1 on a CPU")
    v.add_argument("--warmup", default="auto", nargs="?", const="on", type=switch_value, choices=list(SWITCH),
                   help="before the verifier serves, run short prefills and a verify per CUDA-graph bucket (with and "
                        "without the DFlash drafter's feature layers) and release them, so the first request pays no "
                        "first-use costs: auto (the default) = on CUDA, off on a CPU; --warmup alone = on; also reads "
                        "true/false/1/0")
    v.add_argument("--no-warmup", dest="warmup", action="store_const", const="off", help="as --warmup off")
    d = p.add_argument_group("drafter", "where and how the DFlash drafter runs (serve-drafter's --device, --dtype and "
                                        "--no-drafter-cuda-graphs)")
    d.add_argument("--drafter-device", default=None,
                   help="torch device of the DFlash drafter: auto, cpu, cuda, cuda:N (default: the verifier's --device; "
                        "on a one-GPU host both processes share the GPU)")
    d.add_argument("--drafter-dtype", default="auto", choices=DTYPES,
                   help="auto = bfloat16 on CUDA, float32 on CPU")
    d.add_argument("--no-drafter-graphs", action="store_true",
                   help="on CUDA, run the DFlash drafter's forwards eagerly instead of replaying them from CUDA graphs")
    g = p.add_argument_group(
        "TLS and secrets",
        "TLS on every hop: each service serves --tls-cert/--tls-key; --tls-ca is the CA that signed them. "
        "Secrets come from the environment: PDFLASH_AUTH_TOKEN (the public API's bearer token) and "
        "PDFLASH_TICKET_SECRET (scheduler-signed admission tickets, checked by the verifier).",
    )
    g.add_argument("--tls-cert", default="", help="PEM certificate chain every service serves")
    g.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default="", help="PEM CA that signed the certificates (required with --tls-cert)")
    g.add_argument("--tls-no-client-auth", action="store_true", help="one-way TLS: do not require client certificates")
    g.add_argument("--tls-client-cert", default="", help="client certificate for the internal hops (default: --tls-cert)")
    g.add_argument("--tls-client-key", default="", help="PEM private key of --tls-client-cert")


def _add_client_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default="", help="PEM CA that signed the server's certificate: connect over TLS")
    p.add_argument("--tls-cert", default="", help="PEM client certificate, for a server that requires mutual TLS")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")


class UsageError(Exception):
    """A command-line value out of range: one line per problem, exit code 2 (`main`)."""

    def __init__(self, lines: list[str]):
        super().__init__("; ".join(lines))
        self.lines = lines


def _number(text: str):
    """argparse type of every numeric option: int or float as written, else the text itself, so the range
    check (pdflash.validation) names the option and its range for any value, "nan" and "1e99" included."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _check(violations, flags: dict[str, str]) -> None:
    """UsageError naming each option (by its flag) and what it must be, in pdflash.validation's words."""
    if violations:
        raise UsageError([f"{_flag_of(v.field, flags)}: {v.description}" for v in violations])


def _flag_of(field: str, flags: dict[str, str]) -> str:
    """A request field as its option spells it; an entry of a repeated one keeps its index (stop[1] -> --stop[1])."""
    base, _, index = field.partition("[")
    return flags.get(field) or (flags[base] + "[" + index if index and base in flags else field)


def _check_seconds(args, *names: str) -> None:
    from pdflash.validation import seconds_violation

    _check([v for n in names if (v := seconds_violation(n, getattr(args, n))) is not None],
           {n: "--" + n.replace("_", "-") for n in names})


_OFFLOAD_OPTIONS = (("expert_prefetch", "union,layer"), ("expert_cache_mode", "device"), ("expert_eviction", "lru"),
                    ("expert_arrival_share", 0.5), ("expert_guess_width", 0), ("expert_fill_overlap", True))


def _flag(name: str, value) -> str:
    """An option as `up`'s command line spells it: a switch off as --no-NAME, else --NAME VALUE."""
    if value is False:
        return f"--no-{name.replace('_', '-')}"
    return f"--{name.replace('_', '-')} {value}"


def _check_gib(args, name: str, zero: str) -> float:
    """A size option in GiB (0 or more, finite); UsageError naming it otherwise. Returns its value."""
    gb = getattr(args, name, 0.0)
    if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not 0.0 <= gb < float("inf"):
        raise UsageError([f"--{name.replace('_', '-')}: must be a number of GiB >= 0 ({zero}), got {gb}"])
    return gb


def _check_stack_args(args) -> None:
    """What `up` and `demo` check before anything starts: numbers in range, the model and drafter directories
    exist, and a named drafter fits the target."""
    from drafter_svc.config import check_drafter_fits
    from pdflash.devices import check_device
    from pdflash.validation import int_violation

    flags = {n: "--" + n.replace("_", "-") for n in ("port", "scheduler_port", "verifier_port", "max_crashes",
                                                      "max_wave_sessions", "prefill_chunk", "metrics_port")}
    v = [int_violation(n, getattr(args, n), 1, 65535) for n in ("port", "scheduler_port", "verifier_port")]
    if getattr(args, "metrics_port", -1) != -1:
        v.append(int_violation("metrics_port", args.metrics_port, 1, 65533, "(-1 = no metrics)"))
    if hasattr(args, "max_wave_sessions"):
        v.append(int_violation("max_wave_sessions", args.max_wave_sessions, 0, 1024))
        v.append(int_violation("prefill_chunk", args.prefill_chunk, 0, 1 << 20))
    if hasattr(args, "max_crashes"):
        v.append(int_violation("max_crashes", args.max_crashes, 1, 1_000_000))
    _check([x for x in v if x is not None], flags)
    _check_seconds(args, "startup_timeout", *(("crash_window",) if hasattr(args, "crash_window") else ()))
    _check_gib(args, "kv_cache_gb", "0 = automatic")
    gb = _check_gib(args, "expert_cache_gb", "0 = every expert resident")
    share = getattr(args, "expert_arrival_share", 0.5)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
        raise UsageError([f"--expert-arrival-share: must be a share of the cache's slots in [0, 1] (0 = off), got {share}"])
    width = getattr(args, "expert_guess_width", 0)
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise UsageError([f"--expert-guess-width: must be a count >= 0 (0 = auto: a quarter of the router's top_k), got {width}"])
    if gb > 0 and getattr(args, "experts", "native") != "mxfp4":
        raise UsageError(["--expert-cache-gb serves offloaded MXFP4 experts: add --experts mxfp4"])
    # Offloading options without an expert cache, or a host-cache policy with the device cache: the verifier would
    # ignore the first and refuse the second once started; say so before anything starts. The verifier also reads
    # PDFLASH_<OPTION> for what `up` leaves at its default, so those count.
    def effective(name: str, default):
        value = getattr(args, name)
        return os.environ.get(f"PDFLASH_{name.upper()}", "").strip() or default if value == default else value

    offloaded = gb > 0 or effective("expert_cache_gb", 0.0) not in (0.0, "0", "0.0")
    changed = [_flag(n, getattr(args, n)) for n, default in _OFFLOAD_OPTIONS if getattr(args, n) != default]
    if changed and not offloaded:
        raise UsageError([f"{', '.join(changed)}: only for offloaded experts; add --experts mxfp4 --expert-cache-gb GiB"])
    eviction, mode = effective("expert_eviction", "lru"), effective("expert_cache_mode", "device")
    if args.expert_eviction != "lru" and mode != "host":
        raise UsageError([f"--expert-eviction {eviction} is a policy of --expert-cache-mode host (the device-managed "
                          "cache evicts LRU within each layer's slots): add --expert-cache-mode host"])
    check_device(args.device, "--device")
    if args.drafter_device is not None:
        check_device(args.drafter_device, "--drafter-device")
    ports = [args.port, args.scheduler_port, args.verifier_port]
    if len(set(ports)) != 3:
        raise UsageError([f"--port, --scheduler-port and --verifier-port must differ, got {ports[0]}, {ports[1]}, {ports[2]}"])
    for name in ("model", "drafter"):
        d = getattr(args, name)
        if d and not os.path.isfile(os.path.join(d, "config.json")):
            raise ConfigError(f"--{name} {d!r}: no config.json there; point it at a checkpoint directory")
    if args.drafter:
        check_drafter_fits(args.drafter, args.model)


def _spec(args):
    import os

    from pdflash.stack import StackSpec

    if args.tls_cert and not (args.tls_key and args.tls_ca):
        raise ConfigError("--tls-cert needs --tls-key and --tls-ca")
    return StackSpec(
        model=args.model, drafter=args.drafter, no_dflash=args.no_dflash, drafter_host=args.host,
        drafter_port=args.port, scheduler_port=args.scheduler_port, verifier_port=args.verifier_port,
        log_dir=args.log_dir, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
        tls_mutual=not args.tls_no_client_auth, tls_client_cert=args.tls_client_cert, tls_client_key=args.tls_client_key,
        auth_token=os.environ.get("PDFLASH_AUTH_TOKEN", ""), ticket_secret=os.environ.get("PDFLASH_TICKET_SECRET", ""),
        pin=not args.no_pin, verifier_args=_verifier_args(args), drafter_args=_drafter_args(args),
        metrics_ports=(-1, -1, -1) if args.metrics_port == -1 else tuple(args.metrics_port + i for i in range(3)),
    )


def _verifier_args(args) -> list[str]:
    """The verifier options `pdflash up` passes through (only those changed from their defaults)."""
    out = []
    for flag, default in (("device", "auto"), ("dtype", "auto"), ("kernels", "auto"), ("experts", "native"), ("expert_cache_gb", 0.0),
                          ("expert_prefetch", "union,layer"), ("expert_cache_mode", "device"), ("expert_eviction", "lru"),
                          ("expert_arrival_share", 0.5), ("expert_guess_width", 0), ("expert_fill_overlap", True),
                          ("kv_cache_gb", 0.0), ("max_wave_sessions", 0), ("prefill_chunk", 0), ("prefill_graphs", True),
                          ("warmup", "auto")):
        value = getattr(args, flag, default)
        if value != default:
            out += _flag(flag, value).split(" ", 1)
    return out


def _drafter_args(args) -> list[str]:
    """The drafter's --device (default: the verifier's) and --dtype, when not auto; its CUDA graphs, when off."""
    device = args.drafter_device or args.device
    return (["--device", device] if device != "auto" else []) + (
        ["--dtype", args.drafter_dtype] if args.drafter_dtype != "auto" else []) + (
        ["--no-drafter-cuda-graphs"] if getattr(args, "no_drafter_graphs", False) else [])


def _say(command: str):
    return lambda line: print(f"pdflash {command}: {line}", file=sys.stderr, flush=True)


def _drafter_note(args, say) -> None:
    """With a model of one's own and no --drafter, say once why there is no DFlash drafting."""
    from pdflash.defaults import default_drafter_for

    if args.model and not args.drafter and not args.no_dflash:
        _, why = default_drafter_for(args.model)
        if why:
            say(why)


def _start(stack, timeout: float, say, abort=None) -> bool:
    """Start the services and wait until the drafter serves; on failure stop them and say one line."""
    from pdflash.stack import StartupError

    try:
        stack.start()
        stack.wait_ready(timeout, abort=abort)
        return True
    except StartupError as e:
        stack.stop()  # first: the services' goodbyes must not follow the one line that says what happened
        say(f"could not start: {e}")
        return False


def cmd_up(args) -> int:
    from pdflash.stack import RestartPolicy, Stack, Supervisor

    _check_stack_args(args)
    spec = _spec(args)
    say = _say("up")
    stop = {"flag": False}

    def on_signal(signum, frame):
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _drafter_note(args, say)
    stack = Stack(spec)
    try:
        if not _start(stack, args.startup_timeout, say, abort=lambda: stop["flag"]):
            return 130 if stop["flag"] else 1
        pids = ", ".join(f"{n} {p.pid}" for n, p in stack.procs.items())
        metrics = ("no metrics" if args.metrics_port == -1
                   else f"metrics :{args.metrics_port}-{args.metrics_port + 2}")
        say(f"serving: drafter {args.host}:{args.port} (scheduler :{args.scheduler_port}, verifier :{args.verifier_port}; "
            f"{metrics}; pids {pids}); Ctrl-C stops it")
        policy = RestartPolicy(max_crashes=args.max_crashes, window_s=args.crash_window)
        reason = Supervisor(stack, policy, say=say).run(lambda: stop["flag"])
        if reason is not None:
            stack.stop()  # first: the services' goodbyes must not follow the line that says why
            say(reason)
            return 1
        say("stopping")
        return 0
    finally:
        stack.stop()


def cmd_demo(args) -> int:
    """Start the stack, answer one request, print it with its statistics, stop.

    The terminal carries the prompt, the streamed completion and the summary; the services log to files
    (--log-dir, default a fresh directory whose path is printed)."""
    import tempfile

    from pdflash.client import Client
    from pdflash.errors import InvalidArgument
    from pdflash.stack import Stack

    _check_stack_args(args)
    try:
        req = Client.request(args.prompt, max_tokens=args.max_tokens)
    except InvalidArgument as e:
        _check(e.violations, {"max_tokens": "--max-tokens"})
    say = _say("demo")
    if not args.log_dir:
        args.log_dir = tempfile.mkdtemp(prefix="pdflash-demo-logs-")
    spec = _spec(args)
    say(f"service logs: {args.log_dir}")
    _drafter_note(args, say)
    stack = Stack(spec)
    busy = stack.busy_ports()
    if busy and _default_ports(args):  # the demo is self-contained: another stack on the defaults is not an error
        from pdflash.stack import free_ports

        spec.drafter_port, spec.scheduler_port, spec.verifier_port = free_ports(3)
        spec.metrics_ports = (-1, -1, -1)
        say(f"port in use ({', '.join(busy)}): the demo runs on free ports {spec.drafter_port}, {spec.scheduler_port}, "
            f"{spec.verifier_port}, without metrics")
    try:
        if not _start(stack, args.startup_timeout, say):
            return 1
        with Client(stack.drafter, spec.credentials(), token=spec.auth_token) as client:
            info = client.model_info()
            print(f"model {info.model} ({info.architecture}); drafters available: "
                  f"{', '.join(k.removeprefix('DRAFTER_KIND_').lower() for k in map(_kind_name, info.drafters))}", file=sys.stderr)
            print(">>> " + args.prompt.replace("\n", "\n... "), file=sys.stderr)
            sys.stdout.write(args.prompt)
            t0 = time.perf_counter()
            n = 0
            final = None
            for msg in client.stream(req, timeout=600):
                if msg.HasField("chunk"):
                    n += len(msg.chunk.token_ids)
                    sys.stdout.write(msg.chunk.text)
                    sys.stdout.flush()
                else:
                    final = msg.final
                    sys.stdout.write(final.text + "\n")
            dt = time.perf_counter() - t0
            u = final.usage
            print(f"--- {n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s), {u.rounds} verify rounds, "
                  f"mean acceptance length {u.mean_acceptance_length:.2f}", file=sys.stderr)
    finally:
        stack.stop()
    return 0


def _rpc_failed(e) -> int:
    """A call the server failed (a grpc.RpcError): its status and message on stderr; exit code 2 when it refused a
    value (as the client-side checks do), 1 otherwise (the server unreachable, a deadline, ...)."""
    import grpc

    print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
    return 2 if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE) else 1


def _default_ports(args) -> bool:
    """The stack's three ports are the defaults (none given on the command line)."""
    return (args.port, args.scheduler_port, args.verifier_port) == (50051, 50052, 50053)


def _kind_name(k: int) -> str:
    from pdflash.v1 import drafter_pb2

    return drafter_pb2.DrafterKind.Name(k)


def cmd_generate(args) -> int:
    import grpc

    from pdflash.client import Client

    from pdflash.errors import InvalidArgument
    from pdflash.validation import seconds_violation

    v = [x for x in (seconds_violation("timeout", args.timeout),) if x is not None]
    try:
        req = Client.request(
            _conversation(args), max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, drafter=args.drafter, block_size=args.block_size, ignore_eos=args.ignore_eos,
            fixed_width=args.fixed_width, stop=args.stop or (), logprobs=args.logprobs or args.top_logprobs > 0,
            top_logprobs=args.top_logprobs, repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        )
    except InvalidArgument as e:
        v += e.violations
    _check(v, GENERATE_FLAGS)
    with Client(args.target, token=args.token, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key) as client:
        try:
            final = None
            scored = []  # (id, logprob, alternatives) per token, with --logprobs
            t0 = time.perf_counter()
            for msg in client.stream(req, timeout=args.timeout):
                if msg.HasField("chunk"):
                    sys.stdout.write(msg.chunk.text)
                    sys.stdout.flush()
                    tops = list(msg.chunk.top_logprobs) or [None] * len(msg.chunk.logprobs)
                    scored += zip(msg.chunk.token_ids, msg.chunk.logprobs, tops)
                else:
                    final = msg.final
                    sys.stdout.write(final.text)
            sys.stdout.write("\n")
            elapsed = time.perf_counter() - t0  # the whole call as the client sees it, prefill included
        except grpc.RpcError as e:
            return _rpc_failed(e)
        pieces: dict[int, str] = {}  # each token's own text (Detokenize, special tokens kept), as Python writes a str

        def piece(i: int) -> str:
            if i not in pieces:
                try:
                    pieces[i] = repr(client.detokenize([i], skip_special_tokens=False))
                except grpc.RpcError:
                    pieces[i] = "?"
            return pieces[i]

        for tok, lp, top in scored:  # after the text, on stderr: id, text, logprob, then the alternatives id:text:logprob
            alts = "" if top is None else "\t" + " ".join(f"{i}:{piece(i)}:{x:.4f}" for i, x in zip(top.token_ids, top.logprobs))
            print(f"{tok}\t{piece(tok)}\t{lp:.4f}{alts}", file=sys.stderr)
        if args.stats and final is not None:
            u = final.usage
            print(f"finish={_finish_name(final.finish_reason)}"
                  + (f" stop_sequence={final.stop_sequence!r}" if final.stop_sequence else "") + f" prompt_tokens={u.prompt_tokens} completion_tokens={u.completion_tokens} "
                  f"rounds={u.rounds} mean_acceptance_length={u.mean_acceptance_length:.2f} seconds={elapsed:.3f} "
                  f"tokens_per_second={u.completion_tokens / max(elapsed, 1e-9):.1f}", file=sys.stderr)
    return 0


def _conversation(args):
    """The prompt, or with --chat / --system the conversation it is the user's turn of."""
    if not (args.chat or args.system is not None):
        return args.prompt
    return ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
        {"role": "user", "content": args.prompt}]


def cmd_tokenize(args) -> int:
    import grpc

    from pdflash.client import Client

    _check_seconds(args, "timeout")
    with Client(args.target, token=args.token, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key) as client:
        try:
            r = client.tokenize(_conversation(args), timeout=args.timeout)
        except grpc.RpcError as e:
            return _rpc_failed(e)
    print(f"{r.count} tokens" + ("" if r.fits_prompt else " (more than a prompt may hold on this server)"))
    if args.ids:
        print(" ".join(map(str, r.ids)))
    return 0


GENERATE_FLAGS = {"max_tokens": "--max-tokens", "block_size": "--block-size", "sampling.temperature": "--temperature",
                  "sampling.top_p": "--top-p", "sampling.top_k": "--top-k", "sampling.seed": "--seed", "drafter": "--drafter",
                  "timeout": "--timeout", "stop": "--stop", "top_logprobs": "--top-logprobs",
                  "sampling.repetition_penalty": "--repetition-penalty", "sampling.presence_penalty": "--presence-penalty",
                  "sampling.frequency_penalty": "--frequency-penalty"}


def _finish_name(r: int) -> str:
    from pdflash.v1 import common_pb2

    return common_pb2.FinishReason.Name(r).removeprefix("FINISH_REASON_").lower()


def cmd_health(args) -> int:
    from pdflash.stack import health_status
    from pdflash.tls import channel_credentials

    _check_seconds(args, "timeout")
    status, why = health_status(args.target, args.service, args.timeout,
                                channel_credentials(args.tls_ca, args.tls_cert, args.tls_key))
    print(status)
    if why:
        print(f"pdflash health: {why}", file=sys.stderr)
    return 0 if status == "SERVING" else 1


def _add_stub_command(sub) -> None:
    """`pdflash stub`: the public API without a model, for tests of clients (pdflash.testing)."""
    from pdflash.config import add_arguments
    from pdflash.testing.config import StubConfig

    text = ("serve the public Drafter API without a model, for tests of clients: echo, fixed text, faults, stalls, "
            "or record / replay a real stack")
    p = sub.add_parser("stub", help=text, description=text + ". Per request, metadata pdflash-stub-<option> overrides "
                       "the script options (text ... stall-after).", epilog=EPILOG)
    add_arguments(p, StubConfig)
    p.set_defaults(func=lambda a: importlib.import_module("pdflash.testing.stub").run(a) or 0)


# Commands that run the model, and what they need beyond the light install (the `serve` extra).
SERVING_COMMANDS = ("up", "demo", "serve-scheduler", "serve-verifier", "serve-drafter")
SERVING_MODULES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "prometheus_client")


def _serving_missing() -> list[str]:
    import importlib.util

    return [m for m in SERVING_MODULES if importlib.util.find_spec(m) is None]


def _version() -> str:
    """The installed distribution's version; run from a checkout that is not installed (PYTHONPATH, the GPU machine's
    copy), the checkout's pyproject.toml's."""
    import pathlib
    import tomllib
    from importlib import metadata

    try:
        return metadata.version("pdflash")
    except metadata.PackageNotFoundError:
        pyproject = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
        try:
            return f"{tomllib.loads(pyproject.read_text())['project']['version']} (a checkout, not installed)"
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "(not installed: run from a checkout)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdflash", description="Speculative decoding for offloaded MoE models, as gRPC services.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # Only the option classes are imported here: `pdflash health` and `generate` must start fast
    # (container healthchecks run them), so a service's heavy modules load when it is served.
    from drafter_svc.config import DrafterConfig
    from pdflash.config import add_arguments
    from scheduler_svc.config import SchedulerConfig
    from verifier_svc.config import VerifierConfig

    for name, cls, module, help_text in (
        ("serve-scheduler", SchedulerConfig, "scheduler_svc.server", "serve the scheduler (verify admission)"),
        ("serve-verifier", VerifierConfig, "verifier_svc.server", "serve the verifier (target model, KV cache, experts)"),
        ("serve-drafter", DrafterConfig, "drafter_svc.server", "serve the drafter: the public Generate API"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=EPILOG)
        add_arguments(p, cls)
        p.set_defaults(func=lambda a, m=module: importlib.import_module(m).run(a) or 0)

    p = sub.add_parser("up", help="start all three services (foreground; Ctrl-C stops them)",
                       description="Start the three services and keep them running: a service that exits is restarted "
                                   "(after 0.5 s, doubling per crash up to 10 s); Ctrl-C or SIGTERM stops the stack, "
                                   "and so do --max-crashes crashes of one service within --crash-window seconds.")
    _add_stack_args(p)
    p.add_argument("--max-crashes", type=_number, default=5,
                   help="stop the stack when one service crashes this many times within --crash-window seconds")
    p.add_argument("--crash-window", type=_number, default=60.0, help="seconds over which --max-crashes counts")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("demo", help="start the stack, answer one request with statistics, stop")
    _add_stack_args(p)
    p.add_argument("--prompt", default="class Stack:\n    def __init__(self):\n",
                   help="the prompt to complete (default: the start of a Python class)")
    p.add_argument("--max-tokens", type=_number, default=96, help="tokens to generate (default 96)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="stream a completion from a running stack")
    p.add_argument("prompt", help="the text to complete (with --chat: the user's message)")
    p.add_argument("--target", default="127.0.0.1:50051", help="the drafter's address, host:port (default 127.0.0.1:50051)")
    p.add_argument("--max-tokens", type=_number, default=64,
                   help="most tokens to generate, up to the server's limit (0 = the server's default; default 64)")
    p.add_argument("--temperature", type=_number, default=0.0,
                   help="0 = greedy (the default), else sample at this temperature, in (0, 100]")
    p.add_argument("--top-p", type=_number, default=1.0, help="sampling: nucleus mass, in (0, 1] (0 or 1 = off; default 1)")
    p.add_argument("--top-k", type=_number, default=0, help="sampling: only the k likeliest tokens (0 = off, the default)")
    p.add_argument("--seed", type=_number, default=None,
                   help="sampling: seed in [0, 2^64 - 1], the same seed gives the same text (default: none)")
    p.add_argument("--repetition-penalty", type=_number, default=1.0,
                   help="penalize the prompt's and output's tokens (transformers' semantics; 1 = off, the default, as is 0; (0, 10])")
    p.add_argument("--presence-penalty", type=_number, default=0.0, help="subtract from output tokens' logits once ([-2, 2])")
    p.add_argument("--frequency-penalty", type=_number, default=0.0,
                   help="subtract from output tokens' logits per occurrence ([-2, 2])")
    p.add_argument("--drafter", default="unspecified", choices=["unspecified", "none", "ngram", "dflash", "hybrid"],
                   help="who drafts the blocks (default unspecified = the server's: hybrid when it has a DFlash drafter, "
                        "else ngram; none = plain decoding)")
    p.add_argument("--block-size", type=_number, default=0, help="widest verify block (0 = the server's default)")
    p.add_argument("--fixed-width", action="store_true", help="draft the whole block every round (default: the width adapts)")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token, to --max-tokens")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as the user's message of a conversation (the model's chat template makes the "
                        "prompt; ModelInfo says whether it has one)")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat (implied): a system message first")
    p.add_argument("--logprobs", action="store_true",
                   help="print each token's id and log-probability under the target model to stderr after the text")
    p.add_argument("--top-logprobs", type=int, default=0, metavar="N",
                   help="with them, the N likeliest tokens at each position (0-20; implies --logprobs)")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="a stop sequence (repeatable, at most 16): the text ends before the first one generated "
                        "(bash: --stop $'\\n\\n' for a blank line)")
    p.add_argument("--timeout", type=_number, default=300.0, help="deadline of the whole call in seconds (default 300)")
    p.add_argument("--stats", action="store_true", help="print usage statistics to stderr")
    p.add_argument("--token", default=os.environ.get("PDFLASH_AUTH_TOKEN", ""),
                   help="bearer token of the public API [env PDFLASH_AUTH_TOKEN]")
    _add_client_tls_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("tokenize", help="count a prompt's tokens as a running stack's model does")
    p.add_argument("prompt", help="the text to tokenize")
    p.add_argument("--target", default="127.0.0.1:50051", help="the drafter's address, host:port (default 127.0.0.1:50051)")
    p.add_argument("--chat", action="store_true", help="the prompt as the user's message, through the model's chat template")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat (implied): a system message first")
    p.add_argument("--ids", action="store_true", help="print the token ids too")
    p.add_argument("--timeout", type=_number, default=10.0, help="deadline in seconds (default 10)")
    p.add_argument("--token", default=os.environ.get("PDFLASH_AUTH_TOKEN", ""),
                   help="bearer token of the public API [env PDFLASH_AUTH_TOKEN]")
    _add_client_tls_args(p)
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("health", help="probe grpc.health.v1 (exit 0 when SERVING)")
    p.add_argument("target", nargs="?", default="127.0.0.1:50051", help="host:port to probe (default 127.0.0.1:50051)")
    p.add_argument("--service", default="", help="the service to ask about: pdflash.v1.Drafter, pdflash.v1.Scheduler, "
                                                 "pdflash.v1.Verifier, or '' (the default) for the whole server")
    p.add_argument("--timeout", type=_number, default=3.0, help="deadline in seconds (default 3)")
    _add_client_tls_args(p)
    p.set_defaults(func=cmd_health)

    _add_stub_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in SERVING_COMMANDS and (missing := _serving_missing()):
        print(f"pdflash {args.command}: needs the serving dependencies ({', '.join(missing)} missing); this is the light "
              "install (client, stub, pytest plugin): pip install 'pdflash[serve]', torch first (see README)", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        for line in e.lines:
            print(f"pdflash {args.command}: {line}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"pdflash {args.command}: configuration error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
