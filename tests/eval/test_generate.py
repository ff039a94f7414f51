"""Generation (``titanlite.generate``) and the static KV cache (``titanlite.models.kv_cache``).

References, each independent of the code under test:

- transformers' ``generate(do_sample=False)`` on the Hugging Face export of the same checkpoint: greedy
  tokens must be equal, one for one, eager and compiled (``compile=True``), for a left-padded batch of
  mixed lengths and for one prompt, from the library and from the command line's ``--json`` output, for
  a briefly trained Llama 3 (the trainer's own checkpoint) and a Qwen3 (extension family, QK-norm);
- the plain training forward (no cache) over each prompt alone: cached logits (prefill and every decode
  step, left-padded batches included) within 1e-5 (fp32; measured ~1e-6);
- the sampling of the code before the static cache, written out here: the plain forward over each row's
  whole sequence, temperature / top-k / nucleus by sorting, and ``torch.multinomial`` on the same seeded
  generator, step by step on the host: sampled tokens must be equal, eager and compiled;
- the analytic distribution of temperature / top-k / top-p sampling (renormalized softmax, computed here
  in plain Python), against 20,000 draws with a 5-sigma binomial tolerance;
- torch's own counters: compiled graphs (``torch._dynamo`` counters: one for 64 decode steps, none for a
  second request) and host reads (``Tensor.item`` / ``tolist`` / ``cpu`` ... patched to count them);
- one process against 2 gloo ranks holding FSDP- and TP-sharded copies of the same weights (and a count of
  the broadcasts: one per generated token).
"""

from __future__ import annotations

import json
import math
import shutil
import sys

import pytest
import torch

from tests.helpers.dist import REPO, run_workers
from tests.helpers.families import NoCacheLM
from tests.helpers.launch import run_python
from tests.helpers.llama import tiny_args as llama_args
from tests.helpers.llama import titanlite_model
from tests.helpers.qwen3 import qwen3_model
from tests.helpers.qwen3 import save_step_folder as save_qwen3_step_folder
from tests.helpers.qwen3 import tiny_args as qwen3_args
from tests.helpers.tiny import TINY_MODEL
from titanlite.checkpoint.hf_export import dcp_to_hf
from titanlite.checkpoint.load_model import load_model
from titanlite.generate import STOP_CHECK_EVERY, generate, sample_next
from titanlite.generate.cli import main
from titanlite.models.attention import grouped_query_attention
from titanlite.models.kv_cache import KVCache
from titanlite.models.llama3.model import repeat_kv

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["def main():", "import os\n", "The quick brown fox", "x", "class Foo(object):\n    "]
QWEN3_EXT = "torchtitan_ext.qwen3"
NEW = 20


def random_model(family: str):
    """A tiny model with random weights (norm gains too): its greedy continuations vary token to token."""
    return titanlite_model(llama_args()) if family == "llama3" else qwen3_model(qwen3_args())


def token_prompts(n: int = 4, vocab: int = 512) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    lengths = [5, 12, 1, 9][:n]
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for length in lengths]


def hf_greedy(hf_dir, prompts: list[list[int]], max_new_tokens: int, eos_ids) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager").eval()
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=list(eos_ids),
                pad_token_id=0,
            )
        out.append(y[0, len(ids) :].tolist())
    return out


def cli_json(capsys, *argv: str) -> list[dict]:
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


