"""`model.init_from` and the Hugging Face directory layer on bad input, and the config boundary's
part of a good one: every failure is one line naming the knob or file and the fix, raised by
`validate` (before anything compiles) or by the export before any file is written. No torch: the
directories are written by our own save_hf (safetensors + JSON), edited where a test needs a fault.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import compose_config

import models
from models import hf, hf_moe, llama
from trainer.inference import export_hf
from utils.config import validate
from utils.errors import CheckpointError, ConfigError

GPT = {"name": "gpt", "dim": 32, "num_heads": 4, "num_blocks": 2, "context_length": 32, "vocab_size": 64}


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.fixture
def gpt_dir(tmp_path, monkeypatch) -> Path:
    """tmp/pretrained: a gpt2 directory of a random tiny GPT (dim 32, context 32); cwd = tmp."""
    model = models.build(models.config_from_dict(GPT), jax.random.PRNGKey(0))
    hf.save_hf(str(tmp_path / "pretrained"), model)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "pretrained"


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / hf.CONFIG_FILE).read_text())
    (path / hf.CONFIG_FILE).write_text(json.dumps({**config, **changes}))


def run_with(*overrides: str):
    return validate(compose_config(*overrides))


def test_init_from_takes_the_directory_shapes_by_a_relative_path(gpt_dir):
    run = run_with("model.init_from=pretrained", "model.dim=64", "model.num_blocks=3", "model.dropout=0.1")
    m = run.model
    assert m.init_from == str(gpt_dir)  # resolved against the working directory, as typed
    assert (m.dim, m.num_heads, m.num_blocks, m.context_length, m.vocab_size) == (32, 4, 2, 32, 64)
    assert m.dropout == 0.1  # an execution knob: the run's own
    note = next(w for w in run.warnings if "model.init_from=pretrained" in w)
    assert "model.dim 64 -> 32" in note and "model.num_blocks 3 -> 2" in note
    assert run.tokenizer.name != "hf"  # the directory holds no tokenizer: the run keeps its own


def test_init_from_weights_are_the_files(gpt_dir):
    """models.build with init_from: the directory's arrays (read by callback), eager and under jit."""
    cfg = run_with("model.init_from=pretrained").model
    _, want = hf.load_hf(str(gpt_dir), cfg)
    for got in (models.build(cfg, jax.random.PRNGKey(0)), jax.jit(lambda: models.build(cfg, jax.random.PRNGKey(0)))()):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert models.abstract(cfg).wte_VxD.shape == (64, 32)


def test_unsupported_model_type(gpt_dir):
    edit_config(gpt_dir, model_type="bert")
    with pytest.raises(ConfigError) as e:
        run_with("model.init_from=pretrained")
    assert "model.init_from=pretrained" in one_line(e) and 'model_type="bert"' in str(e.value)
    assert "supported model types are gpt2" in str(e.value)


def test_missing_directory_and_files(gpt_dir):
    with pytest.raises(ConfigError, match=r"model.init_from=nowhere: .*nowhere is not a directory"):
        run_with("model.init_from=nowhere")
    (gpt_dir / hf.WEIGHTS_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"holds neither model.safetensors nor model.safetensors.index.json"):
        run_with("model.init_from=pretrained")
    (gpt_dir / hf.CONFIG_FILE).unlink()
    with pytest.raises(ConfigError, match=r"config.json is missing"):
        run_with("model.init_from=pretrained")


def test_shape_mismatch_names_the_tensor(gpt_dir):
    edit_config(gpt_dir, n_positions=48)  # the weights hold 32 positions
    with pytest.raises(CheckpointError) as e:
        run_with("model.init_from=pretrained")
    assert "transformer.wpe.weight has shape (32, 32), config.json says (48, 32)" in one_line(e)


def test_a_config_json_key_we_cannot_represent(gpt_dir):
    edit_config(gpt_dir, activation_function="relu")
    with pytest.raises(ConfigError) as e:
        run_with("model.init_from=pretrained")
    assert 'activation_function="relu"' in one_line(e)


