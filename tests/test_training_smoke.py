"""Smoke run of the whole training pipeline at toy sizes on the CPU: tokenizer, target, rollouts, DFlash
drafter, acceptance eval (simulated and real loop must agree), and the outputs load with plain
transformers and drafter_svc.dflash_model.load_dflash."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from training import eval_acceptance, rollouts, tokenizer, train_dflash, train_target  # noqa: E402

TINY_TARGET = ["--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--experts", "4",
               "--moe-intermediate", "32", "--seq-len", "64", "--batch", "4", "--epochs", "0.15", "--evals", "2",
               "--warmup", "2", "--max-files", "6", "--max-eval-windows", "8", "--device", "cpu"]


@pytest.mark.timeout(180)
def test_training_pipeline_smoke(tmp_path):
    torch.set_num_threads(2)
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    tokenizer.main(["--out", str(target_dir), "--vocab-size", "320", "--max-files", "6"])
    m_target = train_target.main(["--dir", str(target_dir), *TINY_TARGET])
    assert m_target["steps"] >= 2 and m_target["heldout_ppl"] > 1

    rollouts.main(["--target", str(target_dir), "--out", str(tmp_path / "r.npy"), "--count", "4",
                   "--prompt-lens", "16", "--seq-len", "48", "--max-files", "3", "--device", "cpu"])
    m_drafter = train_dflash.main([
        "--target", str(target_dir), "--rollouts", str(tmp_path / "r.npy"), "--out", str(drafter_dir),
        "--layers", "1", "--intermediate", "64", "--target-layers", "0,1", "--block", "4", "--anchors", "4",
        "--seq-len", "48", "--batch", "4", "--steps", "4", "--warmup", "1", "--max-files", "6", "--device", "cpu"])
    assert m_drafter["steps"] == 4

    common = ["--target", str(target_dir), "--drafter", str(drafter_dir), "--prompts", "2", "--prompt-len", "16",
              "--new-tokens", "12", "--blocks", "4", "--max-files", "3", "--device", "cpu"]
    sim = eval_acceptance.main([*common, "--out", str(tmp_path / "sim.json")])
    loop = eval_acceptance.main([*common, "--mode", "loop"])
    for set_name, res in sim["results"].items():
        for key in ("dflash@4", "ngram@4", "hybrid@4"):
            assert 1.0 <= res[key]["tau"] <= 4.0
            # The replayed rounds must be the real loop's rounds, and the real loop must be lossless.
            assert loop["results"][set_name][key]["tau"] == pytest.approx(res[key]["tau"])
            assert loop["results"][set_name][key]["lossless"] == 1.0
    assert json.loads((tmp_path / "sim.json").read_text())["mode"] == "sim"

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafter_svc.dflash_model import load_dflash

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    assert model.config.model_type == "qwen3_moe"
    assert model.generation_config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    ids = tok("def f(x):\n", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] >= ids.shape[1] + 1
    drafter = load_dflash(str(drafter_dir))
    assert drafter.spec.mask_token_id == tok.convert_tokens_to_ids("<|mask|>")
    assert drafter.spec.block_size == 4 and drafter.spec.target_layer_ids == [0, 1]


DEMO = REPO / "pdflash" / "assets" / "demo"


def test_shipped_demo_pair_loads():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafter_svc.dflash_model import load_dflash

    tok = AutoTokenizer.from_pretrained(str(DEMO / "target"))
    model = AutoModelForCausalLM.from_pretrained(str(DEMO / "target"), dtype=torch.float32)
    assert model.config.model_type == "qwen3_moe" and model.config.num_local_experts == 8
    assert len(tok) == model.config.vocab_size == 4096
    assert model.generation_config.eos_token_id == tok.eos_token_id == 0
    ids = tok("def main():\n    ", return_tensors="pt")["input_ids"]
    text = tok.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:])
    assert text.strip(), "greedy decoding produced only whitespace"
    drafter = load_dflash(str(DEMO / "drafter"))
    assert drafter.spec.mask_token_id == tok.convert_tokens_to_ids("<|mask|>") == 1
    assert drafter.spec.block_size == 16 and drafter.spec.target_layer_ids == [1, 3, 5]
    assert drafter.config.hidden_size == model.config.hidden_size
    total = sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file())
    assert total < 40e6
