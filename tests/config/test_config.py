"""Tests for the strict config loader (titanlite.config) and its model-aware front (titanlite.models.load_config)."""

from __future__ import annotations

import dataclasses
import os
import sys
import textwrap
from dataclasses import dataclass

import pytest
from torch import nn

import titanlite.config
from tests.helpers.launch import run_python
from titanlite.config import (
    ConfigError,
    JobConfig,
    config_to_dict,
    config_to_toml,
    dump_config,
    format_help,
    parse_args_or_exit,
    validate,
)
from titanlite.config.sections import Training, opt, section
from titanlite.models import ModelSpec, load_config, model_schema, register_model, registry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ------------------------------------------------------------------ a tiny fake model family

FAMILY = "cfgtest_tiny"


@dataclass
class TinyArgs:
    dim: int = 16
    n_layers: int = 2
    n_kv_heads: int | None = None
    ffn_dim_multiplier: float | None = None
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attn_mask_type: str = "causal"
    stages: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
    bounded: int = opt(3, "a field with checks", min=1, max=8)
    vocab_size: int = 32
    max_seq_len: int = 64


class _TinyModel(nn.Module):  # never built in these tests; it declares what a family's model has
    args: TinyArgs
    tok_embeddings: nn.Embedding | None
    layers: nn.ModuleDict
    norm: nn.Module | None
    output: nn.Linear | None

    def forward(self, tokens, document_ids=None, return_hidden=False):
        raise NotImplementedError

    def init_weights(self, buffer_device=None):
        raise NotImplementedError


register_model(
    ModelSpec(
        name=FAMILY,
        args_cls=TinyArgs,
        flavors={"debugmodel": TinyArgs(), "small": TinyArgs(dim=8, n_kv_heads=1)},
        model_cls=_TinyModel,
    )
)


@pytest.fixture(autouse=True)
def _tolerate_missing_builtin_families(monkeypatch):
    """The registry imports llama3 on lookup; keep these tests independent of that module."""
    try:
        import titanlite.models.llama3  # noqa: F401
    except Exception:
        monkeypatch.setattr(registry, "_ensure_builtin", lambda: None)


def load(*args: str) -> JobConfig:
    """load_config with the fake family selected (file values are applied before the CLI)."""
    return load_config(["--model.name", FAMILY, *args])