# ----------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama 3 trained 4 steps by the trainer (its model-only final save) and its HF export."""
    root = tmp_path_factory.mktemp("trained")
    cmd = [
        *(sys.executable, "-m", "titanlite.train", "--config", "train_configs/debug_model.toml"),
        *("--job.dump_folder", str(root / "run"), "--training.steps", "4", "--checkpoint.enable"),
        *("--checkpoint.interval", "4", "--training.seq_len", "64", "--training.local_batch_size", "4"),
        *("--training.global_batch_size", "4", "--lr_scheduler.warmup_steps", "2", "--validation.enable", "false"),
        *("--metrics.enable_tensorboard", "false", *TINY_MODEL),
    ]
    proc = run_python(cmd, cwd=REPO, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = root / "run" / "checkpoint" / "step-4"
    return step, dcp_to_hf(step, root / "hf")


@pytest.fixture(scope="module")
def qwen3_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    step = save_qwen3_step_folder(random_model("qwen3"), root / "step-3")
    return step, dcp_to_hf(step, root / "hf")


# ----------------------------------------------------------------------------- transformers parity


def test_greedy_equals_transformers_for_a_trained_llama(trained, capsys):
    """Library and CLI (--json), from the step folder and from the HF folder: transformers' tokens."""
    step, hf = trained
    loaded = load_model(step)
    prompts = [loaded.tokenizer.encode(t, bos=True) for t in TEXTS]
    expected = hf_greedy(hf, prompts, NEW, loaded.eos_ids)
    assert len({t for e in expected for t in e}) > 20  # not one token repeated: a comparison that can fail
    assert generate(loaded.model, prompts, max_new_tokens=NEW, eos_ids=loaded.eos_ids) == expected
    from_hf = load_model(hf, tokenizer_path="bytes")
    assert from_hf.eos_ids == loaded.eos_ids
    assert generate(from_hf.model, prompts, max_new_tokens=NEW, eos_ids=from_hf.eos_ids) == expected

    prompt_args = [a for t in TEXTS for a in ("--prompt", t)]
    for folder, extra in ((step, []), (hf, ["--tokenizer", "bytes"])):
        records = cli_json(capsys, "--checkpoint", str(folder), *prompt_args, "--max-new-tokens", str(NEW), *extra)
        assert [r["completion_ids"] for r in records] == expected
        assert [r["prompt_ids"] for r in records] == prompts and [r["prompt"] for r in records] == TEXTS
        for r in records:
            ids = r["completion_ids"]
            body = ids[:-1] if ids and ids[-1] in loaded.eos_ids else ids
            assert r["completion"] == loaded.tokenizer.decode(body)


def test_greedy_equals_transformers_for_qwen3(qwen3_folders, capsys):
    step, hf = qwen3_folders
    loaded = load_model(step, extensions=[QWEN3_EXT])
    prompts = [loaded.tokenizer.encode(t, bos=True) for t in TEXTS]
    expected = hf_greedy(hf, prompts, NEW, loaded.eos_ids)
    assert generate(loaded.model, prompts, max_new_tokens=NEW, eos_ids=loaded.eos_ids) == expected
    from_hf = load_model(hf, tokenizer_path="bytes", extensions=[QWEN3_EXT])
    assert generate(from_hf.model, prompts, max_new_tokens=NEW, eos_ids=from_hf.eos_ids) == expected
    args = ["--checkpoint", str(step), "--extensions", QWEN3_EXT, "--max-new-tokens", str(NEW)]
    records = cli_json(capsys, *args, *[a for t in TEXTS for a in ("--prompt", t)])
    assert [r["completion_ids"] for r in records] == expected


@pytest.fixture(scope="module")
def families(trained, qwen3_folders):
    """Per family: the loaded model, its prompts (TEXTS) and hf folder."""
    llama = load_model(trained[0])
    qwen = load_model(qwen3_folders[0], extensions=[QWEN3_EXT])
    return {"llama3": (llama, trained[1]), "qwen3": (qwen, qwen3_folders[1])}


def test_compiled_greedy_equals_transformers_and_compiles_once(families):
    """compile=True: the left-padded batch (NEW new tokens: NEW - 1 compiled decode steps, one compiled graph for
    them, none for a second request of that shape) gives transformers' tokens. Llama only: the compiled decode loop
    is the families' common code, and Qwen3's forward is checked eagerly above."""
    from torch._dynamo.utils import counters

    loaded, hf = families["llama3"]
    prompts = [loaded.tokenizer.encode(t, bos=True) for t in TEXTS]
    expected = hf_greedy(hf, prompts, NEW, loaded.eos_ids)
    assert all(len(set(tokens)) > 2 for tokens in expected)  # not one token repeated
    before = counters["stats"]["unique_graphs"]
    for _ in range(2):
        assert generate(loaded.model, prompts, max_new_tokens=NEW, eos_ids=loaded.eos_ids, compile=True) == expected
        assert counters["stats"]["unique_graphs"] == before + 1  # one graph for every step, none for the next request


def test_the_cli_compiles_with_its_flag(trained, families, capsys):
    """--compile: transformers' tokens again (a fresh model of the compiled test's shape: no new graph)."""
    loaded, hf = families["llama3"]
    prompts = [loaded.tokenizer.encode(t, bos=True) for t in TEXTS]
    args = ["--checkpoint", str(trained[0]), "--max-new-tokens", str(NEW), "--compile"]
    records = cli_json(capsys, *args, *[a for t in TEXTS for a in ("--prompt", t)])
    assert [r["completion_ids"] for r in records] == hf_greedy(hf, prompts, NEW, loaded.eos_ids)


def old_sampling(model, prompts, new, temperature, top_k, top_p, eos_ids, generator) -> list[list[int]]:
    """What titanlite sampled before the static cache, written out: each row's whole sequence through the
    plain forward, the tempered scores cut to the top k (ties kept) and to the nucleus, renormalized, and
    one ``torch.multinomial`` draw for the batch per step, until every row has drawn an EOS id."""
    sequences, out, done = [list(p) for p in prompts], [[] for _ in prompts], [False] * len(prompts)
    for _ in range(new):
        with torch.no_grad():
            logits = torch.stack([model(torch.tensor([seq]))[0, -1].float() for seq in sequences])
        scores = logits / temperature
        if top_k:
            kth = scores.sort(dim=-1, descending=True).values[:, top_k - 1 : top_k]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = scores.softmax(dim=-1)
        ranked, order = probs.sort(dim=-1, descending=True)
        before = ranked.cumsum(dim=-1) - ranked
        ranked = ranked.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, ranked)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        ids = torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()
        for row, token in enumerate(ids):
            sequences[row].append(token)
            if not done[row]:
                out[row].append(token)
                done[row] = token in eos_ids
        if all(done):
            break
    return out


