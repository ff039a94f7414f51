"""torchtitan_ext.compat reads every torchtitan v0.2.0, v0.2.1 and v0.2.2 TOML (issue #13).

The fixtures under ``tests/fixtures/torchtitan`` are data copied from torchtitan: its four shipped llama3
train configs (identical at the three tags) and, per tag, every key its ``job_config.py`` documents set to
that tag's own default. Each translates with no refusal; a default value never warns; seed and
deterministic are carried whichever version's spelling holds them (``[training]`` in v0.2.0, ``[debug]``
from v0.2.1); the v0.2.1+ flavors map onto titanlite's llama3; the flavor's vocabulary is kept so a
torchtitan checkpoint loads; keys that would change the math are still refused.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.helpers.shared_data import shared_file
from titanlite.models.llama3 import Llama3ModelArgs, Transformer
from titanlite.models.registry import model_args_for
from torchtitan_ext.compat import CompatError, load_translated, translate
from torchtitan_ext.compat.checkpoint import load_torchtitan_checkpoint
from torchtitan_ext.compat.train import CompatTrainer, build_torchtitan_lr_scheduler, main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "torchtitan"
SHIPPED = ["debug_model", "llama3_8b", "llama3_70b", "llama3_405b"]
VERSIONS = ["v0.2.0", "v0.2.1", "v0.2.2"]
# What a user adds to run a shipped file here: no HF download, the byte tokenizer.
LOCAL = ["--model.tokenizer_path", "", "--training.dataset", "embedded"]
TINY = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4"]  # titanlite overrides


def seeded_copy(tmp_path: Path, name: str, version: str, seed: int = 1234) -> Path:
    """The fixture with seed and deterministic set where ``version`` keeps them."""
    section = "[training]" if version == "v0.2.0" else "[debug]"
    text = (FIXTURES / f"{name}.toml").read_text()
    lines = f"seed = {seed}\ndeterministic = true"
    if re.search(r"^deterministic = false$", text, flags=re.M):  # the defaults fixtures: in `section` already
        text, lines = re.sub(r"^deterministic = false$", "deterministic = true", text, flags=re.M), f"seed = {seed}"
    if section in text:  # add to the existing table (a TOML table may appear only once)
        text = text.replace(section, f"{section}\n{lines}", 1)
    else:
        text += f"\n{section}\n{lines}\n"
    path = tmp_path / f"{version}_{name}.toml"
    path.write_text(text)
    return path


def warnings_of(tr) -> list[str]:
    """The translation's warnings other than the vocabulary note (the byte tokenizer is smaller)."""
    return [w for w in tr.settings.warnings if "model.vocab_size" not in w]


# ----------------------------------------------------------------------------- the shipped configs


