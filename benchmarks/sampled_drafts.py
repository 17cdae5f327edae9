"""Sampled requests: drafts accepted a round with the DFlash drafter's drafts drawn from q (the request's warpers on the
drafter's logits, sent with q: speculative sampling) against its argmax drafts, for several numbers of drawn positions
(`SAMPLED_POSITIONS`: the first N drafts of a block drawn, the rest the argmax). In process, no gRPC: the verifier core
and the drafter as the round loop drives them, on the embedded demo pair (CPU, float32) or a given pair.

    python benchmarks/sampled_drafts.py                       # 90 seeded requests per case, ~8 minutes on 2 cores
    python benchmarks/sampled_drafts.py --positions 0,16,1,2,3 --seeds 90 --out benchmarks/results

`--positions 0` is the argmax drafts (the drafter told the request is greedy); the verifier samples either way, so every
case emits the target's distribution. Prints a table; writes sampled_drafts.json under --out.

    python benchmarks/sampled_drafts.py --repetition-penalty 1.3   # greedy penalized requests instead

runs greedy requests with that repetition penalty, the drafter drafting under it (`penalized`) or told nothing of it
(`plain`); the output is the same, the drafts accepted a round differ. Writes penalized_drafts.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [dict(temperature=1.0), dict(temperature=1.0, top_k=3), dict(temperature=0.7, top_p=0.9)]


def run(core, factory, prompt: list[int], sp: dict, positions: int, seeds: int, new: int, drafts: int,
        drafter_told: bool | None = None) -> dict:
    """`drafter_told`: whether the drafter gets the request's sampling (default: when positions > 0)."""
    import drafter_svc.drafters.dflash as dflash
    from pdflash.types import DraftResult, SamplingParams, union_bytes
    from verifier_svc.engine import PrefillInput

    dflash.SAMPLED_POSITIONS = positions
    accepted = rounds = 0
    t0 = time.perf_counter()
    for seed in range(seeds):
        s = SamplingParams(seed=seed, **sp)
        pre = core.prefill(PrefillInput(f"r{seed}", tuple(prompt), s, new, ignore_eos=True,
                                        feature_layer_ids=tuple(factory.feature_layer_ids)))
        told = positions > 0 if drafter_told is None else drafter_told
        d = factory.new_session(s if told else SamplingParams())  # positions 0: argmax drafts
        d.start(list(prompt), pre.features)
        anchor, union, finished, rnd = pre.tokens[-1], pre.routed_union, pre.finished, 0
        while finished is None:
            rnd += 1
            proposal = d.propose(anchor, drafts)
            res = core.verify(DraftResult(pre.session_id, rnd, (anchor, *proposal), union,
                                          union_bytes(union, core.target.byte_map), tuple(getattr(proposal, "dists", ()))))
            accepted, rounds = accepted + res.num_accepted, rounds + 1
            if res.finished is None:
                d.commit([anchor, *res.tokens[: res.num_accepted]], res.features)
            anchor, union, finished = res.tokens[-1], res.routed_union, res.finished
        d.close()
    return {"sampling": sp, "positions": positions, "drafter_told": told, "seeds": seeds, "rounds": rounds,
            "accepted_per_round": accepted / rounds, "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="target checkpoint (default: the embedded demo target)")
    ap.add_argument("--drafter", help="DFlash drafter checkpoint (default: the embedded demo drafter)")
    ap.add_argument("--positions", default="0,2", help="drawn positions per case, comma-separated (0 = argmax drafts)")
    ap.add_argument("--seeds", type=int, default=90)
    ap.add_argument("--new", type=int, default=40, help="tokens per request")
    ap.add_argument("--drafts", type=int, default=7, help="drafts per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repetition-penalty", type=float, default=None,
                    help="greedy requests with this penalty, drafts under it or not (instead of the sampled cases)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import torch

    from drafter_svc.drafters import make_factory
    from pdflash.defaults import default_drafter_dir, default_target_dir
    from verifier_svc.engine import VerifierCore
    from verifier_svc.model import load_target

    torch.set_num_threads(a.threads)
    target = pathlib.Path(a.target or default_target_dir())
    drafter = pathlib.Path(a.drafter or default_drafter_dir())
    core = VerifierCore(load_target(target, "cpu", "float32"), max_block_size=a.drafts + 1)
    factory = make_factory("dflash", target, drafter)
    prompt = json.loads((ROOT / "benchmarks" / "prompts_heldout.json").read_text())[0][:40]
    if a.repetition_penalty is not None:  # greedy: the seed changes nothing, one request per prompt instead
        prompts = [p[:40] for p in json.loads((ROOT / "benchmarks" / "prompts_heldout.json").read_text())[:4]]
        sp = {"repetition_penalty": a.repetition_penalty}
        rows = []
        for told in (False, True):
            parts = [run(core, factory, p, sp, 0, 1, a.new, a.drafts, told) for p in prompts]
            rounds = sum(r["rounds"] for r in parts)
            rows.append({"sampling": sp, "drafter_told": told, "prompts": len(prompts), "rounds": rounds,
                         "accepted_per_round": sum(r["accepted_per_round"] * r["rounds"] for r in parts) / rounds})
        name = "penalized_drafts.json"
        print("| sampling | drafts | rounds | drafts accepted / round |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['sampling']} | {'penalized' if r['drafter_told'] else 'plain'} | {r['rounds']} | {r['accepted_per_round']:.2f} |")
    else:
        rows = [run(core, factory, prompt, sp, int(n), a.seeds, a.new, a.drafts) for sp in CASES for n in a.positions.split(",")]
        name = "sampled_drafts.json"
        print("| sampling | drawn positions | rounds | drafts accepted / round |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['sampling']} | {r['positions'] or 'argmax'} | {r['rounds']} | {r['accepted_per_round']:.2f} |")
    if a.out:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps({"target": str(target), "drafter": str(drafter), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