def test_sampled_tokens_equal_the_old_sampling_with_the_same_seed(families):
    """Temperature, top-k and top-p from a seeded generator: the old path's draws, eager and compiled
    (the batch's shape is the compiled test's: no new graph)."""
    loaded, _ = families["llama3"]
    prompts = [loaded.tokenizer.encode(t, bos=True) for t in TEXTS]
    kw = dict(temperature=0.8, top_k=50, top_p=0.9)
    want = old_sampling(
        loaded.model, prompts, NEW, eos_ids=loaded.eos_ids, generator=torch.Generator().manual_seed(7), **kw
    )
    assert len({t for row in want for t in row}) > 20
    for compile in (False, True):
        got = generate(
            loaded.model, prompts, max_new_tokens=NEW, eos_ids=loaded.eos_ids, compile=compile,
            generator=torch.Generator().manual_seed(7), **kw,
        )  # fmt: skip
        assert got == want, compile


def test_a_decode_reads_the_device_at_most_once_every_k_tokens(monkeypatch):
    """N new tokens (no EOS): at most ceil(N / K) + 1 host reads (item / tolist / cpu / numpy / bool ...),
    greedy and sampled, with the cache and recomputing."""
    model = random_model("llama3")
    prompts = token_prompts(3)
    new = 40
    reads = []
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for kw in ({}, {"temperature": 1.0, "top_k": 20, "top_p": 0.9}, {"use_cache": False}):
        reads.clear()
        out = generate(model, prompts, max_new_tokens=new, generator=torch.Generator().manual_seed(0), **kw)
        assert [len(c) for c in out] == [new] * 3
        assert 0 < len(reads) <= math.ceil(new / STOP_CHECK_EVERY) + 1, (kw, reads)


# ----------------------------------------------------------------------------- the cache


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_cached_logits_equal_the_uncached_forward_with_left_padding(family):
    """A left-padded batch: prefill logits at every real position and 4 decode steps' logits equal the
    plain forward over each row's whole sequence alone; padded positions stay finite."""
    model = random_model(family)
    prompts = token_prompts(4)
    steps = torch.randint(0, 512, (len(prompts), 4), generator=torch.Generator().manual_seed(2))
    longest = max(len(p) for p in prompts)
    pad = [longest - len(p) for p in prompts]
    with torch.no_grad():
        alone = [model(torch.tensor([p + s.tolist()]))[0] for p, s in zip(prompts, steps)]
        cache = KVCache(longest + steps.shape[1] + 3, pad)  # 3 slots to spare: masked, never read
        prefill = model(torch.tensor([[0] * n + p for n, p in zip(pad, prompts)]), cache=cache)
        cache.advance(longest)
        decoded = []
        for i in range(steps.shape[1]):
            decoded.append(model(steps[:, i : i + 1], cache=cache)[:, 0])
            cache.advance(1)
    assert torch.isfinite(prefill).all()
    for b, (n, p) in enumerate(zip(pad, prompts)):
        torch.testing.assert_close(prefill[b, n:], alone[b][: len(p)], rtol=0, atol=1e-5)
        for i, logits in enumerate(decoded):
            torch.testing.assert_close(logits[b], alone[b][len(p) + i], rtol=0, atol=1e-5)


