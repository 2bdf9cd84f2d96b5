"""Run configs: overrides parsed from the annotations, clear errors, files, config.json."""

import json
import textwrap

import pytest

from dgemma.errors import DGemmaError
from dgemma.models.transformer import ModelConfig
from dgemma.training.config import (
    Config,
    DataConfig,
    OptimConfig,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
    model_overrides,
    parse_cli,
    save_config,
)


def over(*args, cfg=None):
    return apply_overrides(cfg or Config(), list(args))


def err(fn, *a, **k) -> str:
    with pytest.raises(DGemmaError) as e:
        fn(*a, **k)
    return str(e.value)


# ---------------------------------------------------------------------------------- coercion
@pytest.mark.parametrize("text, value", [("7", 7), ("1_000", 1000), ("1e3", 1000), ("-3", -3)])
def test_int(text, value):
    v = over(f"--cfg.train.seed={text}").train.seed
    assert v == value and type(v) is int


@pytest.mark.parametrize("text, value", [("1e-4", 1e-4), ("3", 3.0), (".5", 0.5), ("-2.5E-3", -2.5e-3)])
def test_float(text, value):
    v = over(f"--cfg.optim.lr={text}").optim.lr
    assert v == value and type(v) is float


@pytest.mark.parametrize("text, value", [("true", True), ("True", True), ("1", True), ("yes", True),
                                         ("false", False), ("0", False), ("off", False)])
def test_bool(text, value):
    assert over(f"--cfg.model.self_conditioning={text}").model.self_conditioning is value


def test_str_keeps_text_verbatim():
    cfg = over("--cfg.data.task=pubmedqa", "--cfg.data.path=/d/a=b, c.json", "--cfg.workdir=runs/x")
    assert (cfg.data.task, cfg.data.path, cfg.workdir) == ("pubmedqa", "/d/a=b, c.json", "runs/x")


def test_optional_none_and_value():
    cfg = over("--cfg.optim.clip_norm=none", "--cfg.train.keep_last=null", "--cfg.init.base=gemma3-270m")
    assert cfg.optim.clip_norm is None and cfg.train.keep_last is None and cfg.init.base == "gemma3-270m"
    cfg = over("--cfg.optim.clip_norm=0.5", "--cfg.train.keep_last=2", cfg=cfg)
    assert cfg.optim.clip_norm == 0.5 and cfg.train.keep_last == 2 and type(cfg.train.keep_last) is int
    assert over("--cfg.eval_ds.early_stopping=NONE").eval_ds.early_stopping is None


@pytest.mark.parametrize("text", ["16,32", "16, 32", "[16, 32]"])
def test_list_of_int(text):
    assert over(f"--cfg.eval_ds.steps={text}").eval_ds.steps == [16, 32]


def test_list_empty_and_single():
    assert over("--cfg.eval_ds.steps=").eval_ds.steps == []
    assert over("--cfg.eval_ds.steps=8").eval_ds.steps == [8]


def test_tuple_and_union_of_list_and_literal():
    assert over("--cfg.optim.betas=0.9,0.999").optim.betas == (0.9, 0.999)
    assert over("--cfg.optim.betas=[0.8, 0.9]").optim.betas == (0.8, 0.9)
    assert over("--cfg.lora.target_modules=q_proj,v_proj").lora.target_modules == ["q_proj", "v_proj"]
    assert over('--cfg.lora.target_modules=["o_proj"]').lora.target_modules == ["o_proj"]
    assert over("--cfg.lora.target_modules=all-linear").lora.target_modules == "all-linear"


def test_literal_choices():
    assert over("--cfg.diffusion.process=absorbing").diffusion.process == "absorbing"
    assert err(over, "--cfg.diffusion.process=masked") == (
        "invalid value 'masked' for diffusion.process: expected one of 'uniform', 'absorbing'")


