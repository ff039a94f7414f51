"""Model args of a seed checkpoint (``[checkpoint] initial_load_path``), and seq_len against max_seq_len.

- The rule (:func:`titanlite.models.registry.adopt_seed_args`, a pure function): every field the
  seed's ``checkpoint.json`` records is taken, except run args (rotary-table length, attention
  kernel and mask, init) and fields the config sets explicitly; an explicit value that differs is
  a one-line error naming the key, both values and the seed; fields that set tensor shapes are taken
  too, so a seed needs no ``[model]`` keys (the flavor is only the default of what it does not record).
- What counts as explicit: ``model.overrides`` as the config loader fills it ([model] keys and
  ``--model.*`` options), not the flavor's defaults.
- :func:`titanlite.checkpoint.seed_args.model_args_from_seed` reads the seed folder (missing folder or
  ``checkpoint.json``: nothing taken; another family: error).
- ``training.seq_len`` above ``max_seq_len`` is refused when the trainer is built, for Llama 3 and
  the Qwen3 extension, through the command line (exit status 2, one line).

The end-to-end case (a Hugging Face Llama with RoPE scaling, converted and trained from under a
config without it, gives transformers' logits) is in ``test_hf_conversion.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.launch import run_python
from titanlite.checkpoint import layout
from titanlite.checkpoint.seed_args import model_args_from_seed
from titanlite.models import get_model_spec, load_config
from titanlite.models.registry import RUN_ARGS, adopt_seed_args, check_seq_len, model_args_for, state_shapes

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Args:
    dim: int = 8
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 128


def shapes_of(a: Args, b: Args) -> bool:
    return a.dim == b.dim  # in this toy family only dim sets a tensor shape


def adopt(args: Args, seed: dict, explicit=()):
    return adopt_seed_args(args, seed, explicit, run_args=("max_seq_len",), same_shapes=shapes_of, seed="SEED")


def test_seed_values_are_taken_unless_the_config_sets_them():
    seed = {"dim": 8, "rope_theta": 10000.0, "norm_eps": 1e-6, "max_seq_len": 64}
    args, taken = adopt(Args(), seed)
    assert args == Args(rope_theta=10000.0, norm_eps=1e-6) and taken == {"rope_theta": 10000.0, "norm_eps": 1e-6}
    # an explicit value equal to the seed's is fine; run args are never taken, explicit or not
    args, taken = adopt(Args(rope_theta=10000.0), seed, explicit={"rope_theta", "max_seq_len"})
    assert args == Args(rope_theta=10000.0, norm_eps=1e-6) and taken == {"norm_eps": 1e-6}
    assert adopt(Args(max_seq_len=4096), seed, explicit={"max_seq_len"})[0].max_seq_len == 4096
    # the same values: nothing to take; fields the seed does not record are not compared
    assert adopt(Args(), {"dim": 8}) == (Args(), {})


def test_an_explicit_value_that_differs_from_the_seed_is_a_one_line_error():
    with pytest.raises(ValueError) as e:
        adopt(Args(rope_theta=500000.0), {"rope_theta": 10000.0}, explicit={"rope_theta"})
    msg = str(e.value)
    assert "\n" not in msg and "model.rope_theta=500000.0" in msg and "rope_theta=10000.0" in msg and "SEED" in msg


def test_a_seed_of_other_shapes_is_taken_and_bad_seeds_are_refused():
    taken = {"dim": 16, "rope_theta": 10000.0}
    assert adopt(Args(), taken) == (Args(dim=16, rope_theta=10000.0), taken)
    with pytest.raises(ValueError, match="model.dim=8 is set in the config but the checkpoint SEED has dim=16"):
        adopt(Args(), taken, explicit={"dim"})  # an explicit shape that differs is refused, naming the seed's
    with pytest.raises(ValueError, match="SEED has model args unknown to this titanlite: n_experts"):
        adopt(Args(), {"n_experts": 8})


def test_explicit_means_set_in_the_config_not_the_flavor_default(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[model]\nflavor = "debugmodel"\nnorm_eps = 1e-6\n')
    cfg = load_config(["--config", str(toml), "--model.rope_theta", "1e4"])
    assert cfg.model.overrides == {"norm_eps": 1e-6, "rope_theta": 10000.0}  # the flavor's other args are not in it


def write_seed(folder: Path, name: str, args) -> Path:
    folder.mkdir(parents=True)
    model_args = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else args
    layout.write_info(
        folder, {"step": 0, "model_only": True, "model": {"name": name, "flavor": None, "args": model_args}}
    )
    return folder


def test_model_args_from_a_seed_folder(tmp_path, caplog):
    spec = get_model_spec("llama3")
    cfg = load_config(
        ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.rope_theta", "5e5"]
    )
    args = model_args_for(cfg.model, 512)
    scaled = dataclasses.replace(args, rope_scaling_factor=8.0, rope_original_max_position=64, norm_eps=1e-6)
    seed = write_seed(tmp_path / "seed", "llama3", dataclasses.replace(scaled, max_seq_len=256, attn_backend="sdpa"))
    with caplog.at_level(logging.INFO, logger="titanlite"):
        got = model_args_from_seed(spec, args, cfg.model.overrides, seed)
    assert got == scaled  # max_seq_len and attn_backend stay this run's
    for key in ("rope_scaling_factor", "rope_original_max_position", "norm_eps"):
        assert f"model.{key} = " in caplog.text and str(seed) in caplog.text
    # explicit and different: one line, naming the key, both values and the seed
    conflict = write_seed(tmp_path / "conflict", "llama3", dataclasses.replace(args, rope_theta=10000.0))
    with pytest.raises(ValueError) as e:
        model_args_from_seed(spec, args, cfg.model.overrides, conflict)
    msg = str(e.value)
    assert (
        "\n" not in msg and "model.rope_theta=500000.0" in msg and "rope_theta=10000.0" in msg and str(conflict) in msg
    )
    # another shape (dim 128): taken with the rest, unless the config sets it
    wide = write_seed(tmp_path / "wide", "llama3", dataclasses.replace(scaled, dim=128, rope_theta=5e5))
    assert model_args_from_seed(spec, args, {}, wide) == dataclasses.replace(scaled, dim=128)
    with pytest.raises(ValueError, match=r"model.dim=64 is set in the config but the checkpoint .* has dim=128"):
        model_args_from_seed(spec, args, cfg.model.overrides, wide)  # set explicitly: named, not left to shapes
    assert state_shapes(spec, args) != state_shapes(spec, dataclasses.replace(args, dim=128))
    # a tied seed into an untied flavor: tying is not visible in tensor shapes, so it is taken
    tied = write_seed(tmp_path / "tied", "llama3", dataclasses.replace(args, tie_word_embeddings=True))
    assert model_args_from_seed(spec, args, {}, tied).tie_word_embeddings is True
    # no folder (the manager reports it), a DCP folder from elsewhere: nothing to take
    assert model_args_from_seed(spec, args, {}, tmp_path / "nope") == args
    (tmp_path / "foreign").mkdir()
    assert model_args_from_seed(spec, args, {}, tmp_path / "foreign") == args
    with pytest.raises(ValueError, match="holds a 'qwen3' model but this config trains 'llama3'"):
        model_args_from_seed(spec, args, {}, write_seed(tmp_path / "q", "qwen3", {"dim": 64}))
    bad = write_seed(tmp_path / "bad", "llama3", {"norm_eps": "tiny"})
    with pytest.raises(ValueError, match="invalid model args"):
        model_args_from_seed(spec, args, {}, bad)
    (bad / "checkpoint.json").write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ValueError, match=r"checkpoint.initial_load_path=.*checkpoint.json is unreadable"):
        model_args_from_seed(spec, args, {}, bad)
    assert set(RUN_ARGS) <= {f.name for f in dataclasses.fields(args)}


def test_seq_len_is_checked_against_max_seq_len():
    args = model_args_for(load_config(["--model.max_seq_len", "64"]).model, 512)
    check_seq_len(args, 64)  # the whole table is usable
    with pytest.raises(ValueError, match=r"training.seq_len=65 is longer than the model's max_seq_len=64"):
        check_seq_len(args, 65)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_seq_len_above_max_seq_len_fails_when_the_trainer_is_built(family, tmp_path):
    extra = ["--job.extensions", "torchtitan_ext.qwen3", "--model.name", "qwen3"] if family == "qwen3" else []
    argv = ["--training.seq_len", "96", "--model.max_seq_len", "64", "--job.dump_folder", str(tmp_path), *extra]
    proc = run_python(
        [sys.executable, "-m", "titanlite.train", *argv],
        cwd=REPO,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0] == (
        "error: training.seq_len=96 is longer than the model's max_seq_len=64 (model.max_seq_len, the length "
        "of its rotary table): lower training.seq_len or raise model.max_seq_len"
    )


def hf_seed_folder(folder: Path, **args) -> Path:
    """An HF model folder's config.json (all model_args_from_seed reads) for llama3 args."""
    import json

    import torch

    from titanlite.models.llama3 import Llama3HFAdapter, Llama3ModelArgs

    folder.mkdir(parents=True)
    config = Llama3HFAdapter(Llama3ModelArgs(**args)).hf_config(dtype=torch.float32)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_an_hf_seed_of_the_configured_swiglu_size_is_not_a_conflict(tmp_path):
    """config multiple_of = 64, ffn_dim_multiplier = 1.5 give 256 = the seed's intermediate_size (recorded as
    debugmodel's multiple_of = 256, no multiplier): the same model, no error (it was refused, and the advice to
    drop model.multiple_of led to a shape error). A really different size names the checkpoint's values to set."""
    spec = get_model_spec("llama3")
    small = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4"]
    seed = hf_seed_folder(tmp_path / "hf", dim=64, n_layers=2, n_heads=4, vocab_size=512, multiple_of=256)
    cfg = load_config([*small, "--model.multiple_of", "64", "--model.ffn_dim_multiplier", "1.5"])
    args = model_args_for(cfg.model, 512)
    got = model_args_from_seed(spec, args, cfg.model.overrides, seed)
    assert (got.multiple_of, got.ffn_dim_multiplier, got.ffn_hidden_dim) == (64, 1.5, 256)
    assert state_shapes(spec, got) == state_shapes(
        spec, dataclasses.replace(args, multiple_of=256, ffn_dim_multiplier=None)
    )
    other = load_config([*small, "--model.multiple_of", "96"])  # 192
    with pytest.raises(ValueError) as e:
        model_args_from_seed(spec, model_args_for(other.model, 512), other.model.overrides, seed)
    msg = str(e.value)
    assert "model.multiple_of=96 is set in the config" in msg and "set model.multiple_of=256 (the checkpoint's)" in msg
    assert "drop" not in msg
    fixed = load_config([*small, "--model.multiple_of", "256"])  # the advice, followed
    assert (
        model_args_from_seed(spec, model_args_for(fixed.model, 512), fixed.model.overrides, seed).ffn_hidden_dim == 256
    )