def write(tmp_path, text: str, name: str = "c.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def error_of(argv, loader=load_config, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        loader(argv, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------ defaults and round trip


def test_defaults():
    cfg = load()
    expected = JobConfig()
    expected.model.name = FAMILY
    assert cfg == expected
    assert cfg.model.overrides == {}


def test_toml_file_values(tmp_path):
    path = write(
        tmp_path,
        f"""
        [job]
        description = "a \\"quoted\\" run"
        [model]
        name = "{FAMILY}"
        flavor = "small"
        n_layers = 4
        ffn_dim_multiplier = 1   # int for a float field
        [optimizer]
        lr = 3e-4
        [training]
        steps = 1e3              # integral float for an int field
        local_batch_size = 2
        global_batch_size = 8
        deterministic = true
        [lr_scheduler]
        warmup_steps = 1_0
    """,
    )
    cfg = load_config(["--config", path])
    assert cfg.job.description == 'a "quoted" run'
    assert cfg.model.name == FAMILY and cfg.model.flavor == "small"
    assert cfg.model.overrides == {"n_layers": 4, "ffn_dim_multiplier": 1.0}
    assert isinstance(cfg.model.overrides["ffn_dim_multiplier"], float)
    assert cfg.optimizer.lr == 3e-4
    assert cfg.training.steps == 1000 and isinstance(cfg.training.steps, int)
    assert cfg.training.global_batch_size == 8
    assert cfg.training.deterministic is True
    assert cfg.lr_scheduler.warmup_steps == 10


def test_round_trip(tmp_path):
    cfg = load(
        "--job.description",
        'tricky "quotes" \\ back\nnewline\ttab é',
        "--optimizer.lr",
        "3e-4",
        "--optimizer.eps",
        "1e-12",
        "--lr_scheduler.decay_ratio",
        "0.25",
        "--training.steps",
        "1_000",
        "--training.deterministic",
        "--training.global_batch_size",
        "-1",
        "--metrics.enable_tensorboard=true",
        "--model.n_layers",
        "3",
        "--model.ffn_dim_multiplier",
        "1.3",
        "--model.tie_word_embeddings",
        "true",
        "--model.stages",
        "4,5,6",
        "--model.n_kv_heads",
        "none",
        "--model.attn_mask_type",
        "block_causal",
        "--job.trainer",
        "my_trainer",
        "--training.loss",
        "z_loss",
        "--lr_scheduler.name",
        "cosine_restarts",
        "--optimizer.name",
        "Muon",  # no fixed choices: an extension may register optimizers
    )
    path = tmp_path / "out" / "config.toml"
    dump_config(cfg, path)
    again = load_config(["--config", str(path)])
    assert again == cfg
    assert again.model.overrides == {
        "n_layers": 3,
        "ffn_dim_multiplier": 1.3,
        "tie_word_embeddings": True,
        "stages": [4, 5, 6],
        "n_kv_heads": None,
        "attn_mask_type": "block_causal",
    }
    text = config_to_toml(cfg)
    for name in config_to_dict(cfg):
        assert f"[{name}]" in text
    assert "overrides" not in text
    assert "lr = 0.0003" in text
    assert 'trainer = "my_trainer"' in text and 'loss = "z_loss"' in text and 'name = "cosine_restarts"' in text
    defaults = JobConfig()
    assert (defaults.job.trainer, defaults.training.loss) == ("default", "cross_entropy")
    assert (defaults.lr_scheduler.name, defaults.optimizer.name) == ("warmup_stable_decay", "AdamW")


def test_config_to_dict():
    cfg = load("--model.n_layers", "5")
    d = config_to_dict(cfg)
    assert list(d) == [f.metadata.get("toml", f.name) for f in dataclasses.fields(JobConfig)]
    assert d["model"]["n_layers"] == 5 and "overrides" not in d["model"]
    assert d["training"]["steps"] == cfg.training.steps
    d["training"]["steps"] = 7  # a copy
    assert cfg.training.steps != 7


def test_none_field_omitted_and_restored(tmp_path):
    # X | None section fields are written only when set; a None model override is written as "none".
    cfg = load("--model.ffn_dim_multiplier", "none")
    assert cfg.model.overrides == {"ffn_dim_multiplier": None}
    path = tmp_path / "c.toml"
    dump_config(cfg, path)
    assert 'ffn_dim_multiplier = "none"' in path.read_text()
    assert load_config(["--config", str(path)]) == cfg


# ------------------------------------------------------------------ command-line overrides


def test_override_forms(tmp_path):
    path = write(
        tmp_path,
        """
        [training]
        steps = 10
        deterministic = true
        [metrics]
        enable_tensorboard = true
    """,
    )
    cfg = load(
        "--config",
        path,
        "--training.steps",
        "20",  # space form, overrides the file
        "--training.seq_len=64",  # = form
        "--validation.enable",  # bare bool followed by another flag
        "--training.deterministic",
        "false",  # explicit false
        "--metrics.enable_tensorboard=false",
        "--optimizer.lr",
        "3e-4",  # float
        "--optimizer.weight_decay",
        "0",  # int text for a float
        "--training.seed",
        "1e3",  # integral float text for an int
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "-1",  # negative value after a flag
        "--model.n_layers",
        "6",  # model-args override
        "--model.stages=7,8",  # list of ints
        "--model.rope_theta",
        "-1e4",  # a negative number in exponent form is a value, not an option
        "--job.description=-x",  # any other value starting with '-' takes the = form
        "--job.print_config",  # bare bool at the end
    )
    assert cfg.training.steps == 20
    assert cfg.training.seq_len == 64
    assert cfg.validation.enable is True
    assert cfg.training.deterministic is False
    assert cfg.metrics.enable_tensorboard is False
    assert cfg.optimizer.lr == 3e-4
    assert cfg.optimizer.weight_decay == 0.0 and isinstance(cfg.optimizer.weight_decay, float)
    assert cfg.training.seed == 1000
    assert cfg.training.global_batch_size == -1
    assert cfg.model.overrides == {"n_layers": 6, "stages": [7, 8], "rope_theta": -1e4}
    assert cfg.job.description == "-x"
    assert cfg.job.print_config is True


def test_no_prefix_matching():
    """argparse's abbreviations are off: a prefix of a key is an unknown key, not that key."""
    msg = error_of(["--training.step", "5"])
    assert "unknown key 'training.step'" in msg and "did you mean 'training.steps'?" in msg
    assert "unknown key 'training.seq'" in error_of(["--training.seq=4"])


def test_overrides_apply_in_order():
    cfg = load("--training.steps", "5", "--training.steps=7", "--model.dim", "4", "--model.dim", "12")
    assert cfg.training.steps == 7
    assert cfg.model.overrides == {"dim": 12}


def test_model_name_from_cli_after_file(tmp_path):
    # the args fields are checked against the family chosen last (here on the command line)
    path = write(
        tmp_path,
        """
        [model]
        name = "no_such_family"
        n_layers = 4
    """,
    )
    cfg = load_config(["--config", path, "--model.name", FAMILY])
    assert cfg.model.overrides == {"n_layers": 4}


def test_bool_spellings():
    for text, value in [("true", True), ("False", False), ("1", True), ("0", False), ("yes", True), ("off", False)]:
        assert load("--training.deterministic", text).training.deterministic is value


@dataclass
class Float8:
    enable: bool = opt(False, "Use float8 linears.")
    filter_fqns: list[str] = opt([], "Modules to skip.")


@dataclass
class Extended(JobConfig):
    quantize_linear_float8: Float8 = section(Float8, "quantize.linear.float8")


def test_dotted_section_and_list_field(monkeypatch, tmp_path):
    """A nested TOML section (declared with sections.section(cls, "a.b.c")) and a list[str] key."""
    from titanlite.config import parser

    monkeypatch.setattr(parser, "JobConfig", Extended)
    cfg = load(
        "--quantize.linear.float8.filter_fqns", "output,layers.0.attention.wq", "--quantize.linear.float8.enable"
    )
    assert isinstance(cfg, Extended)
    assert cfg.quantize_linear_float8.filter_fqns == ["output", "layers.0.attention.wq"]
    assert cfg.quantize_linear_float8.enable is True
    text = config_to_toml(cfg)
    assert "[quantize.linear.float8]" in text
    assert 'filter_fqns = ["output", "layers.0.attention.wq"]' in text
    assert load_config(["--config", write(tmp_path, text)]) == cfg
    assert "\n[quantize.linear.float8]:\n" in format_help()
    assert "--quantize.linear.float8.filter_fqns [list[str]]" in format_help()
    assert load("--quantize.linear.float8.filter_fqns", "").quantize_linear_float8.filter_fqns == []

    path = write(
        tmp_path,
        f"""
        [model]
        name = "{FAMILY}"
        [quantize.linear.float8]
        filter_fqns = ["output"]
    """,
    )
    assert load_config(["--config", path]).quantize_linear_float8.filter_fqns == ["output"]
    msg = error_of(["--quantize.linear.float8.enabel"])
    assert "unknown key 'quantize.linear.float8.enabel'" in msg
    assert "did you mean 'quantize.linear.float8.enable'?" in msg
    msg = error_of(["--config", write(tmp_path, "[quantize.linear.float9]\nenable = true\n")])
    assert "unknown section 'quantize.linear.float9'" in msg and "did you mean 'quantize.linear.float8'?" in msg
    msg = error_of(["--config", write(tmp_path, "[quantize]\nenable = true\n")])
    assert "unknown key 'quantize.enable'" in msg
    msg = error_of(["--config", write(tmp_path, '[quantize.linear.float8]\nfilter_fqns = "output"\n')])
    assert "'quantize.linear.float8.filter_fqns'" in msg and "list" in msg


# ------------------------------------------------------------------ unknown names


def test_unknown_key_in_toml(tmp_path):
    path = write(
        tmp_path,
        """
        [training]
        lrr = 0.1
    """,
        name="x.toml",
    )
    msg = error_of(["--config", path])
    assert "unknown key 'training.lrr'" in msg
    assert path in msg
    assert "did you mean 'optimizer.lr'?" in msg


def test_unknown_key_in_section_suggests_same_section(tmp_path):
    path = write(
        tmp_path,
        """
        [training]
        stpes = 3
    """,
    )
    assert "did you mean 'training.steps'?" in error_of(["--config", path])


def test_unknown_section_in_toml(tmp_path):
    path = write(
        tmp_path,
        """
        [trainig]
        steps = 3
    """,
    )
    msg = error_of(["--config", path])
    assert "unknown section 'trainig'" in msg and path in msg
    assert "did you mean 'training'?" in msg


def test_unknown_top_level_key_in_toml(tmp_path):
    path = write(tmp_path, "steps = 3\n")
    msg = error_of(["--config", path])
    assert "unknown top-level key 'steps'" in msg


def test_unknown_key_on_cli():
    msg = error_of(["--training.lrr", "0.1"])
    assert "unknown key 'training.lrr' on the command line" in msg
    assert "did you mean 'optimizer.lr'?" in msg
    assert "did you mean 'training.seq_len'?" in error_of(["--training.seqlen", "4"])


def test_unknown_section_on_cli():
    msg = error_of(["--trainig.steps", "3"])
    assert "unknown section 'trainig'" in msg
    assert "did you mean 'training.steps'?" in msg


def test_option_without_section():
    msg = error_of(["--steps", "3"])
    assert "--steps" in msg and "did you mean '--training.steps'?" in msg
    assert "unexpected argument 'foo'" in error_of(["foo"])


def test_unknown_model_arg():
    msg = error_of(["--model.name", FAMILY, "--model.n_layerz", "4"])
    assert "unknown key 'model.n_layerz'" in msg
    assert "did you mean 'model.n_layers'?" in msg


def test_unknown_model_arg_in_toml(tmp_path):
    path = write(
        tmp_path,
        f"""
        [model]
        name = "{FAMILY}"
        flavr = "small"
    """,
    )
    msg = error_of(["--config", path])
    assert "unknown key 'model.flavr'" in msg and path in msg and "did you mean 'model.flavor'?" in msg


def test_unknown_model_family_and_flavor():
    msg = error_of(["--model.name", "cfgtest_tinny"])
    assert "unknown model family 'cfgtest_tinny'" in msg
    assert f"did you mean '{FAMILY}'?" in msg
    msg = error_of(["--model.name", FAMILY, "--model.flavor", "huge"])
    assert "unknown flavor 'huge'" in msg and "debugmodel" in msg


def test_overrides_not_settable_directly():
    assert "cannot be set directly" in error_of(["--model.name", FAMILY, "--model.overrides", "x"])


# ------------------------------------------------------------------ bad types and values


def test_bad_int_on_cli():
    msg = error_of(["--training.steps", "abc"])
    assert "'training.steps'" in msg and "'abc'" in msg and "integer" in msg
    assert "integer" in error_of(["--training.steps", "1.5"])
    assert "integer" in error_of(["--training.steps", "1e-3"])


def test_bad_bool_and_missing_value_on_cli():
    msg = error_of(["--training.deterministic", "maybe"])
    assert "'maybe'" in msg and "true or false" in msg
    msg = error_of(["--training.steps"])
    assert "'training.steps'" in msg and "expected a value" in msg
    assert "expected a value" in error_of(["--training.steps", "--training.seed", "1"])


def test_bad_types_in_toml(tmp_path):
    msg = error_of(["--config", write(tmp_path, '[training]\nsteps = "10"\n')])
    assert "'training.steps'" in msg and '"10"' in msg and "integer" in msg
    msg = error_of(["--config", write(tmp_path, "[training]\nsteps = 1.5\n")])
    assert "1.5" in msg and "integer" in msg
    msg = error_of(["--config", write(tmp_path, "[training]\ndeterministic = 1\n")])
    assert "'training.deterministic'" in msg and "true or false" in msg
    msg = error_of(["--config", write(tmp_path, "[training]\nseq_len = true\n")])
    assert "'training.seq_len'" in msg
    msg = error_of(["--config", write(tmp_path, "[training.steps]\nx = 1\n")])
    assert "'training.steps'" in msg and "table" in msg
    msg = error_of(["--config", write(tmp_path, "training = 3\n")])
    assert "'training'" in msg and "must be a table" in msg


def test_bad_model_arg_type():
    msg = error_of(["--model.name", FAMILY, "--model.n_layers", "four"])
    assert "'model.n_layers'" in msg and "'four'" in msg and "integer" in msg
    msg = error_of(["--model.name", FAMILY, "--model.bounded", "9"])
    assert "'model.bounded'" in msg and "in [1, 8]" in msg
    msg = error_of(["--model.name", FAMILY, "--model.dim"])
    assert "expected a value" in msg


def test_out_of_range_values():
    msg = error_of(["--optimizer.lr", "-0.1"])
    assert "'optimizer.lr'" in msg and "-0.1" in msg and "> 0.0" in msg
    msg = error_of(["--training.seq_len", "0"])
    assert "'training.seq_len'" in msg and "'0'" in msg and ">= 1" in msg
    msg = error_of(["--optimizer.beta2", "1.5"])
    assert "'optimizer.beta2'" in msg and "in [0.0, 1.0]" in msg


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--optimizer.lr", "inf"], "optimizer.lr"),
        (["--optimizer.lr", "nan"], "optimizer.lr"),
        (["--guard.rollback_lr_factor", "inf"], "guard.rollback_lr_factor"),
        (["--optimizer.weight_decay", "1e400"], "optimizer.weight_decay"),
        (["--lr_scheduler.min_lr_factor=-inf"], "lr_scheduler.min_lr_factor"),
        (["--optimizer.lr", "1" + "0" * 400], "optimizer.lr"),  # an integer beyond any float
    ],
)
def test_non_finite_floats_are_refused_naming_the_key(argv, key, tmp_path):
    """inf passes ``> 0`` checks and NaN every comparison: both are refused, on the command line and in TOML."""
    assert f"'{key}'" in error_of(argv) and "finite" in error_of(argv)
    section, name = key.split(".")
    for value in ("inf", "nan", "-inf"):
        msg = error_of(["--config", write(tmp_path, f"[{section}]\n{name} = {value}\n")])
        assert f"'{key}'" in msg and "finite" in msg