def test_cache_positions_start_after_each_rows_padding_and_the_mask_hides_the_filler():
    """RoPE is shift-invariant, so logits alone cannot see the positions: check them and the mask by hand.
    Eager steps' masks span the slots filled so far (compiled ones the whole static cache)."""
    table = torch.arange(10.0)[:, None].expand(10, 4)  # row p holds p
    cache = KVCache(6, [2, 0])
    rope, mask = cache.step(table, 4)
    assert rope[..., 0].tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]  # filler slots clamped to position 0
    causal = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    filler = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]  # a filler query sees itself only
    assert mask.shape == (2, 1, 4, 4) and mask[0, 0].int().tolist() == filler and mask[1, 0].int().tolist() == causal
    cache.advance(3)  # e.g. a step right-padded by one filler token: its slot is reused
    rope, mask = cache.step(table, 1)
    assert rope[..., 0].tolist() == [[1], [3]] and cache.pos.item() == 3
    assert mask[:, 0, 0].int().tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    with pytest.raises(ValueError, match="cannot advance 3 slots by 4"):
        cache.advance(4)


@pytest.mark.parametrize("seqlen", [1, 5])
def test_grouped_query_attention_equals_repeating_the_heads(seqlen):
    """Query heads sharing a kv head read it as extra rows: the same as repeat_kv + SDPA (decode and prefill)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, seqlen, 8, 16, generator=g)
    k, v = (torch.randn(2, 9, 2, 16, generator=g) for _ in range(2))
    mask = torch.rand(2, 1, seqlen, 9, generator=g) < 0.7
    mask[..., 0] = True  # every query sees a key
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), repeat_kv(k, 4).transpose(1, 2), repeat_kv(v, 4).transpose(1, 2), attn_mask=mask
    ).transpose(1, 2)
    torch.testing.assert_close(grouped_query_attention(q, k, v, mask), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_a_batch_generates_what_each_prompt_generates_alone(family):
    model = random_model(family)
    prompts = token_prompts(4)
    batched = generate(model, prompts, max_new_tokens=12)
    assert batched == [generate(model, [p], max_new_tokens=12)[0] for p in prompts]
    assert batched == generate(model, prompts, max_new_tokens=12, use_cache=False)
    assert all(len(c) == 12 for c in batched)


def last_n_greedy(model, prompt: list[int], new: int, window: int) -> list[int]:
    """The direct computation of a sliding window (nanoGPT's sample.py): each step runs the plain forward over the
    last ``window`` tokens of the sequence so far and takes the argmax of its last position."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            seq.append(int(model(torch.tensor([seq[-window:]]))[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_a_context_window_generates_what_a_loop_over_the_last_n_tokens_does(family):
    """Prompts of 5, 12, 1 and 9 tokens, a window of 8, 20 new tokens: the cached batch (which overflows the window
    row by row) and the uncached one give each row's tokens of the direct loop; without the window they differ."""
    model = random_model(family)
    prompts = token_prompts(4)
    want = [last_n_greedy(model, p, 20, 8) for p in prompts]
    assert generate(model, prompts, max_new_tokens=20, context_window=8) == want
    assert generate(model, prompts, max_new_tokens=20, context_window=8, use_cache=False) == want
    assert generate(model, prompts, max_new_tokens=20) != want  # the window changes what is generated
    assert generate(model, prompts, max_new_tokens=20, context_window=32) == generate(model, prompts, max_new_tokens=20)


def test_a_window_generates_past_max_seq_len_and_bad_windows_are_refused():
    model = titanlite_model(llama_args(max_seq_len=32))
    with pytest.raises(ValueError, match="exceed the model's max_seq_len 32"):
        generate(model, [[1, 2, 3]], max_new_tokens=40)
    assert generate(model, [[1, 2, 3]], max_new_tokens=40, context_window=16) == [
        last_n_greedy(model, [1, 2, 3], 40, 16)
    ]
    with pytest.raises(ValueError, match="context_window 40 exceed the model's max_seq_len 32"):
        generate(model, [[1, 2, 3]], max_new_tokens=40, context_window=40)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="context_window must be an integer >= 1"):
            generate(model, [[1, 2, 3]], max_new_tokens=4, context_window=bad)