def test_family_mismatch_names_the_right_model_configs(gpt_dir):
    with pytest.raises(ConfigError) as e:
        run_with("model=llama_tiny", "model.init_from=pretrained")
    assert "holds a gpt model" in one_line(e) and "model=gpt2_124m or" in str(e.value)
    assert "model=gpt_tiny" in str(e.value)


def test_moe_cannot_start_from_a_directory(gpt_dir):
    with pytest.raises(ConfigError, match=r"model.moe.num_experts=2: a run cannot start its MoE blocks"):
        run_with("model.init_from=pretrained", "model.moe.num_experts=2")


@pytest.mark.parametrize("file,content,message", [
    ("config.json", {"eos_token_id": "2"}, r"config.json has eos_token_id=\"2\": a token id is an integer, a list of "
                                           r"integers or null; fix the file"),
    ("config.json", {"bos_token_id": [1]}, r"config.json has bos_token_id=\[1\]: a token id is an integer or null"),
    ("generation_config.json", {"eos_token_id": [0, True]}, r"generation_config.json has eos_token_id=\[0, true\]"),
    ("generation_config.json", [1], r"generation_config.json holds list, not a JSON object: save the model again"),
    ("generation_config.json", "{", r"generation_config.json cannot be read as JSON \(.*\): save the model again"),
], ids=["eos_string", "bos_list", "eos_bool", "not_object", "not_json"])
def test_bad_generation_metadata_is_one_line(gpt_dir, file, content, message):
    """The base's special ids and generation_config.json, carried to the export, are checked at the boundary."""
    if file == "config.json":
        edit_config(gpt_dir, **content)
    else:
        (gpt_dir / file).write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigError, match=r"^model.init_from=pretrained: .*" + message) as e:
        run_with("model.init_from=pretrained")
    one_line(e)


def test_the_directory_tokenizer_becomes_the_runs(gpt_dir):
    from loaders.tokenizers import BPETokenizer
    from loaders.tokenizers.bpe import _train_bpe

    bpe = BPETokenizer(_train_bpe(260, ["def f(x):\n    return x\n"] * 4), "bpe-260")
    assert hf.save_tokenizer(str(gpt_dir), bpe)
    run = run_with("model.init_from=pretrained", "tokenizer=bpe")
    assert (run.tokenizer.name, run.tokenizer.name_or_path) == ("hf", str(gpt_dir))
    assert any("tokenizer=bpe replaced" in w for w in run.warnings)


def test_export_refusals_write_nothing(tmp_path, tiny_run):
    no_bias = models.build(models.config_from_dict({**GPT, "bias": False}), jax.random.PRNGKey(0))
    with pytest.raises(ConfigError, match=r"model.bias=false cannot be exported as gpt2"):
        hf.save_hf(str(tmp_path / "a"), no_bias)
    assert not (tmp_path / "a").exists()
    model = models.build(models.config_from_dict(GPT), jax.random.PRNGKey(0))
    with pytest.raises(CheckpointError, match=r"objective=mdlm .* use --format safetensors"):
        export_hf(str(tmp_path / "b"), tiny_run("objective=mdlm"), model)
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_a_resumed_run_restores_its_checkpoint_not_init_from(tmp_path, monkeypatch):
    """After the first segment the directory's weights are replaced (zeros, same shapes): the resumed
    run's model is its checkpoint's, so init_from's weights were not read again."""
    import jax.numpy as jnp

    import train_jax
    from models.export import abstract_model
    from trainer.resume import merge_config, resume_source
    from utils.checkpoint.storage import restore_model
    from utils.config import to_dict

    byte_gpt = models.build(models.config_from_dict({**GPT, "vocab_size": 320}), jax.random.PRNGKey(0))
    hf.save_hf(str(tmp_path / "pretrained"), byte_gpt)
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 4})
                                                   + "\n" for i in range(40)))
    monkeypatch.chdir(tmp_path)
    run_knobs = ("model.init_from=pretrained", "tokenizer=byte", "dataset=text_files", "dataset.paths=[corpus.jsonl]",
                 "dataset.val_fraction=0.2", "train.skip_validation=true", "model.scan_blocks=false",
                 "model.remat=none", "optimizer=sgdm", "optimizer/lr_config=constant", "checkpoint.save=true",
                 "checkpoint.save_path=ck", "checkpoint.resume=auto")
    (tmp_path / "run").mkdir()
    train_jax.train(compose_config(*run_knobs, "train.max_steps=2"), str(tmp_path / "run"))
    hf.save_hf(str(tmp_path / "pretrained"), jax.tree.map(jnp.zeros_like, byte_gpt))

    config = to_dict(compose_config(*run_knobs, "train.max_steps=4"))
    run = validate(config)
    source = resume_source(run.checkpoint, lambda message: None)
    assert source is not None and source.step == 2
    trainer = train_jax.build_trainer(validate(merge_config(source, config, run.checkpoint, lambda m: None)), source)
    saved = restore_model(source, abstract_model(trainer.run.model, "float32"))
    for a, b in zip(jax.tree.leaves(trainer.state.model), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.abs(trainer.state.model.wte_VxD).max()) > 0  # not the zeros now in the directory
    trainer.data.close()


