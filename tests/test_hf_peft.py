"""`export --format peft` (models/hf_peft.py) against PEFT itself (the parity tier: torch, transformers
and peft; skipped with the reason without them): a LoRA model's adapter, loaded by
`PeftModel.from_pretrained` onto the transformers export of its base, computes the logits of our
merged export (W + (alpha/rank)·A·B) within a float32 bound; PEFT reads r, lora_alpha and the
targets we wrote and scales by alpha/rank as we do. GPT-2 (Conv1D projections, a fused qkv in
GPT-2's column order) and Llama (separate projections, torch Linear layouts).
"""

from __future__ import annotations

import json

import equinox as eqx
import jax
import numpy as np
import pytest
from helpers import compose_config, docs_command, hf_logits, load_script, perturbed, sum_atol

import models
from models import hf, hf_peft, lora

REASON = "parity tier: pip install -e '.[dev,parity]'"
torch = pytest.importorskip("torch", reason=REASON)
transformers = pytest.importorskip("transformers", reason=REASON)
peft = pytest.importorskip("peft", reason=REASON)

RANK, ALPHA = 4, 6.0  # scale 1.5: a convention that put alpha/rank anywhere else would change the logits
CASES = {
    "gpt2": ({"name": "gpt", "dim": 16, "num_heads": 2}, ["attn_qkv", "mlp_out"]),
    "llama": ({"name": "llama", "dim": 16, "num_heads": 2, "num_kv_heads": 1, "mlp_hidden": 32},
              ["q_proj", "v_proj", "o_proj", "down_proj"]),
}
TOKENS_BxT = np.random.default_rng(0).integers(0, 64, (2, 8))


def lora_model(case: str):
    """A tiny LoRA model of `case`, every array (factors too: B is not zero) moved by 0.2·N(0, 1)."""
    fields, targets = CASES[case]
    cfg = models.config_from_dict({**fields, "num_blocks": 2, "context_length": 8, "vocab_size": 64,
                                   "lora": {"rank": RANK, "alpha": ALPHA, "targets": targets}})
    return perturbed(eqx.filter_jit(models.build)(cfg, jax.random.PRNGKey(0)))


def base_of(model):
    """The frozen base alone: the factors zeroed, then merged (W + 0, exactly W) into a plain model."""
    zeroed = jax.tree_util.tree_map_with_path(lambda p, x: np.zeros_like(x) if lora.is_factor(p) else x, model)
    return lora.merge(zeroed)


def load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def two_program_atol(model, logits, margin: float = 4) -> float:
    """atol of float32 logits from PEFT's x·W + s·(x·A)·B against the merged x·(W + s·A·B), whose
    weight is rounded once more: per block, the longest sums feeding a logit are the MLP's (its
    hidden width, or dim·mlp_ratio) and the branch's (in + rank terms, and the add), the merged weight's
    rounding one more term; counted as one sum of that many terms per block and the head's, at the
    logits' scale (helpers.logits_atol's reasoning; sum_atol's worst case). Margin 4: two sides, times 2."""
    cfg = model.cfg
    hidden = getattr(cfg, "mlp_hidden", None) or cfg.dim * getattr(cfg, "mlp_ratio", 4)
    n = (max(hidden, cfg.dim) + RANK + 3) * (cfg.num_blocks + 1)
    return sum_atol(n, float(np.abs(logits).max()), margin)