def test_a_context_past_the_trained_length_is_warned_once(trained, caplog, capsys):
    """The trained fixture's run trained on 64 tokens (its config.toml): a context past 64 logs one warning naming
    both lengths and the window to use; under that window nothing is logged, and the CLI's flag gives the
    library's windowed tokens."""
    step, _ = trained
    loaded = load_model(step)
    assert loaded.trained_seq_len == 64
    prompt = [loaded.tokenizer.bos_id] + loaded.tokenizer.encode("Hello")
    with caplog.at_level("WARNING", logger="titanlite"):
        generate(loaded.model, [prompt], max_new_tokens=70, trained_seq_len=loaded.trained_seq_len)
    past = [r for r in caplog.records if "past the 64 the model was trained on" in r.getMessage()]
    assert len(past) == 1 and "context_window=64" in past[0].getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="titanlite"):
        windowed = generate(loaded.model, [prompt], max_new_tokens=70, trained_seq_len=64, context_window=64)
        generate(loaded.model, [prompt], max_new_tokens=58, trained_seq_len=64)  # 6 + 57 tokens of context
    assert "trained on" not in caplog.text
    with caplog.at_level("WARNING", logger="titanlite"):
        got = cli_json(capsys, "--checkpoint", str(step), "--prompt", "Hello", "--max-new-tokens", "70")
    assert "past the 64 the model was trained on" in caplog.text
    got = cli_json(
        capsys, *("--checkpoint", str(step), "--prompt", "Hello", "--max-new-tokens", "70"), "--context-window", "64"
    )
    assert got[0]["prompt_ids"] == prompt and got[0]["completion_ids"] == windowed[0][: len(got[0]["completion_ids"])]


def test_bf16_cache_keeps_the_few_kv_heads_in_the_model_dtype():
    """GQA: the cache holds the 2 key/value heads (not the 4 query heads), in bf16; logits within bf16 noise."""
    model = random_model("llama3").to(torch.bfloat16)
    prompts = token_prompts(2)
    cache = KVCache(20, [7, 0])
    with torch.no_grad():
        cached = model(torch.tensor([[0] * 7 + prompts[0], prompts[1]]), cache=cache)
        alone = model(torch.tensor([prompts[1]]))
    assert cache.layer("0").k.shape == (2, 20, 2, 16) and cache.layer("1").v.dtype == torch.bfloat16
    torch.testing.assert_close(cached[1].float(), alone[0].float(), rtol=0, atol=5e-2)
    assert len(generate(model, prompts, max_new_tokens=5)[0]) == 5