# ----------------------------------------------------------------------------- malformed config.json, every family
# A random tiny model of every model type the importer reads, and the run's model yaml of its family. The
# keys the tests walk are each family's own table (HF_KEYS, models/hf_keys.py): a key added there is covered.

TINY_LLAMA = {"name": "llama", "dim": 32, "num_heads": 4, "num_kv_heads": 2, "num_blocks": 2, "context_length": 32,
              "vocab_size": 64, "mlp_hidden": 64}
TINY = {  # model_type -> (its family's model yaml, a tiny model's config)
    "gpt2": ("gpt_tiny", GPT),
    "llama": ("llama_tiny", TINY_LLAMA),
    "mistral": ("llama_tiny", TINY_LLAMA),
    "qwen2": ("llama_tiny", {**TINY_LLAMA, "qkv_bias": True}),
    "qwen3": ("llama_tiny", {**TINY_LLAMA, "qk_norm": True, "head_size": 16}),
    "mixtral": ("llama_tiny", {**TINY_LLAMA, "moe": {"num_experts": 4, "top_k": 2}}),
    "qwen2_moe": ("llama_tiny", {**TINY_LLAMA, "qkv_bias": True,
                                 "moe": {"num_experts": 4, "top_k": 2, "shared_expert_hidden": 16}}),
    "qwen3_moe": ("llama_tiny", {**TINY_LLAMA, "qk_norm": True, "head_size": 16,
                                 "moe": {"num_experts": 4, "top_k": 2}}),
    "olmoe": ("llama_tiny", {**TINY_LLAMA, "qk_norm": True, "qk_norm_scope": "all",
                             "moe": {"num_experts": 4, "top_k": 2}}),
}
# save_hf writes a Mistral without a window as the llama it is; its directory here is that llama's,
# relabelled as transformers' MistralConfig saves one.
RELABEL = {"mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": None}}
FAMILIES = sorted(hf.hf_families())


def key_table(model_type: str) -> dict:
    """The keys walked on `model_type`'s directory: an MoE type's own (models/hf_moe.py: they come on top
    of the llama table, which the dense llama types walk), else its family's HF_KEYS. Each table is
    walked on every type that has it, no table twice on one type."""
    return hf_moe.HF_KEYS[model_type] if model_type in hf_moe.HF_KEYS else hf.hf_families()[model_type].HF_KEYS


REQUIRED = [(t, k) for t in FAMILIES for k, key in key_table(t).items() if key.required]
DECLARED = [(t, k) for t in FAMILIES for k in key_table(t)]
# A JSON value of each kind's wrong type or range (a string where a number goes, a number where a string goes, ...)
WRONG = {
    "a positive integer": ["4", 0, -2, 2.5, True, [4]],
    "a positive number": ["1e-5", 0, -1.0, True],
    "a boolean": ["true", 1],
    "a string": [5, ["silu"]],
    "an object": ["default", [1]],
    "a number >= 0": ["0.01", -0.5, True],
    "a list": ["[]", 3, {"0": 1}],
}


