"""The verify loop without the services: VerifierCore + the n-gram drafter in one process, no RPC.

The ceiling of what the stack could reach on this machine: the same prompts as benchmarks/e2e.py,
the same core code (verifier_svc.engine.VerifierCore, drafter_svc.drafters.ngram), every round's
prefill/verify/commit called directly, next to transformers' in-process prompt-lookup decoding. The
difference to benchmarks/e2e.py's stack/ngram rows is what the three processes and their hops cost.

    python benchmarks/inprocess.py [--blocks 16 32] [--repeats 3] [--threads 0]

Prints a table and writes benchmarks/results/inprocess_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drafter_svc.drafters.ngram import NgramDrafter  # noqa: E402
from drafter_svc.width import RoundCost, VerifyWidth  # noqa: E402
from pdflash.defaults import default_target_dir  # noqa: E402
from pdflash.types import DraftResult, SamplingParams, union_bytes  # noqa: E402
from verifier_svc.engine import PrefillInput, VerifierCore  # noqa: E402
from verifier_svc.model import load_target  # noqa: E402


def ngram_propose(i: int, prompt: list[int], out: list[int], k: int, state: dict) -> list[int]:
    """The n-gram drafter as the stack's round loop drives it: the prompt, then what each verify committed."""
    d = state.get("drafter")
    if d is None:
        d = state["drafter"] = NgramDrafter()
        d.start(list(prompt))
        state["seen"] = len(prompt)
    seq = list(prompt) + out  # committed tokens, then the anchor
    d.commit(seq[state["seen"] : -1])
    state["seen"] = len(seq) - 1
    return list(d.propose(seq[-1], k))


def drafter_propose(factory) -> "callable":
    """A drafter kind of the stack (`drafter_svc.drafters`: its factory) as core_run's `propose`: one session per
    request, started on the prompt and the prefill's feature rows, given what each verify committed (anchor + accepted
    drafts, with their feature rows) before it proposes again, as the stack's round loop drives it
    (drafter_svc/loop.py). core_run asks the verifier for the factory's feature layers."""

    def propose(i: int, prompt: list[int], out: list[int], k: int, state: dict) -> list[int]:
        d = state.get("drafter")
        if d is None:
            d = state["drafter"] = factory.new_session()
            d.start(list(prompt), state["prefill"].features)
        for tokens, feats in state.pop("commits", ()):
            d.commit(tokens, feats)
        return list(d.propose(out[-1], k))

    propose.feature_layer_ids = tuple(factory.feature_layer_ids)
    return propose