@pytest.mark.parametrize("case", list(CASES))
def test_peft_loads_the_adapter_onto_the_base_with_the_merged_logits(tmp_path, case):
    model = lora_model(case)
    hf.save_hf(str(tmp_path / "base"), base_of(model))
    hf.save_hf(str(tmp_path / "merged"), lora.merge(model))
    written = hf_peft.save_peft(str(tmp_path / "adapter"), model, str(tmp_path / "base"))
    assert sorted(written) == sorted(p.name for p in (tmp_path / "adapter").iterdir())

    config = peft.PeftConfig.from_pretrained(tmp_path / "adapter")
    hf_targets = {"gpt2": {"attn.c_attn", "mlp.c_proj"},
                  "llama": {"self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"}}[case]
    assert (config.peft_type, config.task_type, config.r, config.lora_alpha) == ("LORA", "CAUSAL_LM", RANK, ALPHA)
    assert set(config.target_modules) == hf_targets and config.base_model_name_or_path == str(tmp_path / "base")

    adapted = peft.PeftModel.from_pretrained(load(tmp_path / "base"), tmp_path / "adapter").eval()
    layers = [m for m in adapted.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(layers) == len(hf_targets) * model.cfg.num_blocks  # every target in every block, no more
    assert all(m.scaling["default"] == ALPHA / RANK for m in layers)  # PEFT's lora_alpha / r, ours alpha/rank
    got = hf_logits(adapted, TOKENS_BxT)
    want = hf_logits(load(tmp_path / "merged"), TOKENS_BxT)
    # float32: per block the MLP's or the branch's sum (hidden + rank + 3 terms) at the logits' scale, EPS32/2 per
    # rounding (sum_atol's worst case), the merged weight's extra rounding one term; both sides, margin 4
    np.testing.assert_allclose(got, want, rtol=0, atol=two_program_atol(model, want))
    # the factors matter: the base alone is far from the merged model (a silently skipped adapter fails)
    assert np.abs(hf_logits(load(tmp_path / "base"), TOKENS_BxT) - want).max() > 100 * two_program_atol(model, want)


def test_bfloat16_adapter_holds_bfloat16_factors(tmp_path):
    model = lora_model("llama")
    hf_peft.save_peft(str(tmp_path / "adapter"), model, None, "bfloat16")
    from safetensors import safe_open

    with safe_open(tmp_path / "adapter" / hf_peft.WEIGHTS_FILE, "pt") as f:
        keys = list(f.keys())
        assert {f.get_tensor(k).dtype for k in keys} == {torch.bfloat16}
    assert all(k.startswith("base_model.model.model.layers.") for k in keys)
    assert len(keys) == 2 * 4 * model.cfg.num_blocks  # A and B, 4 targets, each block
    assert json.loads((tmp_path / "adapter" / hf_peft.CONFIG_FILE).read_text())["base_model_name_or_path"] is None


def test_an_adapter_for_a_random_base_or_a_bidirectional_model_is_refused_in_one_line(tmp_path):
    from types import SimpleNamespace

    from trainer import inference
    from utils.errors import CheckpointError

    run = lambda init_from, objective: SimpleNamespace(model=SimpleNamespace(init_from=init_from),
                                                       objective=SimpleNamespace(name=objective))
    with pytest.raises(CheckpointError, match=r"^--format peft: this LoRA run's base is random \(no model.init_from\)"
                                              r".*: export --merge-lora --format hf instead$"):
        inference.export_peft(str(tmp_path / "out"), run(None, "ar"), lora_model("llama"), "float32")
    with pytest.raises(CheckpointError, match=r"^--format peft: this model was trained with objective=mdlm"):
        inference.export_peft(str(tmp_path / "out"), run(str(tmp_path), "mdlm"), lora_model("llama"), "float32")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_lora_fine_tune_exports_an_adapter_for_its_base(tmp_path, monkeypatch):
    """model.init_from=<a bfloat16 llama directory> + model.lora -> 3 steps -> checkpoint -> export
    --format peft: bfloat16 by default (the base's dtype, recorded by the run), and with --dtype float32
    PEFT on the base directory computes the logits of the --merge-lora --format hf export."""
    from pathlib import Path

    import train_jax

    monkeypatch.chdir(tmp_path)
    lines = [line for f in sorted((Path(hf.__file__).parent).glob("*.py")) for line in f.read_text().splitlines()
             if line.strip()]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": "\n".join(lines[i: i + 8])}) + "\n"
                                                   for i in range(0, len(lines), 8)))
    cfg = models.config_from_dict({"name": "llama", "dim": 16, "num_heads": 2, "num_kv_heads": 1, "mlp_hidden": 32,
                                   "num_blocks": 2, "context_length": 32, "vocab_size": 320})
    hf.save_hf(str(tmp_path / "base"), eqx.filter_jit(models.build)(cfg, jax.random.PRNGKey(0)), dtype="bfloat16")
    (tmp_path / "run").mkdir()
    train_jax.train(compose_config(
        "model=llama_tiny", "model.init_from=base", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}",
        "train.max_steps=3", "checkpoint.save=true", "checkpoint.save_path=ckpt/lora1", "train.skip_validation=true",
        "model.remat=none", "model.scan_blocks=false", "optimizer=sgdm", "optimizer/lr_config=constant",
        "dataset=text_files", "dataset.val_fraction=0.2", "dataset.paths=[corpus.jsonl]",
        "dataset.context_length=16", "tokenizer=byte"), str(tmp_path / "run"))
    export = load_script("export_model")
    argv = docs_command("models.md", "python scripts/export_model.py ckpt/lora1 --format peft")  # as typed
    assert export.main(argv) == 0
    adapter = tmp_path / argv[argv.index("--out") + 1]
    from safetensors import safe_open

    with safe_open(adapter / hf_peft.WEIGHTS_FILE, "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # the base's dtype
        assert any(f.get_tensor(k).abs().max() > 0 for k in f.keys() if "lora_B" in k)  # B trained away from 0
    assert export.main(["ckpt/lora1", "--format", "peft", "--dtype", "float32", "--out", "adapter32"]) == 0
    assert export.main(["ckpt/lora1", "--merge-lora", "--format", "hf", "--dtype", "float32", "--out", "merged"]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32,
                                                             attn_implementation="eager")  # bf16 -> f32: exact
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter32").eval()
    tokens = TOKENS_BxT % 257
    want = hf_logits(load(tmp_path / "merged"), tokens)
    trained = export_model_of(tmp_path / "merged")
    np.testing.assert_allclose(hf_logits(adapted, tokens), want, rtol=0, atol=two_program_atol(trained, want))


def export_model_of(path):
    """The model (its cfg is what two_program_atol reads) of a --format hf export."""
    return hf.load_hf(str(path), models.config_from_dict({"name": "llama", "dim": 16, "num_heads": 2,
                                                          "num_blocks": 2, "context_length": 32}))[1]
