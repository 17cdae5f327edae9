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
        result = json.loads((out / "offload_h200.json").read_text())
        rows = [r for r in result["rows"] if r["system"] == "OURS"]
        assert rows and all(r["identical"] and r["layer_scale"] == scale for r in rows)
        assert result["meta"]["layer_scale"] == scale
        cos[scale] = result["meta"]["hidden_cos"]["tiny-gpt-oss"]
        md = (out / "offload_h200.md").read_text()
        assert ("tiny-gpt-oss (outputs x0.05)" in md) == (scale != 1.0) and "hidden-state cosine" in md
    assert cos[0.05] > cos[1.0]
    with pytest.raises(SystemExit):
        main(["--models", "tiny-gpt-oss", "--device", "cpu", "--layer-scale", "0", "--out", str(tmp_path / "bad")])