def test_mixture_weights_must_be_finite(tmp_path):
    for weight in ("inf", "nan"):
        body = f'[training]\nmixture = [{{path = "a.txt", weight = {weight}}}, {{path = "b.txt", weight = 1}}]\n'
        msg = error_of(["--config", write(tmp_path, body)])
        assert "training.mixture[0].weight" in msg and "finite" in msg


def test_huge_integers_are_exact_or_refused_and_name_the_key(tmp_path):
    """``--training.tokens 1e30`` is the integer 10**30 (it was 1000000000000000019884624838656), a TOML float too
    large to be exact is refused, and ``--training.seed 1e20`` names its key (torch seeds are 64-bit)."""
    assert load(["--training.tokens", "1e30"][0], "1e30").training.tokens == 10**30
    msg = error_of(["--config", write(tmp_path, "[training]\ntokens = 1e30\n")])
    assert "'training.tokens'" in msg and "not exact" in msg
    msg = error_of(["--training.seed", "1e20"])
    assert "'training.seed'" in msg and "in [0, 4294967295]" in msg


def test_bad_choice():
    msg = error_of(["--optimizer.implementation", "fast"])
    assert "'optimizer.implementation'" in msg and "'fast'" in msg and "fused" in msg and "for-loop" in msg
    msg = error_of(["--compile.components", "model,optimizer"])
    assert "'compile.components'" in msg and "optimizer" in msg and "one of model, loss" in msg


