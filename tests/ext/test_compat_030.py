"""torchtitan 0.3.0 checkpoints: compat resumes them exactly, the DCP -> HF converter exports them.

The fixture writes a DCP folder in torchtitan 0.3.0's layout (pinned from its sources, at the
``0.3.0rc1`` version commit): model keys ``layers.N.attention.qkv_linear.w{q,k,v}.weight`` and
``lm_head.weight`` (the fused module's state-dict hook splits ``wqkv`` on save), AdamW state keyed by
the *parameter* ``layers.N.attention.qkv_linear.wqkv.weight`` whose rows are grouped per kv head
``[q heads of g; k head g; v head g]``, ``lr_scheduler.last_epoch``, ``train_state.{step,
ntokens_seen}`` and ``dataloader.*``. The references are independent of the library: the same
weights saved in the v0.2 layout, and a forward written here the way torchtitan 0.3.0 computes it
(one fused projection split per kv group, complex RoPE with Llama 3.1 scaling, SDPA with GQA).
"""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from tests.helpers.compat import FLAT, TINY, compat_trainer, take_steps, torchtitan_toml, write_torchtitan_checkpoint
from tests.helpers.dist import run_workers
from tests.helpers.launch import run_python
from tests.helpers.peaks import skip_peak_measurement
from titanlite.checkpoint import safe_load
from titanlite.checkpoint.hf_export import dcp_to_hf
from titanlite.models.llama3.args import Llama3ModelArgs
from titanlite.models.llama3.model import Transformer
from torchtitan_ext.compat import load_translated, translate
from torchtitan_ext.compat.checkpoint import describe, load_torchtitan_checkpoint, split_fused_qkv
from torchtitan_ext.compat.train import CompatTrainer

REPO = Path(__file__).resolve().parents[2]
GQA = [*TINY, "--model.n_kv_heads", "2"]  # 4 query heads over 2 kv heads: the fused grouping matters


# ----------------------------------------------------------------------------- the 0.3.0 layout


def fuse_030(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
    """torchtitan 0.3.0's fused ``wqkv`` rows from stock q/k/v rows, block by block."""
    hd, per = k.shape[0] // n_kv, n_heads // n_kv
    rows = []
    for g in range(n_kv):
        rows += [q[g * per * hd : (g + 1) * per * hd], k[g * hd : (g + 1) * hd], v[g * hd : (g + 1) * hd]]
    return torch.cat(rows)


def name_030(fqn: str, fused: bool) -> str:
    """torchtitan 0.3.0's name for a titanlite parameter (``fused``: the optimizer's parameter name)."""
    parts = fqn.split(".")
    if fqn == "output.weight":
        return "lm_head.weight"
    if parts[2:3] == ["attention"] and parts[3] in ("wq", "wk", "wv"):
        return f"layers.{parts[1]}.attention.qkv_linear.{'wqkv' if fused else parts[3]}.weight"
    return fqn


def states_030(model_sd: dict, osd: dict, n_heads: int, n_kv: int, fused: bool) -> tuple[dict, dict]:
    """(model keys, flat optimizer keys) as torchtitan 0.3.0's ModelWrapper / OptimizersContainer give them."""
    model = {name_030(k, fused=False): v for k, v in model_sd.items()}
    optim: dict = {}
    for key, value in osd.items():
        kind, rest = key.split(".", 1)
        fqn, leaf = rest.rsplit(".", 1)
        proj = fqn.split(".")[3] if ".attention.w" in fqn else ""
        if fused and proj in ("wk", "wv"):
            continue  # folded into wq's entry below
        if fused and proj == "wq" and kind == "state" and leaf != "step":
            parts = [osd[key.replace(".wq.", f".{p}.")] for p in ("wq", "wk", "wv")]
            value = fuse_030(*parts, n_heads, n_kv)
        optim[f"{kind}.{name_030(fqn, fused)}.{leaf}"] = value
    return model, optim


def write_030_checkpoint(path: Path, trainer, fused: bool = True) -> None:
    """A DCP folder exactly as torchtitan 0.3.0's CheckpointManager lays out a full save."""
    args = trainer.model.args
    osd = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=FLAT)
    model, optim = states_030(get_model_state_dict(trainer.model), osd, args.n_heads, args.kv_heads, fused)
    states = {
        **model,
        "optimizer": optim,
        "lr_scheduler": {"last_epoch": trainer.lr_scheduler.last_epoch},
        "train_state": {"step": trainer.state.step, "ntokens_seen": trainer.state.tokens_seen},
        "dataloader": {"world_size": 1, "dp_rank_0": pickle.dumps({"sample_idx": 7})},
    }
    dcp.save(states, checkpoint_id=str(path), no_dist=True)


