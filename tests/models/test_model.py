"""Llama 3 model: sizes, causality, RoPE, weight tying, init and a Hugging Face reference."""

import math
import time

import pytest
import torch

from titanlite.models import build_model, make_model_args
from titanlite.models.flops import num_params
from titanlite.models.llama3 import LLAMA3_FLAVORS, Llama3HFAdapter, Llama3ModelArgs, Transformer
from titanlite.models.llama3.model import apply_rope, precompute_rope, rope_frequencies


def tiny_args(**overrides) -> Llama3ModelArgs:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=16, max_seq_len=64)
    base.update(overrides)
    return Llama3ModelArgs(**base)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(tiny_args(**overrides))
    model.init_weights()
    return model


# ----------------------------------------------------------------------------- args


def test_ffn_hidden_dim_matches_published_sizes():
    assert LLAMA3_FLAVORS["1B"].ffn_hidden_dim == 8192
    assert LLAMA3_FLAVORS["3B"].ffn_hidden_dim == 8192
    assert LLAMA3_FLAVORS["8B"].ffn_hidden_dim == 14336
    assert LLAMA3_FLAVORS["70B"].ffn_hidden_dim == 28672
    assert LLAMA3_FLAVORS["405B"].ffn_hidden_dim == 53248
    assert LLAMA3_FLAVORS["debugmodel"].head_dim == 32


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(dim=100, n_heads=8), "divisible by n_heads"),
        (dict(n_heads=8, n_kv_heads=3), "divisible by n_kv_heads"),
        (dict(n_layers=0), "n_layers"),
        (dict(vocab_size=-1), "vocab_size"),
        (dict(attn_mask_type="sliding"), "attn_mask_type"),
        (dict(rope_scaling_factor=8.0, rope_low_freq_factor=4.0, rope_high_freq_factor=4.0), "rope_low_freq_factor"),
    ],
)
def test_args_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_args(**overrides)
    with pytest.raises(ValueError, match=match):  # overrides through the registry are validated too
        make_model_args("llama3", "debugmodel", **overrides)


# ----------------------------------------------------------------------------- sizes / meta


@pytest.mark.parametrize("flavor, expected", [("1B", 1_235_814_400), ("8B", 8_030_261_248)])
def test_param_counts(flavor, expected):
    model = build_model("llama3", flavor)
    assert num_params(model) == expected


def test_meta_build_of_large_models_allocates_nothing():
    for flavor in ("70B", "405B"):
        start = time.perf_counter()
        model = build_model("llama3", flavor, device="meta")
        assert time.perf_counter() - start < 10
        assert all(p.is_meta for p in model.parameters())
        assert all(b.is_meta for b in model.buffers())
        if flavor == "70B":
            assert num_params(model) == 70_553_706_496
    assert num_params(model, exclude_embedding=True) == num_params(model) - 128256 * 16384