def test_cross_field_checks():
    msg = error_of(["--lr_scheduler.warmup_steps", "100", "--training.steps", "50"])
    assert "lr_scheduler.warmup_steps (100)" in msg and "training.steps (50)" in msg
    assert "decay_ratio" in error_of(["--lr_scheduler.decay_ratio", "1.5"])
    assert load("--lr_scheduler.decay_ratio", "0.5").lr_scheduler.decay_ratio == 0.5
    msg = error_of(["--training.local_batch_size", "4", "--training.global_batch_size", "6"])
    assert "training.global_batch_size" in msg and "multiple" in msg and "(4)" in msg
    assert "training.global_batch_size" in error_of(["--training.global_batch_size", "0"])
    assert (
        load("--training.local_batch_size", "4", "--training.global_batch_size", "12").training.global_batch_size == 12
    )
    assert "validation.steps" in error_of(["--validation.steps", "0"])
    assert load("--validation.steps", "-1").validation.steps == -1
    msg = error_of(["--training.dataset", "c4"])
    assert "'training.dataset'" in msg and "shards" in msg
    msg = error_of(["--validation.dataset", "shards"])
    assert "validation.dataset_path" in msg
    cfg = load("--training.dataset", "text", "--training.dataset_path", "data.txt")
    assert cfg.training.dataset == "text"