@pytest.mark.usefixtures("no_peak_probe")
def test_fixture_pins_torchtitan_030_keys(tmp_path):
    trainer = compat_trainer(torchtitan_toml(tmp_path), [*GQA, "--checkpoint.enable_checkpoint", "false"])
    take_steps(trainer, iter(trainer.train_loader), 1)
    write_030_checkpoint(tmp_path / "ckpt", trainer)
    keys = safe_load.read_metadata(tmp_path / "ckpt").state_dict_metadata
    dim, vocab, hidden = 64, trainer.model.args.vocab_size, trainer.model.args.ffn_hidden_dim
    shapes = {"tok_embeddings.weight": [vocab, dim], "norm.weight": [dim], "lm_head.weight": [vocab, dim]}
    for i in (0, 1):
        b = f"layers.{i}."
        shapes |= {
            b + "attention.qkv_linear.wq.weight": [64, dim],  # 4 heads of 16
            b + "attention.qkv_linear.wk.weight": [32, dim],  # 2 kv heads of 16
            b + "attention.qkv_linear.wv.weight": [32, dim],
            b + "attention.wo.weight": [dim, 64],
            b + "feed_forward.w1.weight": [hidden, dim],
            b + "feed_forward.w2.weight": [dim, hidden],
            b + "feed_forward.w3.weight": [hidden, dim],
            b + "attention_norm.weight": [dim],
            b + "ffn_norm.weight": [dim],
        }
    params = {}  # the optimizer's parameters: one fused wqkv of (4 + 2 * 2) * 16 rows per block
    for k, s in shapes.items():
        if ".qkv_linear.wq." in k:
            params[k.replace(".wq.", ".wqkv.")] = [128, dim]
        elif ".qkv_linear." not in k:
            params[k] = s
    expected = dict(shapes)
    for p, s in params.items():
        expected |= {f"optimizer.state.{p}.exp_avg": s, f"optimizer.state.{p}.exp_avg_sq": s}
        expected[f"optimizer.state.{p}.step"] = []
        for hyper in trainer.optimizer.param_groups[0]:
            if hyper != "params":
                expected[f"optimizer.param_groups.{p}.{hyper}"] = None
    expected |= {k: None for k in ("lr_scheduler.last_epoch", "train_state.step", "train_state.ntokens_seen")}
    expected |= {"dataloader.world_size": None, "dataloader.dp_rank_0": None}
    assert set(keys) == set(expected), sorted(set(keys) ^ set(expected))
    for k, s in expected.items():
        if s is not None:
            assert list(keys[k].size) == s, k
    info = describe(tmp_path / "ckpt")
    assert info["version"] == "0.3" and info["fused_qkv"] and info["prefix"] == ""


def torchtitan_030_qkv(x: torch.Tensor, wqkv: torch.Tensor, n_heads: int, n_kv: int):
    """torchtitan 0.3.0 FusedQKVLinear.forward: one matmul, viewed ``[B, L, n_kv, R, hd]``, split on R."""
    b, s, _ = x.shape
    per = n_heads // n_kv
    hd = wqkv.shape[0] // (n_kv * (per + 2))
    qkv = (x @ wqkv.T).view(b, s, n_kv, per + 2, hd)
    xq, xk, xv = torch.split(qkv, [per, 1, 1], dim=-2)
    return xq.reshape(b, s, -1, hd), xk.reshape(b, s, -1, hd), xv.reshape(b, s, -1, hd)


def test_split_fused_qkv_gives_the_projections_torchtitan_030_computes():
    n_heads, n_kv, hd, dim = 8, 2, 4, 16
    g = torch.Generator().manual_seed(0)
    wqkv = torch.randn((n_heads + 2 * n_kv) * hd, dim, generator=g)
    x = torch.randn(2, 3, dim, generator=g)
    q, k, v = split_fused_qkv(wqkv, n_heads, n_kv)
    ref = torchtitan_030_qkv(x, wqkv, n_heads, n_kv)
    for got, want in zip((x @ q.T, x @ k.T, x @ v.T), ref):  # other rows, other matmul rounding: close
        torch.testing.assert_close(got.view(want.shape), want, rtol=0, atol=1e-5)
    assert torch.equal(fuse_030(q, k, v, n_heads, n_kv), wqkv)  # the fixture's layout is the forward's


# ----------------------------------------------------------------------------- resume