def test_aux_knobs_became_typed_fields():
    assert err(over, "--cfg.aux.knobs.step.threshold=0.95") == (
        "aux.knobs is gone: write --cfg.eval_ds.confidence_threshold=... instead of --cfg.aux.knobs.step.threshold")
    assert "a typed eval_ds field" in err(over, "--cfg.aux.knobs.ema=0.9")
    # a config.json saved with knobs still loads, each known knob in its typed field
    d = config_to_dict(Config())
    d["aux"]["knobs"] = {"step.threshold": 0.8, "step.block": 8, "eval_puzzle_seed": 5}
    cfg = config_from_dict(d)
    assert (cfg.eval_ds.confidence_threshold, cfg.eval_ds.commit_block, cfg.eval_ds.puzzle_seed) == (0.8, 8, 5)
    d = config_to_dict(Config())
    d["aux"]["knobs"] = {}
    assert config_from_dict(d) == Config()
    d["aux"]["knobs"] = {"ema": 0.99}
    with pytest.raises(DGemmaError, match="aux.knobs.ema is not read any more"):
        config_from_dict(d)
    with pytest.raises(DGemmaError, match="commit_block must be >= 1"):
        over("--cfg.eval_ds.commit_block=0")


def test_overrides_apply_in_order_and_copy():
    base = Config()
    cfg = apply_overrides(base, ["--cfg.optim.lr=1", "--cfg.optim.lr=2"])
    assert cfg.optim.lr == 2.0 and base.optim.lr == OptimConfig().lr


def test_model_fields_and_derived_layer_types():
    cfg = over("--cfg.model.num_hidden_layers=12", "--cfg.model.attn_implementation=eager")
    assert cfg.model.layer_types == ModelConfig(num_hidden_layers=12).layer_types
    assert cfg.model.attn_implementation == "eager"
    explicit = ["full_attention"] * 2
    cfg = over("--cfg.model.num_hidden_layers=2", f"--cfg.model.layer_types={','.join(explicit)}")
    assert cfg.model.layer_types == explicit
    assert err(over, "--cfg.model.attn_implementation=cuda") == (
        "invalid model config: attn_implementation must be one of ('eager', 'sdpa', 'flex'), got 'cuda'")


# ------------------------------------------------------------------------------------ errors
def test_typo_suggests_the_closest_key():
    assert err(over, "--cfg.optim.lrr=1e-4") == "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"
    assert err(over, "--cfg.model.hiden_size=8") == (
        "unknown config key 'model.hiden_size'; did you mean 'model.hidden_size'?")
    assert err(over, "--cfg.train.lr=1") == "unknown config key 'train.lr'; did you mean 'optim.lr'?"
    assert err(over, "--cfg.optm.lr=1") == "unknown config key 'optm.lr'; did you mean 'optim.lr'?"
    assert err(over, "--cfg.optim.qqqq=1") == (
        "unknown config key 'optim.qqqq'; valid keys under 'optim': name, lr, min_lr_ratio, "
        "warmup_steps, betas, weight_decay, eps, clip_norm")


@pytest.mark.parametrize("arg, message", [
    ("--cfg.optim.lr=abc", "invalid value 'abc' for optim.lr: expected float"),
    ("--cfg.train.steps=1.5", "invalid value '1.5' for train.steps: expected int"),
    ("--cfg.train.resume=maybe", "invalid value 'maybe' for train.resume: expected bool (true/false)"),
    ("--cfg.train.keep_last=all", "invalid value 'all' for train.keep_last: expected int or none"),
    ("--cfg.eval_ds.steps=8,x", "invalid value '8,x' for eval_ds.steps: expected list of int "
                                "(comma-separated or JSON)"),
    ("--cfg.optim.betas=0.9", "invalid value '0.9' for optim.betas: expected 2 comma-separated values "
                              "(float, float)"),
    ("--cfg.optim.lr", "--cfg.optim.lr needs a value: write --cfg.optim.lr=VALUE"),
    ("--cfg.model=small", "'model' is a config section, not a value; set one of its fields, "
                          "e.g. --cfg.model.vocab_size=..."),
    ("--cfg.optim.lr.peak=1", "'optim.lr' is a value, not a section: no 'optim.lr.peak'"),
    ("--lr=1", "not a config override: '--lr=1'; write --cfg.SECTION.KEY=VALUE"),
    ("--cfg.data.batch_size=0", "invalid data config: batch_size must be >= 1, got 0"),
    ("--cfg.eval_ds.steps=0,4", "invalid eval_ds config: steps must all be >= 1, got [0, 4]"),
    ("--cfg.diffusion.selfcond_prob=1.5", "invalid diffusion config: selfcond_prob must be in [0, 1], got 1.5"),
])
def test_bad_values(arg, message):
    assert err(over, arg) == message