def core_run(core: VerifierCore, prompts, new_tokens: int, block: int, propose=ngram_propose, on_prefill=None,
             cost_aware: bool = True) -> dict:
    """Every prompt through prefill and verify rounds of at most `block` tokens, the width adapting as in the stack.
    propose(prompt index, prompt, emitted tokens, k, per-request state) -> at most k drafts; a propose with
    `feature_layer_ids` (`drafter_propose`) gets the prefill as state["prefill"] and each verify's committed tokens
    with their feature rows in state["commits"]; state["drafter"], if any, is closed after the request. Besides the totals
    (`wall_s`, `tokens`: prefills included), the decode alone: `decode_s` (the verify rounds' wall time),
    `decode_tokens` (the tokens they emitted), `decode_cache` (their expert-cache counters summed, offloaded experts
    only), and `prefill_s`. `on_prefill()` runs after each prefill, outside both clocks. `cost_aware`: the width's cost
cap for offloaded experts (drafter_svc.width), as the stack applies it."""
    byte_map = core.target.byte_map
    tokens = rounds = routed = decode_tokens = 0
    forward_ms = prefill_s = decode_s = 0.0
    decode_cache = None
    outputs = []
    drafts_per_round: dict[int, int] = {}  # how many rounds verified k drafts
    round_log: list[tuple[int, int, float]] = []  # (drafts, accepted, round ms) of every verify round, in order
    # shared by the run's requests, as the stack shares one per drafter kind (offloaded: as the model info says, a
    # cache that cannot keep every expert)
    cache = getattr(core.target, "expert_cache", None)
    cost = RoundCost(offloaded=cache is not None and cache.kept_bytes < cache.store.total_bytes)
    t0 = time.perf_counter()
    layers = tuple(getattr(propose, "feature_layer_ids", ()))
    for i, p in enumerate(prompts):
        ta = time.perf_counter()
        pre = core.prefill(PrefillInput("bench", tuple(p), SamplingParams(), new_tokens, ignore_eos=True,
                                        feature_layer_ids=layers))
        prefill_s += time.perf_counter() - ta
        if on_prefill is not None:
            on_prefill()
        tb = time.perf_counter()
        width = VerifyWidth(block, cost_aware=cost_aware, cost=cost)
        state: dict = {"prefill": pre}
        out, anchor, union, rnd = list(pre.tokens), pre.tokens[-1], pre.routed_union, 0
        committed = pre.committed
        while pre.finished is None:
            rnd += 1
            k = max(0, min(width.drafts(), new_tokens - len(out) - 1))
            tr = time.perf_counter()
            drafts = propose(i, p, out, k, state) if k else []
            drafts_per_round[len(drafts)] = drafts_per_round.get(len(drafts), 0) + 1
            res = core.verify(DraftResult(pre.session_id, rnd, (anchor, *drafts), union, union_bytes(union, byte_map)))
            round_ms = (time.perf_counter() - tr) * 1e3
            width.observe(res.num_accepted, len(drafts), round_ms, res.expert_cache is not None)
            round_log.append((len(drafts), res.num_accepted, round(round_ms, 3)))
            if layers:  # what entered the target's KV (anchor + accepted drafts) and its feature rows
                state.setdefault("commits", []).append(([anchor, *drafts][: res.committed - committed], res.features))
            committed = res.committed
            out += res.tokens
            decode_tokens += len(res.tokens)
            if res.expert_cache is not None:
                decode_cache = res.expert_cache if decode_cache is None else decode_cache.plus(res.expert_cache)
            forward_ms += res.forward_ms
            routed += res.routed_bytes
            if res.finished is not None or not res.tokens:  # done (a session at its context limit may emit nothing)
                break
            anchor, union = res.tokens[-1], res.routed_union
        decode_s += time.perf_counter() - tb
        if state.get("drafter") is not None:
            state["drafter"].close()
        rounds += rnd
        tokens += len(out)
        outputs.append(out)
    wall = time.perf_counter() - t0
    return dict(tok_per_s=tokens / wall, rounds=rounds, tokens=tokens, outputs=outputs, wall_s=wall,
                forward_ms=forward_ms, routed_bytes=routed, prefill_s=prefill_s, decode_s=decode_s,
                decode_tokens=decode_tokens, decode_cache=decode_cache, drafts_per_round=dict(sorted(drafts_per_round.items())),
                round_log=round_log)


def hf_run(model, prompts, new_tokens: int) -> dict:
    tokens = 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 prompt_lookup_num_tokens=10)
            tokens += out.shape[1] - len(p)
    return dict(tok_per_s=tokens / (time.perf_counter() - t0), tokens=tokens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--prompt-file", default=str(ROOT / "benchmarks" / "prompts_heldout.json"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "inprocess_cpu.json"))
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model or str(default_target_dir())
    prompts = json.loads(pathlib.Path(args.prompt_file).read_text())
    core = VerifierCore(load_target(model_dir, "cpu"), max_block_size=max(args.blocks))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    core_run(core, prompts[:1], 8, 4)  # warm-up
    hf_run(hf, prompts[:1], 8)
    passes: dict[str, list[float]] = {}
    rounds: dict[str, int] = {}
    for _ in range(args.repeats):  # modes alternate within a pass: drift hits them alike
        for b in args.blocks:
            r = core_run(core, prompts, args.new_tokens, b)
            passes.setdefault(f"core/ngram@{b}", []).append(r["tok_per_s"])
            rounds[f"core/ngram@{b}"] = r["rounds"]
        passes.setdefault("hf/prompt_lookup", []).append(hf_run(hf, prompts, args.new_tokens)["tok_per_s"])
    pl = statistics.median(passes["hf/prompt_lookup"])
    rows = {k: dict(tok_per_s=round(statistics.median(v), 2), passes=[round(x, 2) for x in v],
                    vs_hf_prompt_lookup=round(statistics.median(v) / pl, 2), rounds=rounds.get(k)) for k, v in passes.items()}
    meta = dict(date=time.strftime("%Y-%m-%d"), prompts=len(prompts), new_tokens=args.new_tokens, repeats=args.repeats,
                machine=f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
                command="python benchmarks/inprocess.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"# in-process verify loop ({meta['machine']}; median of {args.repeats})\n")
    print("| mode | tok/s | vs HF prompt-lookup | rounds |\n|---|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {r['tok_per_s']} | {r['vs_hf_prompt_lookup']}x | {r['rounds'] or ''} |")
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
