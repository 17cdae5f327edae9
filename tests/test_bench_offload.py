"""benchmarks/offload.py on the CPU (`--device cpu`, the tiny gpt-oss target): the rows come out identical to the
100% cache's, and `--layer-scale` builds a model whose layers move the residual stream less (its hidden-state cosine
is higher), labelled in the JSON and the table."""

from __future__ import annotations

import json

import pytest


def test_layer_scale_keeps_consecutive_hidden_states_closer_and_says_so(tmp_path):
    from benchmarks.offload import main

    cos = {}
    for scale in (1.0, 0.05):
        out = tmp_path / str(scale)
        assert main(["--models", "tiny-gpt-oss", "--device", "cpu", "--caches", "0.5", "--new-tokens", "8", "--prompts", "1",
                     "--modes", "host", "--layer-scale", str(scale), "--out", str(out)]) == 0
        result = json.loads((out / "offload_cpu.json").read_text())  # (named for the device that ran it)
        rows = [r for r in result["rows"] if r["system"] == "OURS"]
        assert rows and all(r["identical"] and r["layer_scale"] == scale for r in rows)
        assert result["meta"]["layer_scale"] == scale
        cos[scale] = result["meta"]["hidden_cos"]["tiny-gpt-oss"]
        md = (out / "offload_cpu.md").read_text()
        assert ("tiny-gpt-oss (outputs x0.05)" in md) == (scale != 1.0) and "hidden-state cosine" in md
    assert cos[0.05] > cos[1.0]
    with pytest.raises(SystemExit):
        main(["--models", "tiny-gpt-oss", "--device", "cpu", "--layer-scale", "0", "--out", str(tmp_path / "bad")])


def test_guess_layers_measures_each_layer_guess_against_the_layers_own_routing():
    """benchmarks/guess_layers.py `study` on the tiny qwen3_moe target (CPU): one row per guessed layer; a guess as wide
    as the router's experts holds all of its routed experts (coverage 1) and its precision is then top_k / experts;
    every share is in [0, 1]."""
    import torch

    import benchmarks.offload as ob
    from benchmarks.guess_layers import study

    old = ob.DEVICE
    ob.DEVICE = torch.device("cpu")
    try:
        model = ob.build("tiny:qwen3_moe", 3, 0.1)
    finally:
        ob.DEVICE = old
    rows = study(model, ob.prompts_for(1, model.config.vocab_size)[0][:40])
    assert [r["layer"] for r in rows] == [1, 2]
    e, k = model.config.num_experts, model.config.num_experts_per_tok
    for r in rows:
        assert r["top_k"] == k and -1.0 <= r["input_cos"] <= 1.0 and 0.0 <= r["prev_token_overlap"] <= 1.0
        if e in r["by_width"]:
            assert r["by_width"][e] == [round(k / e, 3), 1.0]
        assert all(0.0 <= p <= 1.0 and 0.0 <= c <= 1.0 for p, c in r["by_width"].values())
        for back, share in r["new_share"].items():  # the experts new to a token, and the guess's copies
            if e in r["by_width"] and share > 0:
                assert r["copies"][back][f"top{e}"][2] == 1.0  # every expert guessed: every new one held
            for name, (copies, precision, held) in r["copies"][back].items():
                width = int(name.removeprefix("top").removeprefix("skip"))
                assert 0.0 <= copies <= width and 0.0 <= precision <= 1.0 and 0.0 <= held <= 1.0
                if name.startswith("skip") and width <= e - k * back:
                    assert copies == width  # enough unseen experts: each guessed one is a copy


def test_guess_layers_seen_experts_are_the_ones_earlier_tokens_routed():
    import torch

    from benchmarks.guess_layers import _seen

    true = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3]])
    assert (~_seen(true, 1, 4).gather(1, true)).tolist() == [[True, True], [False, True], [True, True], [True, False]]
    assert (~_seen(true, 2, 4).gather(1, true)).tolist() == [[True, True], [False, True], [True, False], [False, False]]
    assert _seen(true, 1, 4).tolist() == [[False] * 4, [True, True, False, False], [False, True, True, False],
                                          [True, False, False, True]]


def test_merge_joins_runs_into_one_table_and_refuses_mixed_settings(tmp_path):
    """`--merge`: stop 37's three device runs give back the committed table, row for row (each run's repeated 100% rows
    once); runs made with other prompt counts are refused."""
    import pathlib

    from benchmarks.offload import ROW_KEY, main

    res = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    runs = [res / "stop37_gpu" / c / "offload_h200.json" for c in ("call3", "call5/g", "call5/q")]
    assert main(["--merge", *map(str, runs), "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "offload_h200.json").read_text())
    want = json.loads((res / "offload_h200.json").read_text())
    key = lambda r: tuple(r.get(k) for k in ROW_KEY)  # noqa: E731
    assert [key(r) for r in got["rows"]] == [key(r) for r in want["rows"]]
    assert got["rows"] == want["rows"]
    assert len({key(r) for r in got["rows"]}) == len(got["rows"]) == 25
    assert got["meta"]["pinned_h2d_bytes_per_s"].keys() == {"gpt-oss-24l", "qwen3-48l"}
    assert got["meta"]["command"].count("python benchmarks/offload.py") == 3
    assert "| qwen3-48l | OURS device | 10% |" in (tmp_path / "offload_h200.md").read_text()
    other = json.loads(runs[0].read_text())
    other["meta"]["prompts"] = 3
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="prompts"):
        main(["--merge", str(runs[1]), str(tmp_path / "other.json"), "--out", str(tmp_path / "bad")])