def test_every_model_type_has_a_tiny_directory_here():
    assert sorted(TINY) == FAMILIES, "a new Hugging Face model type: add its tiny model to TINY"
    assert REQUIRED and {t for t, _ in REQUIRED} == set(FAMILIES)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """model_type -> a directory save_hf wrote of a random tiny model of that type (copied per test)."""
    root = tmp_path_factory.mktemp("hf_families")
    out = {}
    for model_type, (_, raw) in TINY.items():
        model = models.build(models.config_from_dict(raw), jax.random.PRNGKey(0))
        hf.save_hf(str(root / model_type), model)
        if model_type in RELABEL:
            edit_config(root / model_type, **RELABEL[model_type])
        assert json.loads((root / model_type / hf.CONFIG_FILE).read_text())["model_type"] == model_type
        out[model_type] = root / model_type
    return out


@pytest.fixture
def family_dir(saved, tmp_path, monkeypatch):
    """(model_type) -> tmp/pretrained, a copy of that type's directory; cwd = tmp."""
    import shutil

    monkeypatch.chdir(tmp_path)

    def make(model_type: str) -> Path:
        shutil.copytree(saved[model_type], tmp_path / "pretrained")
        return tmp_path / "pretrained"

    return make


def load_edited(path: Path, model_type: str, drop: tuple[str, ...] = (), **changes) -> pytest.ExceptionInfo:
    """The ConfigError of a run started from `path` after config.json lost `drop` and took `changes`."""
    config = {k: v for k, v in json.loads((path / hf.CONFIG_FILE).read_text()).items() if k not in drop}
    (path / hf.CONFIG_FILE).write_text(json.dumps({**config, **changes}))
    with pytest.raises(ConfigError) as e:
        run_with(f"model={TINY[model_type][0]}", "model.init_from=pretrained")
    return e


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_tiny_directory_loads_as_written(family_dir, model_type):
    """The premise of the faults below: the unedited directory is a good one."""
    path = family_dir(model_type)
    m = run_with(f"model={TINY[model_type][0]}", "model.init_from=pretrained").model
    raw = TINY[model_type][1]
    assert (m.dim, m.num_heads, m.num_blocks, m.vocab_size) == (raw["dim"], raw["num_heads"], 2, 64)
    assert m.init_from == str(path)


def test_the_header_names_the_rotary_scaling_a_directory_brings(family_dir):
    """A yaml with no rope_scaling starting from a Llama 3.1-style directory: the scaling is the
    directory's, and the run header says the yaml's null was replaced."""
    path = family_dir("llama")
    edit_config(path, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    run = run_with("model=llama_tiny", "model.init_from=pretrained")
    assert run.model.rope_scaling == llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 16)
    note = next(w for w in run.warnings if "model.init_from=pretrained" in w)
    assert "model.rope_scaling None -> RopeScaling(type='llama3', factor=8.0" in note, note
    assert "model.vocab_size" not in note  # a null the directory resolves is no change


@pytest.mark.parametrize("how", ["missing", "null"])
@pytest.mark.parametrize(("model_type", "key"), REQUIRED)
def test_a_required_key_missing_or_null(family_dir, model_type, key, how):
    path = family_dir(model_type)
    e = load_edited(path, model_type, drop=(key,)) if how == "missing" else load_edited(path, model_type, **{key: None})
    kind = key_table(model_type)[key].kind
    message = one_line(e)
    assert message.startswith("model.init_from=pretrained: ")
    assert f"{path / hf.CONFIG_FILE} {key} is {how}: eqtrain needs it" in message and f"as {kind}" in message


@pytest.mark.parametrize(("model_type", "key"), DECLARED)
def test_a_value_of_the_wrong_kind(family_dir, model_type, key):
    """Every declared key, required or not, refused with one line for each wrong value of its kind."""
    path = family_dir(model_type)
    kind = key_table(model_type)[key].kind
    for value in WRONG[kind]:
        message = one_line(load_edited(path, model_type, **{key: value}))
        assert f"{path / hf.CONFIG_FILE} {key}={json.dumps(value)}: expected {kind}" in message, message