def test_validate_programmatic_config():
    cfg = JobConfig()
    cfg.optimizer.lr = -1.0
    with pytest.raises(ConfigError, match="optimizer.lr"):
        validate(cfg)
    cfg = JobConfig()
    cfg.training.steps = 1
    with pytest.raises(ConfigError, match=r"warmup_steps \(2\) must be <= training.steps \(1\)"):
        cfg.validate()  # the cross-section rules live with the sections
    with pytest.raises(ConfigError, match="training.dataset_path"):
        Training(dataset="shards").validate()


# ------------------------------------------------------------------ files


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.toml")
    msg = error_of(["--config", missing])
    assert missing in msg and "not found" in msg


def test_malformed_toml(tmp_path):
    path = write(tmp_path, "[training]\nsteps = = 3\n", name="bad.toml")
    msg = error_of(["--config", path])
    assert path in msg and "malformed TOML" in msg and "line 2" in msg


def test_config_flag_errors(tmp_path):
    assert "--config needs a file path" in error_of(["--config"])
    path = write(tmp_path, "")
    assert "--config given twice" in error_of(["--config", path, "--config", path])


# ------------------------------------------------------------------ entry-point helper and help


def test_parse_args_or_exit_error(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args_or_exit(["--training.steps", "abc"])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "training.steps" in lines[0]


def test_parse_args_or_exit_subprocess():
    code = "import sys; from titanlite.config import parse_args_or_exit; parse_args_or_exit(sys.argv[1:])"
    proc = run_python([sys.executable, "-c", code, "--training.lrr", "1"], cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("error: unknown key 'training.lrr'")
    assert "Traceback" not in proc.stderr


def test_parse_args_or_exit_ok():
    cfg = parse_args_or_exit(
        ["--model.name", FAMILY, "--training.steps", "3", "--model.dim", "4"], model_schema=model_schema
    )
    assert cfg.training.steps == 3 and cfg.model.overrides == {"dim": 4}


def test_help(capsys):
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as info:
            parse_args_or_exit(["--training.steps", "abc", flag])
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert out == format_help()
    assert out.startswith("usage: ")
    for f in dataclasses.fields(JobConfig):
        assert f"\n[{f.metadata.get('toml', f.name)}]:\n" in out  # one argument group per section
    flat = " ".join(out.split())  # argparse wraps the help texts to the terminal width
    assert "--training.steps [int] Optimizer steps to train (unless tokens is set). (default 50; >= 1)" in flat
    assert "--job.dump_folder [str]" in flat and '(default "./outputs")' in flat
    assert "--optimizer.lr [float] Peak learning rate. (default 0.0008; > 0.0)" in flat
    assert "--training.deterministic [bool]" in flat and "(default false)" in flat
    assert '(default "auto"; one of auto, fused, foreach, for-loop)' in flat
    assert "--model.<field>" in flat and "titanlite.models.load_config" in flat
    assert "--model.overrides" not in out


def test_help_when_the_model_schema_fails():
    def broken(cfg):
        raise ImportError("no module named\nllama3")

    out = format_help(model_schema=broken)
    assert "--training.steps [int]" in out
    assert "llama3 args fields unavailable: ImportError: no module named llama3" in " ".join(out.split())


def test_help_lists_llama3_args(capsys):
    pytest.importorskip("titanlite.models.llama3")
    out = format_help(model_schema=model_schema)
    assert "\nllama3 args fields (Llama3ModelArgs" in out
    assert "--model.n_layers [int]" in out
    assert "--model.n_kv_heads [int | None]" in out
    with pytest.raises(SystemExit):
        parse_args_or_exit(["-h"], prog="x", model_schema=model_schema)
    assert capsys.readouterr().out == format_help("x", model_schema)


def test_llama3_overrides(tmp_path):
    pytest.importorskip("titanlite.models.llama3")
    cfg = load_config(
        [
            "--model.n_layers",
            "4",
            "--model.n_kv_heads",
            "2",
            "--model.rope_theta",
            "1e4",
            "--model.tie_word_embeddings",
            "--model.ffn_dim_multiplier",
            "1.5",
        ]
    )
    assert cfg.model.name == "llama3"
    assert cfg.model.overrides == {
        "n_layers": 4,
        "n_kv_heads": 2,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "ffn_dim_multiplier": 1.5,
    }
    path = tmp_path / "c.toml"
    dump_config(cfg, path)
    assert load_config(["--config", str(path)]) == cfg
    assert "did you mean 'model.n_heads'?" in error_of(["--model.n_head", "4"])


# ------------------------------------------------------------------ the loader without the model registry, tables


def test_without_model_schema_model_keys_are_errors(tmp_path):
    """titanlite.config.parse_config knows no model families: [model] name/flavor are taken as given, and an
    args field is a one-line error pointing at titanlite.models.load_config."""
    cfg = titanlite.config.parse_config(["--model.name", "not_registered", "--model.flavor", "huge"])
    assert (cfg.model.name, cfg.model.flavor, cfg.model.overrides) == ("not_registered", "huge", {})
    msg = error_of(["--model.n_layers", "4"], loader=titanlite.config.parse_config)
    assert "unknown key 'model.n_layers' on the command line" in msg and "titanlite.models.load_config" in msg
    path = write(tmp_path, "[model]\nn_layers = 4\n")
    msg = error_of(["--config", path], loader=titanlite.config.parse_config)
    assert f"unknown key 'model.n_layers' in config file {path}" in msg and "model_schema" in msg
    msg = error_of(["--model.flavr", "x"], loader=titanlite.config.parse_config)
    assert "did you mean 'model.flavor'?" in msg  # a typo of a [model] key still gets its suggestion
    # a schema passed by hand is the same hook titanlite.models.load_config uses
    cfg = titanlite.config.parse_config(["--model.dim", "5"], model_schema=lambda cfg: TinyArgs)
    assert cfg.model.overrides == {"dim": 5}


def test_tables_applied_before_the_file_and_the_command_line(tmp_path):
    tables = {
        "training": {"steps": 30, "seq_len": 64},
        "model": {"name": FAMILY, "n_layers": 3, "dim": 8},
        "quantize.linear.float8": {"filter_fqns": ["output", "wq"]},  # a dotted section name as one key
        "metrics": {"log_freq": 5},
    }
    path = write(tmp_path, "[training]\nsteps = 40\n[model]\ndim = 16\n")
    cfg = load_config(["--config", path, "--training.seq_len", "32"], tables=tables)
    assert (cfg.training.steps, cfg.training.seq_len, cfg.metrics.log_freq) == (40, 32, 5)
    assert cfg.model.overrides == {"n_layers": 3, "dim": 16}
    assert cfg.quantize_linear_float8.filter_fqns == ["output", "wq"]
    nested = {"quantize": {"linear": {"float8": {"enable": True}}}, "model": {"name": FAMILY}}
    assert load_config(tables=nested).quantize_linear_float8.enable is True
    msg = error_of([], tables={"training": {"stpes": 3}}, tables_source="the translated config")
    assert "unknown key 'training.stpes' in the translated config" in msg and "did you mean 'training.steps'?" in msg
    msg = error_of([], tables={"training": {"steps": "many"}})
    assert "'training.steps' in the given tables" in msg and "integer" in msg


def test_extension_family_keys_through_titanlite_models(tmp_path, monkeypatch):
    """An extension named in [job] extensions registers a family when imported; titanlite.models.load_config
    then accepts and converts the fields of that family's args class, from the file and the command line."""
    (tmp_path / "cfgtest_ext_mod.py").write_text(
        textwrap.dedent("""
        from dataclasses import dataclass
        from titanlite.models import ModelSpec, register_model
        from titanlite.models.llama3.model import Transformer

        @dataclass
        class ExtArgs:
            width: int = 4
            gate: str = "silu"
            scales: list[float] | None = None
            vocab_size: int = 32
            n_layers: int = 1
            max_seq_len: int = 16
            tie_word_embeddings: bool = False

        spec = ModelSpec(name="cfgtest_ext", args_cls=ExtArgs, flavors={"tiny": ExtArgs()}, model_cls=Transformer)
        register_model(spec)  # the model is never built here
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cfgtest_ext_mod", raising=False)
    path = write(
        tmp_path,
        """
        [job]
        extensions = ["cfgtest_ext_mod"]
        [model]
        name = "cfgtest_ext"
        flavor = "tiny"
        width = 1e2
    """,
    )
    cfg = load_config(["--config", path, "--model.scales", "0.5,2", "--model.gate=relu"])
    assert cfg.model.overrides == {"width": 100, "gate": "relu", "scales": [0.5, 2.0]}
    msg = error_of(["--config", path, "--model.widht", "3"])
    assert "neither a [model] key nor a field of ExtArgs" in msg and "did you mean 'model.width'?" in msg
    assert "unknown flavor 'tniy'" in error_of(["--config", path, "--model.flavor", "tniy"])
    assert "did you mean 'tiny'?" in error_of(["--config", path, "--model.flavor", "tniy"])


MIXTURE_ERRORS = {
    'mixture = [{path = "a", weight = 0}]': r"training.mixture\[0\].weight = 0 must be > 0",
    'mixture = [{path = "a"}]': r"training.mixture\[0\] has no 'weight' key",
    "mixture = [{weight = 1.0}]": r"training.mixture\[0\] has no 'path' key",
    'mixture = [{path = "a", weight = 1, wieght = 2}]': r"unknown key 'wieght' in training.mixture\[0\]",
    'mixture = [{path = "a", weight = "x"}]': r"training.mixture\[0\].weight = 'x' must be a number",
    'mixture = [{path = "a/web", weight = 1}, {path = "b/web.jsonl", weight = 1}]': "two sources named 'web'",
    'mixture = [{path = "a", weight = 1, dataset = "parquet"}]': r"mixture\[0\].dataset = 'parquet' must be auto or",
    'mixture = ["a"]': "for 'training.mixture' in config file .*: expected a TOML table",
    'mixture = [{path = "a", weight = 1}]\ndataset = "text"\ndataset_path = "b"': "not both",
    "seq_len_schedule = [{steps = 3}]": r"training.seq_len_schedule\[0\] has no 'seq_len' key",
    "seq_len_schedule = [{seq_len = 64, until = 0.5}]": r"unknown key 'until' in training.seq_len_schedule\[0\]",
    "tokens = 0": "invalid value 0 for 'training.tokens'",
}


@pytest.mark.parametrize("body", list(MIXTURE_ERRORS))
def test_mixture_and_stage_tables_are_checked(body, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\n" + body + "\n")
    with pytest.raises(ConfigError, match=MIXTURE_ERRORS[body]):
        load_config(["--config", str(path)])


def test_mixture_round_trips_through_config_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[training]\nmixture = [{path = "a/web", weight = 0.7}, {dataset = "embedded", weight = 0.3}]\n'
        "seq_len_schedule = [{seq_len = 32, fraction = 0.5}, {seq_len = 64}]\n"
    )
    cfg = load_config(["--config", str(path)])
    assert cfg.training.mixture[1] == {"dataset": "embedded", "weight": 0.3}
    again = tmp_path / "again.toml"
    again.write_text(titanlite.config.config_to_toml(cfg))
    assert load_config(["--config", str(again)]) == cfg


def test_tables_on_the_command_line_are_toml_literals(tmp_path):
    # a list of tables (mixture, seq_len_schedule) is given on the command line as a TOML literal, like in the file
    mixture = '[{path = "a/web", weight = 0.7}, {dataset = "embedded", weight = 0.3}]'
    cfg = load_config(["--training.mixture", mixture, "--training.seq_len_schedule=[{seq_len = 32, steps = 2}]"])
    assert cfg.training.mixture == [{"path": "a/web", "weight": 0.7}, {"dataset": "embedded", "weight": 0.3}]
    assert cfg.training.seq_len_schedule == [{"seq_len": 32, "steps": 2}]
    path = tmp_path / "c.toml"
    path.write_text('[training]\nmixture = [{path = "a", weight = 1}]\n')
    assert load_config(["--config", str(path), "--training.mixture", "[]"]).training.mixture == []
    # the same table checks as in a file, and a broken literal says so
    assert "training.mixture[0].weight = -1 must be > 0" in error_of(["--training.mixture", "[{path='a', weight=-1}]"])
    msg = error_of(["--training.mixture", "[{path = 'a'"])
    assert "'training.mixture' on the command line" in msg and "TOML literal" in msg


def test_an_extension_that_exits_while_imported_is_reported(tmp_path, monkeypatch, capsys):
    """sys.exit() in an extension module ended the run with no word of why; it is now a one-line error."""
    from titanlite.train import main

    (tmp_path / "exiting_ext.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as e:
        main(["--job.extensions", "exiting_ext", "--job.dump_folder", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert "job.extensions: importing 'exiting_ext' called sys.exit(3)" in err[0]