# ------------------------------------------------------------------------------------- files
def write(tmp_path, body, name="run.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


GOOD = """
from dgemma.training.config import Config, DataConfig, ModelConfig, OptimConfig

def get_config():
    return Config(
        workdir="runs/t",
        model=ModelConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2),
        data=DataConfig(task="sudoku", batch_size=4),
        optim=OptimConfig(lr=3e-4, betas=[0.9, 0.98]),
    )
"""


def test_load_config_file(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.workdir == "runs/t" and cfg.data == DataConfig(task="sudoku", batch_size=4)
    assert cfg.optim.betas == (0.9, 0.98)  # list in the file, tuple per the annotation
    assert cfg.model.num_hidden_layers == 2


def test_config_file_errors(tmp_path):
    missing = tmp_path / "nope.py"
    assert err(load_config, missing) == f"config file not found: {missing}"
    p = write(tmp_path, "x = 1\ndef get_config(:\n    pass\n")
    assert err(load_config, p) == f"{p}:2: syntax error: invalid syntax"
    p = write(tmp_path, "x = 1\n")
    assert err(load_config, p) == f"{p} defines no get_config() function returning a Config"
    p = write(tmp_path, "def get_config():\n    return {'lr': 1}\n")
    assert err(load_config, p) == f"{p}: get_config() returned dict, not a Config"
    p = write(tmp_path, "from dgemma.training.config import *\n\ndef get_config():\n"
                        "    return Config(optim=OptimConfig(lrr=1e-4))\n")
    assert err(load_config, p) == f"{p}:4: OptimConfig has no field 'lrr'; did you mean 'lr'?"
    p = write(tmp_path, "from dgemma.training.config import *\n\ndef get_config():\n"
                        "    return Config(optim=OptimConfig(lr='1e-4'))\n")
    assert err(load_config, p) == "invalid value '1e-4' for optim.lr: expected float"
    p = write(tmp_path, "import math\n\ndef get_config():\n    return math.nope\n")
    assert err(load_config, p) == f"{p}:4: AttributeError: module 'math' has no attribute 'nope'"


def test_round_trip_through_config_json(tmp_path):
    cfg = apply_overrides(load_config(write(tmp_path, GOOD)), [
        "--cfg.eval_ds.steps=8,16", "--cfg.lora.enabled=true", "--cfg.lora.target_modules=q_proj",
        "--cfg.eval_ds.commit_block=8", "--cfg.optim.clip_norm=none", "--cfg.model.self_conditioning=true"])
    path = save_config(cfg, tmp_path / "wd")
    assert path == tmp_path / "wd" / "config.json"
    d = json.loads(path.read_text())
    assert d["optim"]["betas"] == [0.9, 0.98] and d["model"]["self_conditioning"] is True
    assert load_config(path) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_saved_dict_errors():
    d = config_to_dict(Config())
    d["optim"]["weight_decya"] = 0.1
    assert err(config_from_dict, d) == (
        "unknown config key 'optim.weight_decya'; did you mean 'optim.weight_decay'?")
    d = config_to_dict(Config())
    d["train"]["steps"] = "100"
    assert err(config_from_dict, d) == "invalid value '100' for train.steps: expected int"
    del d["train"]  # a section saved before it existed: defaults
    assert config_from_dict(d) == Config()


def test_parse_cli(tmp_path):
    p = write(tmp_path, GOOD)
    cfg, rest = parse_cli(["eval", f"--cfg={p}", "--step=3", "--cfg.optim.lr=1e-3", "--verbose"])
    assert cfg.optim.lr == 1e-3 and cfg.workdir == "runs/t" and rest == ["eval", "--step=3", "--verbose"]
    cfg, rest = parse_cli(["--cfg", str(p)])
    assert cfg == load_config(p) and rest == []
    assert err(parse_cli, ["--cfg.optim.lr=1"]) == (
        "missing --cfg=FILE (a config file such as configs/sft_sudoku.py)")
    assert parse_cli(["--cfg.optim.lr=1"], require_file=False)[0].optim.lr == 1.0
    assert err(parse_cli, [f"--cfg={p}", f"--cfg={p}"]).startswith("--cfg given twice")


def test_model_overrides_for_a_pretrained_base():
    assert model_overrides(Config()) == {}
    cfg = over("--cfg.model.self_conditioning=true", "--cfg.model.attn_implementation=eager")
    assert model_overrides(cfg) == {"self_conditioning": True, "attn_implementation": "eager"}
    assert model_overrides(over("--cfg.model.num_hidden_layers=6")) == {"num_hidden_layers": 6}