@pytest.mark.parametrize(("model_type", "key"), [(t, k) for t, k in DECLARED if (t, k) not in REQUIRED])
def test_an_optional_key_missing_or_null_takes_its_default(saved, model_type, key):
    """transformers' reading: an optional key absent or null is its default, never an error (a default
    that changes a shape, num_key_value_heads, is then the weights' CheckpointError, not this one)."""
    config = json.loads((saved[model_type] / hf.CONFIG_FILE).read_text())
    family = hf.hf_families()[model_type]
    base = models.config_from_dict(TINY[model_type][1])
    for edited in ({k: v for k, v in config.items() if k != key}, {**config, key: None}):
        family.config_from_hf(edited, base).check("model")


LLAMAS = ("llama", "mistral", "qwen2", "qwen3")
INVALID = [  # (model_types, changes, what the line must say)
    (("gpt2",), {"n_embd": 34}, "n_embd=34 is not divisible by n_head=4"),
    (("gpt2",), {"n_inner": 40}, "n_inner=40 has no eqtrain gpt equivalent: the MLP width must be a multiple"),
    (("gpt2",), {"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06 has no eqtrain gpt equivalent"),
    (("llama", "mistral", "qwen2"), {"hidden_size": 34, "head_dim": None},
     "hidden_size=34 is not divisible by num_attention_heads=4"),
    (LLAMAS, {"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
    (("llama", "mistral", "qwen2"), {"hidden_size": 36, "head_dim": None},
     "hidden_size=36: hidden_size/num_attention_heads=9 is odd"),
    (LLAMAS, {"head_dim": 7}, "head_dim=7: it is odd, and rotary positions rotate pairs"),
    (LLAMAS, {"rope_parameters": {"rope_type": 5}}, "rope_parameters.rope_type=5: expected a string"),
    (LLAMAS, {"rope_parameters": {"rope_theta": "1e4"}},
     'rope_parameters.rope_theta="1e4": expected a positive number'),
    (LLAMAS, {"rope_theta": None, "rope_parameters": {"rope_theta": -1}},
     "rope_parameters.rope_theta=-1: expected a positive number"),
    (LLAMAS, {"rope_parameters": {"rope_type": "longrope", "factor": 4.0}},
     'rope_parameters.rope_type="longrope": the rotary types implemented are default, linear, llama3, yarn, dynamic'),
    (LLAMAS, {"rope_scaling": {"type": "su", "factor": 4.0}},
     'rope_scaling.type="su": the rotary types implemented are default, linear, llama3, yarn, dynamic'),
    (LLAMAS, {"rope_scaling": {"type": "dynamic"}}, "rope_scaling.factor is missing: dynamic rotary scaling needs it"),
    (LLAMAS, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}},
     'rope_parameters.truncate="yes": expected a boolean'),
    (LLAMAS, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 1, "beta_slow": 2}},
     "rope_parameters describes a rotary scaling eqtrain rejects (rope_scaling.beta_slow=2.0 and beta_fast=1.0 "
     "must satisfy"),
    (LLAMAS, {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
     "rope_parameters.low_freq_factor is missing: llama3 rotary scaling needs it"),
    (LLAMAS, {"rope_parameters": {"rope_type": "linear", "factor": "2"}},
     'rope_parameters.factor="2": expected a positive number'),
    (("mistral",), {"sliding_window": 4}, "sliding_window=4: attention here is always full"),
    (("qwen2", "qwen3"), {"use_sliding_window": True}, "use_sliding_window=true: attention here is always full"),
    (("llama", "qwen3"), {"attention_bias": True}, "attention_bias=true: "),
]


@pytest.mark.parametrize(("model_type", "changes", "says"),
                         [(t, changes, says) for types, changes, says in INVALID for t in types])
