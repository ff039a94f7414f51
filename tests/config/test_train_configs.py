"""Every shipped train config: it loads and validates, builds its model on the meta device, and its
parallel layout is checked at its stated world size by the dry run (fake process group).

Shipped configs: ``train_configs/*.toml`` and ``torchtitan_ext/configs/*.toml``. For each: the
header comments say which hardware it is tuned for; ``[job] world_size`` states the world size;
the dry run at that size must succeed with the expected degrees, the expected model size, every
rank's parameters adding up to the model once per replica, the expected tokens per step, and a
memory estimate that fits the stated GPU.
"""

from __future__ import annotations

import pytest

from tests.helpers.dist import REPO
from titanlite.models import load_config
from titanlite.plan.dry_run import dry_run

CONFIGS = sorted(
    str(p.relative_to(REPO))
    for p in [*(REPO / "train_configs").glob("*.toml"), *(REPO / "torchtitan_ext" / "configs").glob("*.toml")]
)
# config -> (dp_replicate, dp_shard, tp), parameters, tokens per optimizer step (pipeline degrees in PIPELINED)
EXPECTED = {
    "train_configs/debug_model.toml": ((1, 1, 1), 4_984_064, 16 * 256),
    "train_configs/debug_midtrain.toml": ((1, 1, 1), 4_984_064, 16 * 256),
    "train_configs/debug_sft.toml": ((1, 1, 1), 4_984_064, 16 * 256),
    "train_configs/llama1b.toml": ((1, 8, 1), 1_235_814_400, 512 * 2048),
    "train_configs/llama3b.toml": ((1, 8, 1), 3_212_749_824, 512 * 2048),
    "train_configs/llama8b.toml": ((4, 8, 1), 8_030_261_248, 512 * 8192),
    "train_configs/llama8b_128k.toml": ((4, 1, 1), 8_030_261_248, 32 * 131072),  # and context parallelism 8
    "train_configs/llama70b.toml": ((1, 8, 8), 70_553_706_496, 512 * 8192),
    "train_configs/llama405b.toml": ((1, 8, 8), 405_853_388_800, 1024 * 8192),
    "torchtitan_ext/configs/qwen3_debug.toml": ((1, 1, 1), 4_066_048, 16 * 256),
    "train_configs/debug_moe.toml": ((1, 1, 1), 10_892_544, 8 * 256),
    "train_configs/qwen3_30b_a3b.toml": ((1, 64, 1), 30_532_122_624, 512 * 4096),
    "train_configs/deepseek_v3_671b.toml": ((1, 32, 1), 671_030_277_120, 1024 * 4096),
}
PIPELINED = {
    "train_configs/llama405b.toml": 8,
    "train_configs/deepseek_v3_671b.toml": 16,
}  # config -> pipeline_parallel_degree (1 when not listed)


def test_every_shipped_config_is_listed():
    assert set(CONFIGS) == set(EXPECTED), "add new shipped configs to EXPECTED"


def load(path: str):
    return load_config(
        ["--config", str(REPO / path)]
    )  # imports [job] extensions (qwen3); strict: unknown keys, bad values and cross-field rules raise


@pytest.mark.parametrize("path", CONFIGS)
def test_config_validates_and_says_what_it_is_tuned_for(path):
    cfg = load(path)
    assert cfg.job.world_size >= 1, f"{path}: state the world size it is tuned for ([job] world_size)"
    header = []
    for line in (REPO / path).read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    text = "\n".join(header)
    assert len(header) >= 3 and ("H100" in text or "CPU" in text), f"{path}: header must say the hardware"
    if cfg.job.world_size > 1:
        assert "Tuned for" in text and "Why these numbers" in text, path


@pytest.fixture(scope="module")
def dry_runs():
    """Every config's dry run, in this process, one after the other (each creates and destroys its own fake
    process group; loading a config imports its [job] extensions)."""
    return {path: dry_run(load(path), out=lambda line: None) for path in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS)
def test_config_dry_runs_at_its_stated_world_size(path, dry_runs):
    r = dry_runs[path]
    degrees, params, tokens = EXPECTED[path]
    stated = load(path).job.world_size
    assert (r["world_size"], r["world_size_source"]) == (stated, "job.world_size")
    assert (r["degrees"]["dp_replicate"], r["degrees"]["dp_shard"], r["degrees"]["tp"]) == degrees
    assert r["params"] == params and r["tokens_per_step"] == tokens
    assert r["fits"] is True
    rep, shard, tp = degrees
    pp = PIPELINED.get(path, 1)
    assert r["degrees"]["pp"] == pp and (r["pipeline"] is None) == (pp == 1)
    assert len(r["per_rank"]) == stated
    # each model replica (one dp_replicate group: in every pp rank, the ranks of replica 0) holds every
    # parameter exactly once, except the parameters TP replicates (the RMSNorm gains), held once per TP rank
    replicated_by_tp = sum(g["numel"] for g in r["groups"] if g["placements"].endswith("tp:Replicate"))
    block = shard * r["degrees"].get("cp", 1) * tp  # ranks of one replica within one pp rank (pp, dp_replicate out)
    per_replica = sum(sum(r["per_rank"][k * rep * block : k * rep * block + block]) for k in range(pp))
    assert per_replica == params + (tp - 1) * replicated_by_tp
    assert sum(r["per_rank"]) == rep * per_replica
    if pp > 1:  # every pp rank's stages, together the whole model, and each stage fits
        ranks = r["pipeline"]["ranks"]
        assert len(ranks) == pp and sum(k["params"] for k in ranks) == params
        assert all(k["fits"] for k in ranks)


def test_a_bare_name_is_a_shipped_recipe_unless_such_a_file_exists(tmp_path, monkeypatch, capsys):
    """The package's recipes are train_configs/ itself (the same files, byte for byte); ``--config llama1b`` or
    ``llama1b.toml`` run from another folder loads it, a file of that name where the command runs wins, an unknown
    name is one line listing the recipes, and ``--list-configs`` lists each with its description."""
    from titanlite.config import ConfigError, parse_args_or_exit
    from titanlite.config.shipped import shipped_configs

    ours = {p.stem: p.read_bytes() for p in sorted((REPO / "train_configs").glob("*.toml"))}
    assert {name: path.read_bytes() for name, path in shipped_configs().items()} == ours
    monkeypatch.chdir(tmp_path)
    by_path = load_config(["--config", str(REPO / "train_configs" / "llama1b.toml")])
    assert load_config(["--config", "llama1b"]) == by_path == load_config(["--config", "llama1b.toml"])
    (tmp_path / "llama1b.toml").write_text('[job]\ndescription = "mine"\n')
    assert load_config(["--config", "llama1b.toml"]).job.description == "mine"
    with pytest.raises(ConfigError, match=r"config file llama2 not found, and no shipped recipe is named 'llama2' "):
        load_config(["--config", "llama2"])
    with pytest.raises(ConfigError, match="config file sub/debug_model.toml not found"):
        load_config(["--config", "sub/debug_model.toml"])  # a path is a path
    with pytest.raises(SystemExit) as e:
        parse_args_or_exit(["--list-configs"])
    listed = capsys.readouterr().out.splitlines()
    assert e.value.code == 0 and [line.split()[0] for line in listed] == list(ours)
    assert "llama1b              Llama 3.2 1B from scratch, 20B tokens, 8 x H100" in listed
