"""Multi-session verify waves in process: S sessions decoding at once, their verifies one forward each (one after
another, as with --max-wave-sessions 1) or together in one forward per round (VerifierCore.verify_wave, as the
servicer runs the calls that wait for the device with --max-wave-sessions S).

    python benchmarks/waves.py [--targets qwen3-8l gptoss-24l] [--sessions 1 2 4 8] [--block 8] [--new-tokens 64]
                               [--prompt-tokens 128] [--layers N] [--tiny] [--device cuda|cpu] [--out DIR]
    python benchmarks/waves.py --device cpu --targets demo --sessions 1 2 --new-tokens 8     # CPU smoke run

Targets as benchmarks/e2e_gpu.py builds them (demo, qwen3-<N>l, gptoss-<N>l). Each session gets its own prompt and
a replay drafter proposing its block-1 continuation with every 4th draft wrong (tau ~ 4), at a fixed width of --block
tokens (anchor + drafts). Every row runs once untimed (Triton compiles, the wave buckets' CUDA graphs captured) and
once timed; prefills are outside the clock.

Columns: decode tok/s (every session's tokens over the rounds' wall time), ms/round (one round = every live session
verified once), forward_ms (the forwards' own time per round, summed over its forwards), speedup (waves over one
after another at the same S), experts a layer (per round and MoE layer, the live sessions' routed experts summed, and
their union: what one forward a session reads against what a wave reads), identical (every session's output equals
its block-1 reference; the script exits 1
otherwise). On transformers' cache (the CPU default) a wave is its verifies in turn, so its speedup is ~1 by design.

Chunked prefill (`--prefill-tokens N --chunks C ...`): one prompt of N random tokens prefilled in one forward and in
chunks of C tokens (`--prefill-chunk C`, on the paged KV): the whole prefill's ms, its longest forward (how long the
sessions already decoding wait behind it at most: the server gives them the device between chunks) and whether the
first token is the one-go prefill's. On transformers' cache (the CPU default) a prompt is one forward whatever C.

Prefill waves (`--prefill-waves S ...`): S prompts of --prompt-tokens random tokens prefilled one after another and
in one prefill wave (as the servicer runs the prompts that wait for the device together): ms for all of them, and
whether the first tokens and routed experts are the same.

Writes waves_<device>.json / .md (waves_h200.* on the H200) to --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.e2e_gpu import build, none_propose, replay, serve  # noqa: E402
from benchmarks.inprocess import core_run  # noqa: E402
from benchmarks.kernel_bench import device_tag  # noqa: E402
from pdflash.types import DraftResult, SamplingParams, union_bytes  # noqa: E402
from verifier_svc.engine import PagedKVOptions, PrefillInput, VerifierCore  # noqa: E402
from verifier_svc.runner import prefill_graphs_enabled, prefill_wave_graphs_enabled  # noqa: E402


def decode(core: VerifierCore, prompts, refs, new_tokens: int, block: int, waves: bool) -> dict:
    """Every prompt's session decoding at once, round by round; -> the rounds' wall time, tokens, forwards' ms."""
    byte_map = core.target.byte_map
    propose = replay(refs)
    live = []
    for i, p in enumerate(prompts):
        pre = core.prefill(PrefillInput(f"wave{i}", tuple(p), SamplingParams(), new_tokens, ignore_eos=True))
        live.append({"i": i, "sid": pre.session_id, "out": list(pre.tokens), "anchor": pre.tokens[-1],
                     "union": pre.routed_union, "round": 0, "done": pre.finished is not None})
    sessions = list(live)
    rounds = tokens = 0
    forward_ms = 0.0
    routed = [0, 0]  # per round and MoE layer: the sessions' routed experts summed, their union (what a wave reads)
    t0 = time.perf_counter()
    while any(not s["done"] for s in sessions):
        drafts = []
        for s in sessions:
            if s["done"]:
                continue
            s["round"] += 1
            k = max(0, min(block - 1, new_tokens - len(s["out"]) - 1))
            d = propose(s["i"], prompts[s["i"]], s["out"], k, {}) if k else []
            drafts.append((s, DraftResult(s["sid"], s["round"], (s["anchor"], *d), s["union"], union_bytes(s["union"], byte_map))))
        if waves:
            outs = core.verify_wave([(d, False) for _, d in drafts])
            ms = [o.forward_ms for o in outs if not isinstance(o, BaseException)]
            forward_ms += (max(ms, default=0.0) if core.wave_forward and len(outs) > 1 else sum(ms))  # (one forward, or one each)
        else:
            outs = [core.verify(d, return_features=False) for _, d in drafts]
            forward_ms += sum(o.forward_ms for o in outs)
        layers: dict[int, list[frozenset]] = {}
        for o in outs:
            for layer, ids in ({} if isinstance(o, BaseException) else o.routed_union).items():
                layers.setdefault(layer, []).append(ids)
        routed[0] += sum(len(x) for sets in layers.values() for x in sets) / max(1, len(layers))
        routed[1] += sum(len(frozenset().union(*sets)) for sets in layers.values()) / max(1, len(layers))
        for (s, _), o in zip(drafts, outs):
            if isinstance(o, BaseException):
                raise o
            s["out"] += o.tokens
            tokens += len(o.tokens)
            s["anchor"], s["union"] = o.tokens[-1] if o.tokens else s["anchor"], o.routed_union
            s["done"] = o.finished is not None or not o.tokens
        rounds += 1
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "rounds": rounds, "forward_ms": forward_ms,
            "experts_summed": routed[0] / max(1, rounds), "experts_union": routed[1] / max(1, rounds),
            "outputs": [s["out"] for s in sessions]}