SHIPPED_FLAVOR = {"debug_model": "debugmodel", "llama3_8b": "8B", "llama3_70b": "70B", "llama3_405b": "405B"}
# The 405B file asks for three things titanlite lacks and that do not change the math.
SHIPPED_WARNINGS = {
    "llama3_405b": {
        "parallelism.enable_async_tensor_parallel",
        "quantize.linear.float8.enable_fsdp_float8_all_gather",
        "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
    }
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_llama3_configs_translate_with_seed_and_deterministic(name, version, tmp_path):
    tr = translate(str(seeded_copy(tmp_path, name, version)), LOCAL)
    cfg = load_translated(tr)
    assert (cfg.training.seed, cfg.training.deterministic) == (1234, True)
    assert (cfg.model.name, cfg.model.flavor) == ("llama3", SHIPPED_FLAVOR[name])
    assert {w.split(": ")[1] for w in warnings_of(tr)} == SHIPPED_WARNINGS.get(name, set())
    # values of the file itself, checked against the file
    assert (cfg.training.steps, cfg.training.seq_len) == {
        "debug_model": (10, 2048),
        "llama3_8b": (1000, 8192),
        "llama3_70b": (1000, 8192),
        "llama3_405b": (3000, 8192),
    }[name]
    assert cfg.quantize_linear_float8.filter_fqns == ["output"]
    assert cfg.quantize_linear_float8.enable == (name == "llama3_405b")


def test_seed_and_deterministic_from_the_command_line_in_either_spelling(tmp_path):
    path = str(FIXTURES / "debug_model.toml")
    for args in (["--debug.seed", "7", "--debug.deterministic"], ["--training.seed", "7", "--training.deterministic"]):
        cfg = load_translated(translate(path, [*LOCAL, *args]))
        assert (cfg.training.seed, cfg.training.deterministic) == (7, True), args
    cfg = load_translated(translate(path, LOCAL))
    assert (cfg.training.seed, cfg.training.deterministic) == (0, False)  # torchtitan's None: titanlite's 0


def test_the_translated_toml_carries_the_debug_seed(tmp_path, capsys):
    """The reported case: ``[debug] seed`` was warned about and dropped, so the run used seed 0."""
    path = seeded_copy(tmp_path, "debug_model", "v0.2.2", seed=99)
    main(["--config", str(path), *LOCAL, "--translate-only"])
    out = capsys.readouterr().out
    assert "seed = 99" in out and "deterministic = true" in out


# ----------------------------------------------------------------------------- every documented key


@pytest.mark.parametrize("version", VERSIONS)
def test_every_documented_key_at_its_default_is_accepted_silently(version, tmp_path, caplog):
    """A TOML holding each key of the version at that version's default: no refusal, no warning (a default
    never changes the math), and the seed in that version's location is carried."""
    path = seeded_copy(tmp_path, f"{version}_defaults", version, seed=5)
    with caplog.at_level(logging.WARNING, logger="torchtitan_ext.compat"):
        tr = translate(str(path), LOCAL)
    cfg = load_translated(tr)
    assert warnings_of(tr) == [], warnings_of(tr)
    assert (cfg.training.seed, cfg.training.deterministic) == (5, True)
    # torchtitan's defaults, as titanlite values
    assert (cfg.model.flavor, cfg.training.local_batch_size, cfg.training.seq_len) == ("debugmodel", 8, 2048)
    assert (cfg.profiling.profiler_warmup, cfg.profiling.profiler_active) == (3, 1)
    assert not cfg.job.dry_run


def test_v022_defaults_of_expert_and_moe_keys_are_not_refused(tmp_path):
    """The three keys the issue names, at v0.2.2's defaults and then at other values: llama3 is dense and
    expert / pipeline parallelism are off, so they change nothing (warned, not refused)."""
    path = tmp_path / "tt.toml"
    body = (FIXTURES / "debug_model.toml").read_text()
    path.write_text(body + "\n[debug]\nmoe_force_load_balance = false\n")
    keys = 'pipeline_parallel_expert_parallel_overlap = true\nexpert_parallel_comm_backend = "standard"'
    text = path.read_text().replace("context_parallel_degree = 1", "context_parallel_degree = 1\n" + keys)
    path.write_text(text)
    assert warnings_of(translate(str(path), LOCAL)) == []
    path.write_text(
        text.replace("overlap = true", "overlap = false")
        .replace('"standard"', '"deepep"')
        .replace("moe_force_load_balance = false", "moe_force_load_balance = true")
    )
    warned = {w.split(": ")[1] for w in warnings_of(translate(str(path), LOCAL))}
    assert warned == {
        "parallelism.pipeline_parallel_expert_parallel_overlap",
        "parallelism.expert_parallel_comm_backend",
        "debug.moe_force_load_balance",
    }
    with pytest.raises(CompatError, match="expert parallelism"):  # the feature itself is still refused
        translate(str(path), [*LOCAL, "--parallelism.expert_parallel_degree", "2"])


def test_v020_moe_debug_key_in_training_is_not_refused(tmp_path):
    path = tmp_path / "tt.toml"
    text = (FIXTURES / "debug_model.toml").read_text()
    path.write_text(text.replace("[training]", "[training]\ndebug_moe_force_load_balance = false"))
    assert warnings_of(translate(str(path), LOCAL)) == []


# ----------------------------------------------------------------------------- flavors


@pytest.mark.parametrize(
    "flavor, base",
    [("debugmodel_varlen_attn", "debugmodel_flex_attn"), ("8B_flex", "8B"), ("8B_varlen", "8B")],
)
def test_v021_flavors_map_to_block_causal_llama3(flavor, base):
    """torchtitan defines them as ``base`` with attn_type flex / varlen and attn_mask_type block_causal:
    the same architecture, attention restricted to each document (titanlite's block_causal)."""
    got = load_translated(translate(None, [*LOCAL, "--model.flavor", flavor]))
    want = load_translated(translate(None, [*LOCAL, "--model.flavor", base]))
    assert got.model.flavor == want.model.flavor
    assert got.model.overrides == {**want.model.overrides, "attn_mask_type": "block_causal"}
    args = model_args_for(got.model, 512)
    assert args.attn_mask_type == "block_causal" and args.attn_backend == "auto"
    if base == "8B":  # torchtitan's 8B: dim 4096, 32 layers, 32 heads, 8 KV heads, ffn 14336
        assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.ffn_hidden_dim) == (4096, 32, 32, 8, 14336)