def test_module_names_follow_meta_layout():
    model = build_model("llama3", "debugmodel", n_layers=2)
    names = {n for n, _ in model.named_parameters()}
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        expected |= {f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
        expected |= {f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"}
    assert names == expected
    assert isinstance(model.layers, torch.nn.ModuleDict)
    assert "rope_cache" not in model.state_dict()  # non-persistent


# ----------------------------------------------------------------------------- forward


def test_debugmodel_forward_shape_and_finite():
    torch.manual_seed(0)
    model = build_model("llama3", "debugmodel", device="cpu")
    tokens = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        logits = model(tokens)
    assert logits.shape == (2, 16, 512)
    assert torch.isfinite(logits).all()


def test_causality():
    model = tiny_model()
    tokens = torch.randint(0, 97, (1, 12))
    t = 5
    changed = tokens.clone()
    changed[0, t] = (tokens[0, t] + 1) % 97
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    assert not torch.allclose(a[:, t], b[:, t])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_build_with_overrides_and_unknown_override():
    model = build_model("llama3", "debugmodel", device="cpu", n_layers=2, vocab_size=300)
    assert len(model.layers) == 2 and model.tok_embeddings.weight.shape == (300, 256)
    assert not any(p.is_meta for p in model.parameters())
    with torch.no_grad():
        assert model(torch.randint(0, 300, (1, 8))).shape == (1, 8, 300)
    with pytest.raises(KeyError):
        build_model("llama3", "debugmodel", device="cpu", not_a_field=1)


def test_gqa_matches_explicitly_expanded_kv_heads():
    gqa = tiny_model(n_heads=4, n_kv_heads=2)
    mha = Transformer(tiny_args(n_heads=4, n_kv_heads=4))
    sd = gqa.state_dict()
    for i in range(2):
        for w in ("wk", "wv"):
            key = f"layers.{i}.attention.{w}.weight"
            hd = 16
            sd[key] = sd[key].view(2, hd, 64).repeat_interleave(2, dim=0).reshape(4 * hd, 64)
    mha.load_state_dict(sd)
    mha.rope_cache = gqa.rope_cache.clone()
    tokens = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- RoPE


def complex_rope_reference(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Meta's original formulation: pairs (2i, 2i+1) as complex numbers times e^{i p f}."""
    bsz, seqlen, n_heads, head_dim = x.shape
    pos = torch.arange(seqlen, dtype=torch.float64)
    rot = torch.polar(torch.ones(seqlen, head_dim // 2, dtype=torch.float64), torch.outer(pos, freqs.double()))
    xc = torch.view_as_complex(x.double().reshape(bsz, seqlen, n_heads, head_dim // 2, 2))
    return torch.view_as_real(xc * rot[None, :, None, :]).flatten(3)


def published_llama31_scaling(freqs, factor, low, high, old_ctx):
    """Scalar transcription of the rule in Meta's llama-models ``apply_scaling``."""
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            s = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scaling", [0.0, 8.0, 32.0])
def test_rope_matches_complex_reference(scaling):
    head_dim, seqlen = 64, 50
    kw = dict(
        theta=500000.0, scaling_factor=scaling, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192
    )
    freqs = rope_frequencies(head_dim, **kw)
    cache = precompute_rope(head_dim, 128, **kw)
    assert cache.shape == (128, head_dim)
    x = torch.randn(2, seqlen, 3, head_dim)
    torch.testing.assert_close(apply_rope(x, cache).double(), complex_rope_reference(x, freqs), rtol=1e-5, atol=1e-5)
    if scaling:
        expected = published_llama31_scaling(rope_frequencies(head_dim, 500000.0), scaling, 1.0, 4.0, 8192)
        torch.testing.assert_close(freqs.double(), expected, rtol=1e-6, atol=0)


def test_rope_scaling_hand_computed_points():
    head_dim, factor = 128, 8.0
    plain = rope_frequencies(head_dim, 500000.0)
    scaled = rope_frequencies(head_dim, 500000.0, factor, 1.0, 4.0, 8192)
    # pair 0: frequency 1, wavelength 2*pi << 8192/4 -> unchanged
    assert plain[0].item() == 1.0 and scaled[0].item() == 1.0
    # last pair: 500000^(-126/128) ~ 2.42e-6, wavelength ~ 2.6e6 >> 8192 -> divided by the factor
    last = 500000.0 ** (-126 / 128)
    assert plain[-1].item() == pytest.approx(last, rel=1e-6)
    assert scaled[-1].item() == pytest.approx(last / factor, rel=1e-6)
    # pair 32: frequency 500000^(-1/2), wavelength 2*pi*707.1 ~ 4443, inside (8192/4, 8192/1):
    # smooth = (8192/4443 - 1) / (4 - 1) ~ 0.281, interpolating between f/8 and f
    f32 = 500000.0**-0.5
    s = (8192 / (2 * math.pi / f32) - 1.0) / 3.0
    assert s == pytest.approx(0.2812, abs=1e-3)
    assert scaled[32].item() == pytest.approx((1 - s) * f32 / factor + s * f32, rel=1e-6)
    # high/low bands are complete: every pair is either kept, divided, or in between
    assert torch.all(scaled <= plain) and torch.all(scaled >= plain / factor * (1 - 1e-6))


def test_rope_position_zero_is_identity_and_norm_preserved():
    cache = precompute_rope(32, 16, 10000.0)
    x = torch.randn(1, 16, 2, 32)
    y = apply_rope(x, cache)
    torch.testing.assert_close(y[:, 0], x[:, 0])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


# ----------------------------------------------------------------------------- init / tying


def test_tied_embeddings_survive_meta_materialization():
    model = build_model("llama3", "debugmodel", n_layers=1, tie_word_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert len(list(model.parameters())) == len(dict(model.named_parameters()))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight
    assert model.tok_embeddings.weight.std().item() == pytest.approx(256**-0.5, rel=0.05)
    n_untied = num_params(build_model("llama3", "debugmodel", n_layers=1))
    assert num_params(model) == n_untied - 512 * 256


def test_init_deterministic_and_meta_equals_cpu():
    on_cpu = build_model("llama3", "debugmodel", device="cpu", n_layers=2)
    torch.manual_seed(123)  # (module constructors on cpu consume random numbers; re-init from a seed)
    on_cpu.init_weights()
    on_meta = build_model("llama3", "debugmodel", n_layers=2)
    assert on_meta.rope_cache.is_meta
    on_meta.to_empty(device="cpu")
    torch.manual_seed(123)
    on_meta.init_weights()
    for (name, a), (_, b) in zip(on_cpu.state_dict().items(), on_meta.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(on_cpu.rope_cache, on_meta.rope_cache, rtol=0, atol=0)
    args = on_cpu.args
    assert on_cpu.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert on_cpu.norm.weight.eq(1).all() and on_cpu.layers["1"].ffn_norm.weight.eq(1).all()
    wo1 = on_cpu.layers["1"].attention.wo.weight
    assert wo1.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.1)  # depth init, layer 1
    assert wo1.abs().max().item() <= 3 * 0.02 / math.sqrt(4) + 1e-7
    assert on_cpu.output.weight.std().item() == pytest.approx(args.dim**-0.5, rel=0.1)


# ----------------------------------------------------------------------------- Hugging Face reference


@pytest.mark.parametrize("scaling", [0.0, 8.0])
def test_logits_match_transformers_llama(scaling):
    transformers = pytest.importorskip("transformers")
    args = tiny_args(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=97,
        multiple_of=16,
        rope_theta=10000.0,
        rope_scaling_factor=scaling,
        rope_original_max_position=64,
        max_seq_len=64,
    )
    torch.manual_seed(0)
    ours = Transformer(args)
    ours.init_weights()
    for p in ours.parameters():  # break the symmetric init of the norms so they are exercised
        if p.dim() == 1:
            torch.nn.init.uniform_(p, 0.5, 1.5)

    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if scaling:
        rope = {
            "rope_type": "llama3",
            "rope_theta": args.rope_theta,
            "factor": scaling,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_position,
        }
    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    config._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(config).eval()

    adapter = Llama3HFAdapter(args)  # names and the wq/wk row order of HF's rotate-half RoPE
    hf_sd = dict(adapter.to_hf(name, t) for name, t in ours.state_dict().items())
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    assert not unexpected and all("rotary_emb" in k for k in missing), (missing, unexpected)

    tokens = torch.randint(0, args.vocab_size, (2, 40))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