@pytest.mark.usefixtures("no_peak_probe")
@pytest.mark.parametrize("fused", [True, False], ids=["fused_qkv", "separate_qkv"])
def test_030_checkpoint_resumes_like_the_same_state_in_v02_layout(fused, tmp_path):
    toml = torchtitan_toml(tmp_path)
    saver = compat_trainer(toml, [*GQA, "--checkpoint.enable_checkpoint", "false"])
    data = iter(saver.train_loader)
    take_steps(saver, data, 3)
    write_030_checkpoint(tmp_path / "v030", saver, fused)
    write_torchtitan_checkpoint(tmp_path / "v02", saver)

    got = {}
    for layout in ("v030", "v02"):
        t = compat_trainer(toml, [*GQA, "--checkpoint.enable_checkpoint", "false"])
        t.source = {"path": str(tmp_path / layout), "model_only": False, "why": "test"}
        assert t.resume() == 3
        got[layout] = t
    a, b = got["v030"], got["v02"]
    assert (a.state.step, a.state.tokens_seen) == (b.state.step, b.state.tokens_seen) == (3, saver.state.tokens_seen)
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), name
    oa, ob, osaver = (get_optimizer_state_dict(t.model, t.optimizer, options=FLAT) for t in (a, b, saver))
    moments = [k for k in oa if k.startswith("state.")]
    assert any(".attention.wq." in k for k in moments)
    for k in moments:
        assert torch.equal(oa[k], ob[k]) and torch.equal(oa[k], osaver[k]), k
    assert a.optimizer.param_groups[0]["lr"] == b.optimizer.param_groups[0]["lr"] == saver.lr_scheduler.get_last_lr()[0]

    batch = next(data)  # the next step: the resumed run and the one that never stopped stay identical
    for t in (saver, a):
        t.train_step(iter([batch]))
    for (name, x), y in zip(saver.model.named_parameters(), a.model.parameters()):
        assert torch.equal(x, y), name


@pytest.mark.usefixtures("no_peak_probe")
def test_030_checkpoint_of_another_model_is_one_line(tmp_path):
    toml = torchtitan_toml(tmp_path)
    small = compat_trainer(toml, [*GQA, "--checkpoint.enable_checkpoint", "false"])
    write_030_checkpoint(tmp_path / "ckpt", small)
    mha = compat_trainer(toml, [*TINY, "--checkpoint.enable_checkpoint", "false"])  # 4 kv heads, not 2
    with pytest.raises(ValueError, match=r"layers.0.attention.wk.weight is \[32, 64\] in the checkpoint but") as e:
        load_torchtitan_checkpoint(tmp_path / "ckpt", mha.model, mha.optimizer)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- export to HF


def tiny_030_args() -> Llama3ModelArgs:
    """A small model with torchtitan's llama3 RoPE (theta 500000, Llama 3.1 scaling, factor 8)."""
    return Llama3ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=256,
        multiple_of=256,
        rope_theta=500000.0,
        rope_scaling_factor=8.0,
        rope_original_max_position=8192,
        max_seq_len=131072,
    )


def rope_030(head_dim: int, seq: int) -> torch.Tensor:
    """torchtitan 0.3.0 ComplexRoPE's cache, ``scaling="llama"`` with its defaults (8, 1, 4, 8192)."""
    freqs = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    wavelen = 2 * math.pi / freqs
    low, high = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    scaled = torch.where(wavelen > low, freqs / 8.0, freqs)
    mid = (wavelen >= high) & (wavelen <= low)
    scaled = torch.where(mid, (1 - smooth) * scaled / 8.0 + smooth * scaled, scaled)
    angles = torch.outer(torch.arange(seq).float(), scaled)
    return torch.polar(torch.ones_like(angles), angles)