def test_unknown_flavor_lists_the_torchtitan_ones():
    with pytest.raises(CompatError, match="8B_varlen"):
        translate(None, [*LOCAL, "--model.flavor", "13B"])


# ----------------------------------------------------------------------------- tokenizer and vocabulary


def test_empty_tokenizer_path_on_the_command_line_means_the_byte_tokenizer(tmp_path):
    """compat's own error message suggests ``--model.tokenizer_path ''``; it used to become None."""
    path = FIXTURES / "llama3_8b.toml"  # hf_assets_path = "./assets/hf/Llama-3.1-8B": not here
    with pytest.raises(CompatError, match="--model.tokenizer_path ''"):
        translate(str(path), ["--training.dataset", "embedded"])
    for args in (["--model.tokenizer_path", ""], ["--model.tokenizer_path="]):
        cfg = load_translated(translate(str(path), [*args, "--training.dataset", "embedded"]))
        assert cfg.model.tokenizer_path == ""


def test_debugmodel_keeps_torchtitans_vocabulary_and_says_so():
    tr = translate(str(FIXTURES / "debug_model.toml"), LOCAL)
    cfg = load_translated(tr)
    assert cfg.model.overrides["vocab_size"] == 2048
    assert model_args_for(cfg.model, 512).vocab_size == 2048  # the byte tokenizer does not resize it
    assert any("model.vocab_size" in w and "2,048" in w and "512" in w for w in tr.settings.warnings)
    cfg = load_translated(translate(str(FIXTURES / "debug_model.toml"), [*LOCAL, "--model.vocab_size", "600"]))
    assert model_args_for(cfg.model, 512).vocab_size == 600  # an explicit choice wins


def test_a_tokenizer_larger_than_the_flavors_vocabulary_is_refused():
    tok = str(shared_file("tokenizers/test_tiktoken.model"))  # 2,000 ranks + 256 Llama 3 specials
    args = ["--model.tokenizer_path", tok, "--training.dataset", "embedded"]
    with pytest.raises(CompatError, match="2,256 tokens.*--model.vocab_size 2256"):
        translate(str(FIXTURES / "debug_model.toml"), args)
    cfg = load_translated(translate(str(FIXTURES / "debug_model.toml"), [*args, "--model.vocab_size", "2256"]))
    assert cfg.model.tokenizer_path == tok


def test_a_torchtitan_debugmodel_checkpoint_loads_without_vocab_size(tmp_path, monkeypatch):
    """A checkpoint of torchtitan's debugmodel has 2,048 embedding rows whatever the tokenizer; compat's
    model now has the same, so it loads with no --model.vocab_size (weights equal bit for bit)."""
    import titanlite.trainer.metrics as metrics

    monkeypatch.setattr(metrics, "peak_flops", lambda *args, **kwargs: 1e11)  # MFU is not under test
    torch.manual_seed(3)  # torchtitan's debugmodel at TINY's size: 2,048 embedding and output rows
    saved = Transformer(Llama3ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=2048, max_seq_len=2048))
    dcp.save(dict(saved.state_dict()), checkpoint_id=str(tmp_path / "step-10"), no_dist=True)

    small = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path / "o")]
    tr = translate(str(FIXTURES / "debug_model.toml"), [*LOCAL, *TINY, *small])
    trainer = CompatTrainer(load_translated(tr), settings=tr.settings)
    out = load_torchtitan_checkpoint(tmp_path / "step-10", trainer.model, model_only=True)
    assert "model" in out["loaded"]
    for (name, a), b in zip(saved.state_dict().items(), trainer.model.state_dict().values()):
        assert torch.equal(a, b), name


# ----------------------------------------------------------------------------- other v0.2.x keys


def test_lr_total_steps_sets_the_schedule_length():
    """v0.2.2's lr_scheduler.total_steps: the LR curve of a 20-step run over 10 training steps. By hand:
    warmup 2 -> (i+1)/2; decay 18, stable 20 + 1 - 2 - 18 = 1; then 1 - (i+1-3)/18."""
    args = [*LOCAL, "--lr_scheduler.total_steps", "20", "--lr_scheduler.decay_ratio", "none"]
    tr = translate(str(FIXTURES / "debug_model.toml"), args)
    cfg = load_translated(tr)
    assert (cfg.training.steps, tr.settings.lr_total_steps) == (10, 20)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_torchtitan_lr_scheduler(opt, cfg, tr.settings.lr_total_steps)
    got = [sched.lr_lambdas[0](i) for i in range(6)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 1 - 1 / 18, 1 - 2 / 18, 1 - 3 / 18])
    assert translate(str(FIXTURES / "debug_model.toml"), LOCAL).settings.lr_total_steps is None