def test_the_cache_refuses_more_slots_than_it_has():
    model = random_model("llama3")
    cache = KVCache(6, [0])
    with torch.no_grad(), pytest.raises(ValueError, match="7 slots exceed its 6"):
        model(torch.zeros(1, 7, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="exceed the model's max_seq_len 128"):
        generate(model, [[1] * 100], max_new_tokens=29)


def test_a_per_block_compiled_model_generates_eagerly():
    """titanlite's per-block compile: generation runs the blocks eagerly (no graph per sequence length)."""
    from torch._dynamo.utils import counters

    from titanlite.parallel.compile import CompilePolicy

    model = random_model("llama3")
    prompts = token_prompts(3)
    expected = generate(model, prompts, max_new_tokens=6)
    assert CompilePolicy(enable=True, components=["model"]).apply(model) == 2
    torch._dynamo.reset()
    counters.clear()
    assert generate(model, prompts, max_new_tokens=6) == expected
    assert not counters["stats"]["unique_graphs"]


class KwargsLM(NoCacheLM):
    def forward(self, tokens, **kwargs):  # takes a cache and would ignore it
        return super().forward(tokens)


class IgnoresTheCacheLM(NoCacheLM):
    def forward(self, tokens, cache=None):  # declares the protocol, does not follow it
        return super().forward(tokens)


def greedy_by_hand(model, prompt: list[int], new: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("family", [NoCacheLM, KwargsLM])
def test_a_family_without_the_cache_generates_by_recomputing_with_a_warning(family, caplog):
    model = family().eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    with caplog.at_level("WARNING"):
        out = generate(model, prompts, max_new_tokens=6, compile=True)
    assert out == [greedy_by_hand(model, p, 6) for p in prompts]
    assert "forward takes no cache argument" in caplog.text and "compile ignored" in caplog.text


def test_a_family_that_ignores_the_cache_it_declares_gets_a_one_line_error():
    with pytest.raises(ValueError, match="stored no keys/values in it: implement the protocol") as e:
        generate(IgnoresTheCacheLM().eval(), [[1, 2, 3]], max_new_tokens=4)
    assert "\n" not in str(e.value) and "use_cache=False" in str(e.value)
    assert generate(IgnoresTheCacheLM().eval(), [[1, 2, 3]], max_new_tokens=4, use_cache=False) == [
        greedy_by_hand(IgnoresTheCacheLM().eval(), [1, 2, 3], 4)
    ]


def test_the_sampling_hook_checks_the_family_at_start(caplog):
    """[sampling] with a family without the cache: a warning when the hook is built, samples that work."""
    from titanlite.config.sections import Sampling
    from titanlite.tokenizer import build_byte_tokenizer
    from titanlite.trainer.runtime import Runtime
    from titanlite.trainer.sampling import SamplingHook

    tok = build_byte_tokenizer()
    section = Sampling(enable=True, prompts=["ab"], max_new_tokens=5, compile=True)
    model = NoCacheLM(vocab=tok.vocab_size, dim=8).eval()
    with caplog.at_level("WARNING"):
        hook = SamplingHook(section, model, tok, Runtime(torch.device("cpu")))
    assert not hook.use_cache and not hook.compile
    assert "forward takes no cache argument" in caplog.text and "sampling.compile = true ignored" in caplog.text
    ids = generate(model, hook.prompt_ids, max_new_tokens=5, use_cache=False)
    assert hook.sample() == [{"prompt": "ab", "completion": tok.decode(ids[0])}]


# ----------------------------------------------------------------------------- stopping and sampling


def test_eos_stops_a_row_and_all_rows_stopping_ends_the_loop():
    model = random_model("llama3")
    prompts = token_prompts(3)
    full = generate(model, prompts, max_new_tokens=10)
    eos = full[0][3]
    got = generate(model, prompts, max_new_tokens=10, eos_ids=[eos])
    for row, ids in zip(got, full):
        assert row == (ids[: ids.index(eos) + 1] if eos in ids else ids)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    assert generate(model, prompts, max_new_tokens=10, eos_ids=[r[0] for r in full]) == [[r[0]] for r in full]
    assert len(calls) == 1  # the prefill only: every row stopped at its first token


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = random_model("llama3")
    prompts = token_prompts(3)

    def sampled(seed, **kw):
        kw = {"temperature": 1.0, **kw}
        return generate(model, prompts, max_new_tokens=12, generator=torch.Generator().manual_seed(seed), **kw)

    assert sampled(5) == sampled(5)
    assert sampled(5) != sampled(6)
    assert sampled(5, top_k=1) == generate(model, prompts, max_new_tokens=12)
    assert sampled(5, temperature=0.7, top_p=0.9) == sampled(5, temperature=0.7, top_p=0.9, use_cache=False)


def test_sampling_leaves_the_global_rng_alone():
    model = random_model("llama3")
    before = torch.get_rng_state()
    generate(model, token_prompts(2), max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(1))
    generate(model, token_prompts(2), max_new_tokens=6, temperature=1.0, top_k=5, top_p=0.5)  # its own generator
    assert torch.equal(torch.get_rng_state(), before)
    with pytest.raises(ValueError, match="needs a torch.Generator"):
        sample_next(torch.zeros(1, 4), temperature=1.0)


def analytic(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """The sampling distribution by hand: tempered softmax, top-k, then the nucleus, renormalized."""
    z = [v / temperature for v in logits]
    if top_k:
        kth = sorted(z, reverse=True)[top_k - 1]
        z = [v if v >= kth else -math.inf for v in z]
    e = [math.exp(v - max(z)) for v in z]
    p = [v / sum(e) for v in e]
    if top_p < 1:
        kept, mass = set(), 0.0
        for i in sorted(range(len(p)), key=lambda i: -p[i]):
            if mass >= top_p:
                break
            kept.add(i)
            mass += p[i]
        p = [v / mass if i in kept else 0.0 for i, v in enumerate(p)]
    return p


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.6, 0, 1.0), (2.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8), (1.5, 4, 0.7), (0.8, 1, 1.0)],
)
def test_sampled_frequencies_match_the_analytic_distribution(temperature, top_k, top_p):
    logits = [2.0, 1.0, 0.5, 0.0, -1.0, 3.0, 1.6]
    n = 20_000
    draws = sample_next(
        torch.tensor([logits]).expand(n, -1).contiguous(), temperature, top_k, top_p, torch.Generator().manual_seed(0)
    )
    counts = torch.bincount(draws, minlength=len(logits)).tolist()
    for i, p in enumerate(analytic(logits, temperature, top_k, top_p)):
        if p == 0:
            assert counts[i] == 0, (i, counts)
        else:
            assert abs(counts[i] / n - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12, (i, counts[i] / n, p)


# ----------------------------------------------------------------------------- distributed


def _sharded_generate(args: dict) -> dict:
    """On each rank: the same weights as FSDP 2 and as TP 2 (loss parallel: vocabulary-sharded logits)."""
    import torch.distributed as dist

    from titanlite.models import get_model_spec
    from titanlite.parallel import ParallelDims, build_parallel_model
    from titanlite.parallel.policies import Policies
    from titanlite.parallel.state_dict import load_full_state_dict

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = {}
    for name, degrees in (("fsdp", dict(dp_shard=2)), ("tp", dict(dp_shard=1, tp=2))):
        dims = ParallelDims(world_size=2, **degrees)
        dims.build_mesh("cpu")
        model = build_parallel_model(get_model_spec("llama3"), args["model_args"], dims, Policies())
        load_full_state_dict(model, args["state"] if dist.get_rank() == 0 else None)
        model.eval()
        out[name] = run_all(model, args["prompts"], seed=3 + 100 * dist.get_rank())  # only rank 0's seed counts
        calls, broadcast = [], dist.broadcast
        dist.broadcast = lambda *a, _calls=calls, _broadcast=broadcast, **k: _calls.append(1) or _broadcast(*a, **k)
        try:  # compile is refused for a sharded model: eager, one broadcast per generated token
            out[name]["compiled"] = generate(model, args["prompts"], max_new_tokens=8, compile=True)
        finally:
            dist.broadcast = broadcast
        out[name]["broadcasts"] = len(calls)
    return out


def run_all(model, prompts, seed: int = 3) -> dict:
    return {
        "greedy": generate(model, prompts, max_new_tokens=8),
        "recomputed": generate(model, prompts, max_new_tokens=8, use_cache=False),
        "sampled": generate(
            model, prompts, max_new_tokens=8, temperature=1.0, top_k=50, generator=torch.Generator().manual_seed(seed)
        ),
    }


def test_fsdp_and_tp_ranks_generate_what_one_process_does():
    model = random_model("llama3")
    prompts = token_prompts(3)
    expected = run_all(model, prompts)
    args = {"model_args": model.args, "state": model.state_dict(), "prompts": prompts}
    results = run_workers(_sharded_generate, 2, args, timeout=120)
    expected.update(compiled=expected["greedy"], broadcasts=8)
    for rank, result in enumerate(results):
        for name in ("fsdp", "tp"):
            assert result[name] == expected, (rank, name)


# ----------------------------------------------------------------------------- command-line errors


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--prompt", "x"], "the following arguments are required: --checkpoint"),
        (["--checkpoint", "{missing}", "--prompt", "x"], "no such folder"),
        (["--checkpoint", "{step}"], "no prompt: pass --prompt TEXT or --prompt-file FILE"),
        (["--checkpoint", "{step}", "--prompt-file", "{missing}"], "--prompt-file {missing}: cannot be read"),
        (["--checkpoint", "{step}", "--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0"),
        (["--checkpoint", "{step}", "--prompt", "x", "--temperature", "nan"], "--temperature must be >= 0"),
        (["--checkpoint", "{step}", "--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--checkpoint", "{step}", "--prompt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--checkpoint", "{step}", "--prompt", "x", "--top-k", "-2"], "--top-k must be >= 0"),
        (["--checkpoint", "{step}", "--prompt", "x", "--top-k", "two"], "argument --top-k: invalid int value"),
        (["--checkpoint", "{step}", "--prompt", "x", "--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
        (["--checkpoint", "{step}", "--prompt", "x", "--max-new-tokens", "5000"], "exceed the model's max_seq_len"),
        (["--checkpoint", "{step}", "--prompt", "", "--no-bos"], "prompt 0 is empty"),
        (["--checkpoint", "{step}", "--prompt", "x", "--context-window", "0"], "--context-window must be >= 1"),
        (["--checkpoint", "{bare}", "--prompt", "x"], "has no tokenizer files: pass a tokenizer path"),
        (["--checkpoint", "{step}", "--prompt", "x", "--dtype", "int8"], "argument --dtype: invalid choice"),
    ],
)
def test_cli_errors_are_one_line_with_exit_status_2(trained, tmp_path, capsys, argv, message):
    step, hf = trained
    bare = shutil.copytree(hf, tmp_path / "bare")  # an HF folder without the tokenizer files an export carries
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    names = {"step": step, "hf": hf, "bare": bare, "missing": tmp_path / "missing"}
    argv = [a.format(**names) for a in argv]
    capsys.readouterr()
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    assert message.format(**names) in err


def test_the_module_exits_2_on_bad_input(tmp_path):
    proc = run_python(
        [sys.executable, "-m", "titanlite.generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x"],
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr == f"error: {tmp_path / 'nope'}: no such folder\n", proc.stderr


@pytest.mark.parametrize("seed", [str(10**23), str(2**64), str(-(2**63) - 1), "1e23"])
def test_a_seed_outside_torchs_range_is_refused_as_parsed(seed, tmp_path, capsys):
    """``--seed 100000000000000000000000`` passed the parser, loaded the model, then failed in manual_seed with
    "Overflow when unpacking long long": now the parser refuses it, before the (missing) checkpoint is read. The
    range is the one torch's generator takes: both ends are accepted there, one past them refused."""
    assert main(["--checkpoint", str(tmp_path / "missing"), "--prompt", "x", "--seed", seed]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument --seed: expected an integer >= {-(2**63)} and <= {2**64 - 1}" in err
    for end in (-(2**63), 2**64 - 1):
        torch.Generator().manual_seed(end)
    for beyond in (-(2**63) - 1, 2**64):
        with pytest.raises((ValueError, RuntimeError, OverflowError)):
            torch.Generator().manual_seed(beyond)


def test_generate_names_prompts_of_the_wrong_type():
    """A tensor of prompts failed in ``not prompt`` (an ambiguous truth value), float ids deep in the model: a
    TypeError naming the argument instead."""
    model = random_model("llama3")
    kw = dict(max_new_tokens=3)
    with pytest.raises(TypeError, match=r"prompts must be a list of token-id lists, got Tensor \(a tensor of prompts"):
        generate(model, torch.tensor([[1, 2, 3]]), **kw)
    with pytest.raises(TypeError, match=r"prompts\[1\] holds 0\.0 \(float\); token ids are ints"):
        generate(model, [[1, 2], [1, 0.0]], **kw)
    with pytest.raises(TypeError, match=r"prompts\[0\] holds 2\.0 \(float\)"):
        generate(model, [[1.0 + 1, 3]], **kw)
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a list of int token ids, got Tensor"):
        generate(model, [torch.tensor([1, 2])], **kw)
    with pytest.raises(TypeError, match=r"prompts\[0\] holds True \(bool\)"):
        generate(model, [[True, 2]], **kw)
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a list of int token ids, got tuple"):
        generate(model, [(5, 6, 7)], **kw)
    assert generate(model, ([5, 6, 7],), **kw) == generate(model, [[5, 6, 7]], **kw)  # a tuple of prompts is fine