def prefill_rows(core: VerifierCore, name: str, vocab: int, tokens: int, chunks: list[int]) -> list[dict]:
    """One prompt prefilled whole and in chunks of each size: ms in all, the longest forward, the first token."""
    import random

    rng = random.Random(1)
    prompt = tuple(rng.randrange(2, vocab) for _ in range(tokens))
    rows, first = [], None
    for chunk in [0, *chunks]:
        core.prefill_chunk = chunk
        try:
            for timed in (False, True):  # the first run compiles and allocates
                job = core.start_prefill(PrefillInput("prefill", prompt, SamplingParams(), 1, ignore_eos=True))
                steps = []
                try:
                    t0 = time.perf_counter()
                    done = False
                    while not done:
                        ts = time.perf_counter()
                        done = job.step()
                        steps.append((time.perf_counter() - ts) * 1e3)
                    out = job.finish()
                    total = (time.perf_counter() - t0) * 1e3
                finally:
                    job.close()
        finally:
            core.prefill_chunk = 0
        first = out.tokens[0] if first is None else first
        rows.append({"target": name, "prompt_tokens": tokens, "chunk": chunk, "forwards": len(steps), "ms": total,
                     "longest_forward_ms": max(steps), "same_first_token": out.tokens[0] == first})
    return rows