def test_compile_backend_carries_over_and_an_unknown_one_is_one_line():
    path = str(FIXTURES / "debug_model.toml")
    assert load_translated(translate(path, LOCAL)).compile.backend == "inductor"  # torchtitan's default
    assert load_translated(translate(path, [*LOCAL, "--compile.backend", "aot_eager"])).compile.backend == "aot_eager"
    with pytest.raises(Exception, match="compile.backend") as info:
        load_translated(translate(path, [*LOCAL, "--compile.backend", "cudagraphs"]))
    assert "\n" not in str(info.value)


def test_memory_estimation_points_at_the_dry_run_and_fake_backend_is_one(caplog):
    path = str(FIXTURES / "debug_model.toml")
    with caplog.at_level(logging.WARNING, logger="torchtitan_ext.compat"):
        tr = translate(path, [*LOCAL, "--memory_estimation.enable"])
    assert any("memory_estimation.enable" in w and "--job.dry_run true" in w for w in tr.settings.warnings)
    assert not load_translated(tr).job.dry_run  # torchtitan's trainer trains with it: so does titanlite
    cfg = load_translated(translate(path, [*LOCAL, "--comm.mode", "fake_backend"]))
    assert cfg.job.dry_run


def test_data_loader_and_ac_debug_keys_warn_and_memory_budget_is_full_ac(tmp_path):
    path = tmp_path / "tt.toml"
    text = (FIXTURES / "debug_model.toml").read_text()
    text = text.replace('mode = "selective"', 'mode = "memory_budget"\nmemory_budget = 0.3\npreserve_rng_state = true')
    path.write_text(text + "\n[training.dataloader]\nnum_workers = 4\npin_memory = true\n")
    tr = translate(str(path), LOCAL)
    warned = {w.split(": ")[1] for w in warnings_of(tr)}
    assert warned == {
        "training.dataloader.num_workers",
        "training.dataloader.pin_memory",
        "activation_checkpoint.memory_budget",
        "activation_checkpoint.mode",
    }  # preserve_rng_state = true is v0.2.2's default: silent
    assert load_translated(tr).activation_checkpoint.mode == "full"


def test_float8_filter_default_is_torchtitans_empty_list(tmp_path):
    path = tmp_path / "tt.toml"
    path.write_text('[model]\nconverters = ["float8"]\n')
    assert load_translated(translate(str(path), LOCAL)).quantize_linear_float8.filter_fqns == []