def test_a_value_the_family_cannot_build(family_dir, model_type, changes, says):
    path = family_dir(model_type)
    assert f"{path / hf.CONFIG_FILE} {says}" in one_line(load_edited(path, model_type, **changes))


def write_config_json(path: Path, how: str) -> None:
    where = path / hf.CONFIG_FILE
    where.unlink()
    if how == "truncated":
        where.write_text('{"model_type": "llama", "hidden_size": 3')
    elif how == "not utf-8":
        where.write_bytes(b'{"model_type": "\xff"}')
    elif how == "nested too deep":
        where.write_text("[" * 100_000)
    elif how == "a list":
        where.write_text("[1, 2]")
    elif how == "a directory":
        where.mkdir()
    elif how == "a dangling link":
        where.symlink_to(path / "nowhere.json")
    elif how == "no model_type":
        where.write_text(json.dumps({"hidden_size": 32}))
    elif how == "model_type null":
        where.write_text(json.dumps({"model_type": None}))
    elif how == "model_type a list":
        where.write_text(json.dumps({"model_type": ["llama"]}))


FILE_FAULTS = {
    "missing": "is missing: a Hugging Face model directory holds config.json",
    "truncated": "is not valid JSON (",
    "not utf-8": "is not valid JSON (",
    "nested too deep": "is not valid JSON (",
    "a list": "holds list, not a JSON object",
    "a directory": "is not a file",
    "a dangling link": "is not a file",
    "no model_type": "model_type is missing: it names the architecture",
    "model_type null": "has model_type=null, which eqtrain cannot load",
    "model_type a list": 'has model_type=["llama"], which eqtrain cannot load',
}


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("how", FILE_FAULTS)
def test_a_config_json_that_cannot_be_read(family_dir, model_type, how):
    path = family_dir(model_type)
    write_config_json(path, how)
    with pytest.raises(ConfigError) as e:
        run_with(f"model={TINY[model_type][0]}", "model.init_from=pretrained")
    assert f"model.init_from=pretrained: {path / hf.CONFIG_FILE} {FILE_FAULTS[how]}" in one_line(e)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_load_hf_names_the_file_too(saved, tmp_path, model_type):
    """scripts reach a directory through load_hf (no init_from knob): the line names the file and key."""
    import shutil

    path = tmp_path / model_type
    shutil.copytree(saved[model_type], path)
    key = next(k for t, k in REQUIRED if t == model_type)
    config = json.loads((path / hf.CONFIG_FILE).read_text())
    (path / hf.CONFIG_FILE).write_text(json.dumps({k: v for k, v in config.items() if k != key}))
    base = models.config_from_dict(TINY[model_type][1])
    with pytest.raises(ConfigError) as e:
        hf.load_hf(str(path), base)
    assert one_line(e).startswith(f"{path / hf.CONFIG_FILE} {key} is missing: ")


@pytest.mark.slow
def test_the_command_line_prints_one_line_and_compiles_nothing(saved, tmp_path):
    """issue 33's report: `train_jax.py model.init_from=DIR` with no num_attention_heads ended in a
    KeyError traceback. Now: exit 2, one `error:` line on stderr, and no compilation started."""
    import shutil
    import subprocess
    import sys

    from helpers import REPO, offline_env

    path = tmp_path / "pretrained"
    shutil.copytree(saved["llama"], path)
    config = json.loads((path / hf.CONFIG_FILE).read_text())
    (path / hf.CONFIG_FILE).write_text(json.dumps({k: v for k, v in config.items() if k != "num_attention_heads"}))
    proc = subprocess.run([sys.executable, str(Path(REPO) / "train_jax.py"), "model=llama_tiny",
                           f"model.init_from={path}", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=offline_env(tmp_path / "cache"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == [f"error: model.init_from={path}: {path / hf.CONFIG_FILE} num_attention_heads is missing: "
                     "eqtrain needs it (query heads per block) as a positive integer, e.g. num_attention_heads: 32; "
                     "save the directory again with transformers' save_pretrained, or add the key"], proc.stderr
    assert "compil" not in (proc.stdout + proc.stderr).lower()