def prefill_wave_rows(core: VerifierCore, name: str, vocab: int, tokens: int, counts: list[int]) -> list[dict]:
    """S prompts of `tokens` random tokens prefilled one after another (a forward each, from its prefill graph where a
    bucket holds it) and in one prefill wave (VerifierCore.prefill_wave, one ragged forward): ms for all of them, and
    whether every first token and routed-expert set is the one-after-another's."""
    import random

    rng = random.Random(2)
    rows = []
    for n in counts:
        prompts = [tuple(rng.randrange(2, vocab) for _ in range(tokens)) for _ in range(n)]
        got = {}
        served = core.prefill_wave_graphed_rows
        for mode in ("one after another", "wave", "served"):
            # wave: every prompt in the one ragged forward; served: the server's rule (prompts that would replay prefill
            # graphs do so one after another unless their rows reach prefill_wave_graphed_rows)
            core.prefill_wave_graphed_rows = 0 if mode == "wave" else served
            for timed in (False, True):  # the first run compiles, captures and allocates
                jobs = [core.start_prefill(PrefillInput(f"pw{i}", p, SamplingParams(), 1, ignore_eos=True))
                        for i, p in enumerate(prompts)]
                outs = []
                try:
                    t0 = time.perf_counter()
                    done = [j.step() for j in jobs] if mode == "one after another" else core.prefill_wave(jobs)
                    assert all(d is True for d in done), done
                    outs = [j.finish() for j in jobs]
                    ms = (time.perf_counter() - t0) * 1e3
                finally:
                    for o in outs:
                        if o.session_id:
                            core.end(o.session_id)
                    for j in jobs:
                        j.close()
            got[mode] = (ms, [(o.tokens[0], o.routed_union) for o in outs])
        core.prefill_wave_graphed_rows = served
        base, wave, srv = got["one after another"], got["wave"], got["served"]
        rows.append({"target": name, "prompts": n, "prompt_tokens": tokens, "one_after_another_ms": base[0],
                     "wave_ms": wave[0], "speedup": base[0] / wave[0], "served_ms": srv[0],
                     "served_speedup": base[0] / srv[0], "same": wave[1] == base[1] == srv[1]})
    return rows


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Multi-session verify waves ({m['device_name']}, {m['date']})", "", ("`" + ("PDFLASH_PREFILL_WAVE_GRAPHS=1 " if m.get("prefill_wave_graphs") else "") + ("" if m.get("prefill_graphs") or m["device"] == "cpu" else "PDFLASH_PREFILL_GRAPHS=0 ") + f"{m['command']}`"), "",
             "| target | sessions | block | mode | decode tok/s | ms/round | forward_ms/round | speedup | experts a layer: summed / union | identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        speedup = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else ""
        lines.append(f"| {r['target']} | {r['sessions']} | {r['block']} | {r['mode']} | {r['tok_s']:.1f} | "
                     f"{r['ms_per_round']:.2f} | {r['forward_ms_per_round']:.2f} | {speedup} | "
                     f"{r.get('experts_summed', 0):.1f} / {r.get('experts_union', 0):.1f} | {r['identical']} |")
    if result.get("prefill"):
        lines += ["", "| target | prompt tokens | chunk | forwards | prefill ms | longest forward ms | same first token |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['target']} | {r['prompt_tokens']} | {r['chunk'] or 'whole'} | {r['forwards']} | {r['ms']:.1f} | "
                  f"{r['longest_forward_ms']:.1f} | {r['same_first_token']} |" for r in result["prefill"]]
    if result.get("prefill_waves"):
        lines += ["", "| target | prompts | prompt tokens | one after another ms | one prefill wave ms | speedup | "
                  "served rule ms | speedup | same first tokens and experts |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['target']} | {r['prompts']} | {r['prompt_tokens']} | {r['one_after_another_ms']:.1f} | "
                  f"{r['wave_ms']:.1f} | {r['speedup']:.2f}x | {r.get('served_ms', 0):.1f} | {r.get('served_speedup', 0):.2f}x | "
                  f"{r['same']} |" for r in result["prefill_waves"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", nargs="+", default=["qwen3-8l", "gptoss-24l"])
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--block", type=int, default=8, help="verify width: anchor + drafts (fixed)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv-cache-gb", type=float, default=8.0)
    ap.add_argument("--prefill-tokens", type=int, default=0, help="also time one prompt of this many tokens, whole and chunked")
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 512], help="chunk sizes for --prefill-tokens")
    ap.add_argument("--prefill-waves", type=int, nargs="*", default=[],
                    help="also time this many prompts of --prompt-tokens prefilled one after another and in one prefill wave")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if not 1 <= args.block <= 32 or min(args.sessions) < 1:
        raise SystemExit("--block: 1..32; --sessions: counts >= 1")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # what e2e_gpu.build reads besides --layers/--tiny/--prompt-tokens: prompts and new tokens per target, its kernels
    bargs = argparse.Namespace(layers=args.layers, tiny=args.tiny, prompt_tokens=args.prompt_tokens,
                               prompts=max(args.sessions), new_tokens=args.new_tokens, kernels="auto")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"meta": {"date": time.strftime("%Y-%m-%d"), "device": str(device),
                             "prefill_graphs": device.type == "cuda" and prefill_graphs_enabled(),
                             "prefill_wave_graphs": device.type == "cuda" and prefill_wave_graphs_enabled(),
                             "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()} CPU",
                             "torch": torch.__version__, "block": args.block, "new_tokens": args.new_tokens,
                             "command": "python benchmarks/waves.py " + " ".join(argv if argv is not None else sys.argv[1:])},
                    "rows": [], "prefill": [], "prefill_waves": []}
    failed = []
    for name in args.targets:
        t = build(name, bargs, device, dtype)
        target, how = serve(t, bargs, device)
        core = VerifierCore(target, max_block_size=32, max_tokens_limit=4096,
                            paged_kv=PagedKVOptions(kv_cache_gb=args.kv_cache_gb if device.type == "cuda" else 0.0),
                            max_wave_sessions=max([*args.sessions, *(args.prefill_waves or ())]))  # (a prefill-wave graph holds that many prompts)
        refs = core_run(core, t.prompts, t.new_tokens, 1, propose=none_propose)["outputs"]
        for n in args.sessions:
            base = None
            for mode in ("one after another", "waves"):
                if mode == "waves" and n == 1:
                    continue
                decode(core, t.prompts[:n], refs, min(16, t.new_tokens), args.block, mode == "waves")  # untimed
                r = decode(core, t.prompts[:n], refs, t.new_tokens, args.block, mode == "waves")
                identical = r["outputs"] == refs[:n]
                row = {"target": t.name, "experts": how, "sessions": n, "block": args.block, "mode": mode,
                       "tok_s": r["tokens"] / r["wall_s"], "ms_per_round": r["wall_s"] * 1e3 / r["rounds"],
                       "forward_ms_per_round": r["forward_ms"] / r["rounds"], "rounds": r["rounds"],
                       "experts_summed": r["experts_summed"], "experts_union": r["experts_union"],
                       "tokens": r["tokens"], "identical": identical, "wave_forward": core.wave_forward}
                if mode == "waves" and base is not None:
                    row["speedup"] = row["tok_s"] / base["tok_s"]
                base = base or row
                result["rows"].append(row)
                if not identical:
                    failed.append(f"{t.name} S={n} {mode}")
                print(markdown(result).splitlines()[-1], flush=True)
        if args.prefill_tokens:
            result["prefill"] += prefill_rows(core, t.name, t.model.config.get_text_config().vocab_size,
                                              args.prefill_tokens, args.chunks)
            failed += [f"{t.name} prefill chunk {r['chunk']}" for r in result["prefill"] if not r["same_first_token"]]
            print(markdown(result).splitlines()[-1], flush=True)
        if args.prefill_waves:
            result["prefill_waves"] += prefill_wave_rows(core, t.name, t.model.config.get_text_config().vocab_size,
                                                         args.prompt_tokens, args.prefill_waves)
            failed += [f"{t.name} prefill wave of {r['prompts']}" for r in result["prefill_waves"] if not r["same"]]
            print(markdown(result).splitlines()[-1], flush=True)
        del core, target, t
        if device.type == "cuda":
            torch.cuda.empty_cache()
    stem = f"waves_{device_tag(device)}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    if failed:
        print(f"IDENTITY CHECK FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