REFUSED = {
    "full bf16 training": ("--training.dtype", "bfloat16", "float32 master"),
    "plug-in config module": ("--job.custom_config_module", "my.config", "plug-in code"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_math_changing_v02_keys_are_refused_in_one_line(case, capsys):
    key, value, message = REFUSED[case]
    args = ["--config", str(FIXTURES / "debug_model.toml"), *LOCAL, key, value]
    with pytest.raises(CompatError, match=message):
        translate(args[1], args[2:])
    with pytest.raises(SystemExit) as e:
        main([*args, "--translate-only"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: ") and "\n" not in err


def test_two_spellings_of_the_seed_must_agree(tmp_path):
    path = tmp_path / "tt.toml"
    path.write_text("[training]\nseed = 1\n[debug]\nseed = 2\n")
    with pytest.raises(CompatError, match=r"training.seed=1 and debug.seed=2 .*keep one"):
        translate(str(path), LOCAL)
    path.write_text("[training]\nseed = 3\n[debug]\nseed = 3\n")
    assert load_translated(translate(str(path), LOCAL)).training.seed == 3
    path.write_text("[training]\nseed = 1\n")  # the command line overrides the file, whatever the spelling
    assert load_translated(translate(str(path), [*LOCAL, "--debug.seed", "4"])).training.seed == 4


# ----------------------------------------------------------------------------- pipeline parallelism


def test_pipeline_keys_map_one_to_one_and_the_trainer_accepts_them(tmp_path):
    """The debug fixture already names Interleaved1F1B (with degree 1, where torchtitan and compat ignore it);
    degree 2 turns it on: degree, schedule, microbatch size and the split reach titanlite unchanged, and the
    trainer's own PipelinePlan and the dry run accept them."""
    from titanlite.parallel.pipeline import PipelinePlan
    from titanlite.plan.dry_run import dry_run

    path = FIXTURES / "debug_model.toml"
    off = load_translated(translate(str(path), LOCAL)).parallelism
    assert off.pipeline_parallel_degree == 1 and off.pipeline_parallel_schedule == "1F1B"  # ignored at degree 1
    args = [
        *LOCAL,
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
    ]
    tr = translate(str(path), args)
    assert warnings_of(tr) == []
    cfg = load_translated(tr)
    par = cfg.parallelism
    assert (par.pipeline_parallel_degree, par.pipeline_parallel_schedule, par.pipeline_parallel_microbatch_size) == (
        2,
        "Interleaved1F1B",
        2,
    )
    assert (par.pipeline_parallel_layers_per_stage, par.pipeline_parallel_split_points) == (-1, [])  # torchtitan's None
    plan = PipelinePlan.from_config(par, 6, cfg.training.local_batch_size)  # torchtitan's debugmodel: 6 layers
    assert (plan.num_stages, plan.n_microbatches) == (4, 4)
    report = dry_run(
        load_translated(translate(str(path), [*args, "--job.dry_run_world_size", "2"])), out=lambda x: None
    )
    assert [k["stages"] for k in report["pipeline"]["ranks"]] == [[0, 2], [1, 3]]
    # the split, from the file (split points), and a lower-case schedule
    text = path.read_text().replace(
        "pipeline_parallel_degree = 1", 'pipeline_parallel_degree = 2\npipeline_parallel_split_points = ["layers.3"]'
    )
    (tmp_path / "pp.toml").write_text(text.replace('"Interleaved1F1B"', '"gpipe"'))
    par = load_translated(translate(str(tmp_path / "pp.toml"), LOCAL)).parallelism
    assert (par.pipeline_parallel_schedule, par.pipeline_parallel_split_points) == ("GPipe", ["layers.3"])


PP_REFUSED = {
    "layers per stage": ("--parallelism.pipeline_parallel_layers_per_stage 3", "layers_per_stage=3: torchtitan counts"),
    "first stage weighting": ("--parallelism.pipeline_parallel_first_stage_less_layers 2", "first_stage_less_layers=2"),
    "last stage weighting": ("--parallelism.pipeline_parallel_last_stage_less_layers 0", "last_stage_less_layers=0"),
    "schedule from a CSV": ("--parallelism.pipeline_parallel_schedule_csv sched.csv", "schedule_csv"),
    "unknown schedule": ("--parallelism.pipeline_parallel_schedule LoopedBFS", "'LoopedBFS'"),
    "module lists per stage": ("--parallelism.module_fqns_per_model_part tok_embeddings", "module_fqns_per_model_part"),
}


@pytest.mark.parametrize("case", list(PP_REFUSED))
def test_pipeline_keys_titanlite_lacks_are_refused_in_one_line(case, capsys):
    option, message = PP_REFUSED[case]
    args = [*LOCAL, "--parallelism.pipeline_parallel_degree", "2", *option.split(" ", 1)]
    path = str(FIXTURES / "debug_model.toml")
    with pytest.raises(CompatError, match=message):
        translate(path, args)
    with pytest.raises(SystemExit) as e:
        main(["--config", path, *args, "--translate-only"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: ") and "\n" not in err and message.strip("'") in err
    # at degree 1 torchtitan never reads them: nothing is refused
    load_translated(translate(path, [*LOCAL, *option.split(" ", 1)]))


def test_translate_only_needs_no_tokenizer_or_data_flags(tmp_path, capsys):
    """torchtitan's llama3_8b.toml as shipped (an hf_assets_path that is not on this machine, the c4 dataset
    from the Hub): --translate-only prints the titanlite config with warnings, and training it says what to give."""
    path = str(FIXTURES / "llama3_8b.toml")
    main(["--config", path, "--translate-only"])
    captured = capsys.readouterr()
    assert 'dataset = "shards"' in captured.out and 'dataset_path = "<shards prepared from c4' in captured.out
    assert "tokenizer_path = " in captured.out
    assert "cannot read tokenizer.json" not in captured.err and "not tokenizer.json" not in captured.err
    with pytest.raises(SystemExit) as e:  # training (not just translating) still needs them
        main(["--config", path, "--job.dry_run", "true"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "not tokenizer.json" not in err and ("tokenizer" in err or "dataset" in err)


def test_a_torchtitan_assets_folder_with_only_tokenizer_json_is_read(tmp_path):
    """torchtitan's download script leaves tokenizer.json (+ tokenizer_config.json) in hf_assets_path."""
    from tests.helpers.hf_tokenizers import convert

    folder = convert(shared_file("tokenizers/test_tiktoken.model"), tmp_path / "assets").parent
    path = str(FIXTURES / "debug_model.toml")
    args = ["--model.hf_assets_path", str(folder), "--training.dataset", "embedded", "--model.vocab_size", "2304"]
    cfg = load_translated(translate(path, args))
    assert cfg.model.tokenizer_path == str(folder / "tokenizer.json")