def test_a_seed_smaller_than_the_tokenizer_is_refused(tmp_path):
    spec = get_model_spec("llama3")
    args = model_args_for(load_config([]).model, 512)
    seed = write_seed(tmp_path / "seed", "llama3", dataclasses.replace(args, vocab_size=300))
    with pytest.raises(ValueError, match=r"has vocab_size=300, smaller than the tokenizer's vocabulary \(512"):
        model_args_from_seed(spec, args, {}, seed)


def test_a_qwen3_moe_seed_keeps_its_dense_blocks_and_its_balancing_is_named(tmp_path, caplog):
    """The debugmodel flavor makes block 0 dense (``mlp_only_layers = [0]``) and balances with 1e-3: a seed with every
    block sparse and another coefficient trains with its own blocks, and the coefficient this run keeps is logged
    with the seed's."""
    import torchtitan_ext.qwen3_moe  # noqa: F401  (registers the family)

    spec = get_model_spec("qwen3_moe")
    cfg = load_config(["--model.name", "qwen3_moe"])
    args = model_args_for(cfg.model, 512)
    assert args.mlp_only_layers == [0] and args.moe_aux_loss_coef == 1e-3
    seed = write_seed(
        tmp_path / "seed", "qwen3_moe", dataclasses.replace(args, mlp_only_layers=[], moe_aux_loss_coef=0.01)
    )
    with caplog.at_level(logging.INFO, logger="titanlite"):
        got = model_args_from_seed(spec, args, cfg.model.overrides, seed)
    assert got.mlp_only_layers == [] and all(got.is_moe_layer(i) for i in range(got.n_layers))
    assert "model.mlp_only_layers = [] from the seed checkpoint" in caplog.text
    assert "model.moe_aux_loss_coef = 0.001 is this run's" in caplog.text and "has 0.01" in caplog.text