def torchtitan_030_logits(sd: dict, n_heads: int, n_kv: int, tokens: torch.Tensor) -> torch.Tensor:
    """torchtitan 0.3.0's llama3 forward from its *parameters* (fused ``wqkv``, ``lm_head``)."""
    n_layers = len({k.split(".")[1] for k in sd if k.startswith("layers.")})
    h = sd["tok_embeddings.weight"][tokens]
    b, s, dim = h.shape
    cis = rope_030(dim // n_heads, s)[None, :, None, :]

    def norm(x, w):
        return F.rms_norm(x, (dim,), w, eps=1e-5)

    def rotate(x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * cis).flatten(3).type_as(x)

    for i in range(n_layers):
        p = f"layers.{i}."
        q, k, v = torchtitan_030_qkv(norm(h, sd[p + "attention_norm.weight"]), sd[p + "wqkv"], n_heads, n_kv)
        q, k = rotate(q), rotate(k)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        h = h + out.transpose(1, 2).flatten(2) @ sd[p + "attention.wo.weight"].T
        x = norm(h, sd[p + "ffn_norm.weight"])
        ff = F.silu(x @ sd[p + "feed_forward.w1.weight"].T) * (x @ sd[p + "feed_forward.w3.weight"].T)
        h = h + ff @ sd[p + "feed_forward.w2.weight"].T
    return norm(h, sd["norm.weight"]) @ sd["lm_head.weight"].T


def source_030(tmp_path: Path, version: str) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A model-only torchtitan step folder (``version`` "0.3" or "0.2" names), tokens, and the
    logits torchtitan 0.3.0's forward gives for its weights."""
    args = tiny_030_args()
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            if ".wq." in name or ".wk." in name:  # sharper attention: the rotary positions show in the logits
                p.mul_(10)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = {name_030(k, fused=False): v for k, v in sd.items()}
    for i in range(args.n_layers):
        qkv = [sd[f"layers.{i}.attention.{p}.weight"] for p in ("wq", "wk", "wv")]
        params[f"layers.{i}.wqkv"] = fuse_030(*qkv, args.n_heads, args.kv_heads)
    tokens = torch.randint(0, args.vocab_size, (2, 160), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = torchtitan_030_logits(params, args.n_heads, args.kv_heads, tokens)
    stored = {name_030(k, fused=False) if version == "0.3" else k: v for k, v in sd.items()}
    step = tmp_path / f"tt{version}" / "step-0"
    dcp.save(stored, checkpoint_id=str(step), no_dist=True)
    return step, tokens, logits


@pytest.mark.parametrize("version", ["0.3", "0.2"])
def test_torchtitan_checkpoint_exports_to_hf_with_its_logits(version, tmp_path):
    transformers = pytest.importorskip("transformers")
    step, tokens, expected = source_030(tmp_path, version)
    out = dcp_to_hf(step, tmp_path / "hf", model_args={"n_heads": 4})
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        got = hf.eval()(tokens).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def run_convert(*args: str) -> subprocess.CompletedProcess:
    return run_python(
        [sys.executable, "-m", "titanlite", "convert", "dcp-to-hf", "-q", *args],
        cwd=REPO,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_convert_cli_takes_a_torchtitan_030_folder(tmp_path):
    step, _, _ = source_030(tmp_path, "0.3")
    bad = run_convert(str(step), str(tmp_path / "hf1"))  # dim 64 is no torchtitan flavor: n_heads unknown
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and "give the model arg n_heads" in lines[0], bad.stderr
    assert not (tmp_path / "hf1").exists()
    ok = run_convert(str(step), str(tmp_path / "hf2"), "--model-arg", "n_heads=4")
    assert ok.returncode == 0, ok.stderr
    config = (tmp_path / "hf2" / "config.json").read_text()
    assert '"num_attention_heads": 4' in config and '"num_key_value_heads": 2' in config, config


def fsdp_030_worker(args: dict) -> dict:
    skip_peak_measurement()
    tr = translate(
        args["toml"], [*GQA, "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "1"]
    )
    trainer = CompatTrainer(load_translated(tr), settings=tr.settings)
    step = trainer.resume()
    osd = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=FLAT)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in osd.items() if k.startswith("state.")}
    return {"step": step, "moments": {k: v.detach().cpu() for k, v in full.items()}}


@pytest.mark.multiprocess
@pytest.mark.usefixtures("no_peak_probe")
def test_fused_030_state_splits_into_fsdp2_shards(tmp_path):
    toml = torchtitan_toml(tmp_path)
    saver = compat_trainer(toml, [*GQA, "--checkpoint.enable_checkpoint", "false"])
    take_steps(saver, iter(saver.train_loader), 2)
    write_030_checkpoint(tmp_path / "out" / "checkpoint" / "step-2", saver)
    saver.run_lock.release()  # the workers' run uses the same dump folder
    results = run_workers(fsdp_030_worker, 2, {"toml": str(toml)}, timeout=180)
    want = get_optimizer_state_dict(saver.model, saver.optimizer, options=FLAT)
    for res in results:
        assert res["step"] == 2 and any(".attention.wk." in k for k in res["moments"])
        for k, v in res["moments"].items():
            assert torch.equal(v, want[k]), k


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model-arg", "n_heads=abc"], "model arg n_heads = 'abc' must be an integer"),  # was a TypeError
        (["--model-arg", "rope_theta=true"], "model arg rope_theta = True must be a number"),
        (["--max-shard-size", "1e400"], "--max-shard-size: cannot read '1e400'"),  # was an OverflowError
        (["--max-shard-size", "nan"], "--max-shard-size: cannot read 'nan'"),
    ],
)
def test_convert_cli_values_are_one_line_errors(tmp_path, capsys, args, message):
    from titanlite.checkpoint.convert_cli import main_dcp_to_hf

    step, _, _ = source_030(tmp_path, "0.3")
    capsys.readouterr()
    assert main_dcp_to_hf(["-q", str(step), str(tmp_path / "hf"), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "hf").exists()
