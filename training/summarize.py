"""Merge a run's metrics files into RUN/metrics.json and print the headline numbers.

    python -m training.summarize runs/demo
"""

from __future__ import annotations

import json
import pathlib
import sys

from training.common import write_json


def _load(path: pathlib.Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def summarize(run: pathlib.Path) -> dict:
    target = _load(run / "target" / "metrics_target.json")
    drafter = _load(run / "drafter" / "metrics_drafter.json")
    ev = _load(run / "metrics_eval.json") or _load(run / "metrics_ngram.json")
    out: dict = {"target": target, "drafter": drafter, "eval": ev}
    head = {}
    if target:
        head["target_heldout_ppl"] = round(target["heldout_ppl"], 3)
        head["target_train_seconds"] = target["train_seconds"]
    if drafter:
        head["drafter_train_seconds"] = drafter["train_seconds"]
        head["drafter_steps"] = drafter["steps"]
    if ev:
        for set_name, res in ev["results"].items():
            head[set_name] = {k: round(v["tau"], 3) for k, v in res.items() if isinstance(v, dict) and "tau" in v}
    out["headline"] = head
    return out


def main() -> None:
    run = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "runs/demo")
    out = summarize(run)
    write_json(run / "metrics.json", out)
    print(json.dumps(out["headline"], indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
