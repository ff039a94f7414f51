"""The chunked output layer + loss (``[training] loss_chunks``, :mod:`titanlite.trainer.output_loss`) against the loss
computed from the model's full logits.

Reference: the same model's ``forward`` (its logits) and the registered loss on them, then autograd, i.e. what
titanlite computes with ``loss_chunks = 0``. Chunking only changes the fp32 summation order (of the pieces' loss
sums and of the weight gradient over the tokens), so the token-sum loss must agree within 1e-6 (relative) and
every gradient within 1e-5 of its tensor's largest entry, for 1..8 pieces (62 tokens: uneven pieces), with masked
labels (-100), in one process (Llama 3, and Qwen3 with a tied embedding), under FSDP 2, TP 2 with and without loss
parallel, FSDP 2 with the tied Qwen3 (its output weight in the root group), and across a pipeline's two stages.
Measured on CPU: loss <= 2e-7, gradients <= 2e-6. A dropped piece, a piece counted twice, a gradient not scaled
by the incoming one, or a TP gradient not reduced is off by far more.
"""

from __future__ import annotations

import dataclasses
import tempfile

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torchtitan_ext.qwen3  # noqa: F401  (registers the family)
from tests.helpers.dist import backends, cache_token_stores, run_workers
from tests.helpers.parity import make_config
from titanlite.models import build_model
from titanlite.trainer import Trainer
from titanlite.trainer.loss import cross_entropy_sum
from titanlite.trainer.output_loss import ChunkedLoss, LogitsLoss, chunk_sizes

LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5
CHUNKS = range(1, 9)
VOCAB = 512


def tiny(family: str = "llama3", **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    extra = dict(head_dim=32, ffn_hidden_dim=128) if family == "qwen3" else {}
    dims = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB)
    return build_model(family, "debugmodel", device="cpu", **dims, **extra, **kw)


def batch(rows: int = 2, seq: int = 31, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels with about a third of the labels masked, and one row entirely masked."""
    g = torch.Generator().manual_seed(seed)
    tokens, labels = (
        torch.randint(0, VOCAB, (rows, seq), generator=g),
        torch.randint(0, VOCAB, (rows, seq), generator=g),
    )
    labels[torch.rand(rows, seq, generator=g) < 0.3] = -100
    if rows > 2:
        labels[-1] = -100
    return tokens, labels


def loss_and_grads(model, loss, tokens, labels, divisor: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    total = loss(model, model(tokens, **loss.model_kwargs), labels)
    (total / divisor).backward()
    return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_matches(name: str, got: tuple, ref: tuple) -> tuple[float, float]:
    """``(loss relative error, worst gradient error relative to its tensor's largest entry)``, within tolerance."""
    (loss, grads), (ref_loss, ref_grads) = got, ref
    loss_err = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
    assert loss_err <= LOSS_RTOL, f"{name}: loss {float(loss)} vs {float(ref_loss)} ({loss_err:.2e})"
    assert grads.keys() == ref_grads.keys()
    grad_err = 0.0
    for key, g in grads.items():
        scale = ref_grads[key].abs().max().clamp(min=1e-30)
        err = ((g - ref_grads[key]).abs().max() / scale).item()
        assert err <= GRAD_RTOL, f"{name}: gradient of {key} off by {err:.2e} of its largest entry"
        grad_err = max(grad_err, err)
    return loss_err, grad_err


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_chunked_loss_equals_the_loss_of_the_logits(family):
    model = tiny(family)
    assert (model.output.weight is model.tok_embeddings.weight) == (family == "qwen3")  # Qwen3's is tied
    tokens, labels = batch()
    ref = loss_and_grads(model, LogitsLoss(cross_entropy_sum), tokens, labels, 62)
    for n in CHUNKS:
        got = loss_and_grads(model, ChunkedLoss(cross_entropy_sum, n), tokens, labels, 62)
        assert_matches(f"{family} {n} chunks", got, ref)
    hidden = model(tokens, return_hidden=True)
    assert hidden.shape == (*tokens.shape, 64) and torch.equal(model.output(hidden), model(tokens))


def test_chunks_under_bf16_autocast_and_without_gradients():
    """The output matmul runs in the autocast dtype (as unchunked), the loss in fp32; no_grad gives the sum alone."""
    model, (tokens, labels) = tiny(), batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = loss_and_grads(model, LogitsLoss(cross_entropy_sum), tokens, labels, 62)
        got = loss_and_grads(model, ChunkedLoss(cross_entropy_sum, 4), tokens, labels, 62)
    assert ref[0].dtype == got[0].dtype == torch.float32
    assert abs(float(got[0]) - float(ref[0])) <= 1e-4 * abs(float(ref[0]))
    for key, g in got[1].items():  # bf16 gradients: the weight's is summed over pieces in fp32
        assert g.dtype == torch.float32
        assert (g - ref[1][key]).abs().max() <= 2e-2 * ref[1][key].abs().max(), key
    with torch.no_grad():
        loss = ChunkedLoss(cross_entropy_sum, 3)(model, model(tokens, return_hidden=True), labels)
        assert loss.grad_fn is None and abs(float(loss) - float(cross_entropy_sum(model(tokens), labels))) < 1e-4


class LargestLogits(TorchDispatchMode):
    """The largest tensor with a vocabulary-sized last dimension that any op allocates (views, such as the output
    weight's transpose, allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in [] if func.is_view else out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == VOCAB:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_full_logits_exist_in_forward_or_backward():
    model, (tokens, labels) = tiny(), batch()
    for loss, expected in [
        (LogitsLoss(cross_entropy_sum), 62 * VOCAB),
        (ChunkedLoss(cross_entropy_sum, 4), 16 * VOCAB),
    ]:
        with LargestLogits() as seen:
            loss_and_grads(model, loss, tokens, labels, 62)
        assert seen.largest == expected, (type(loss).__name__, seen.largest)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cross_entropy_gradient_in_closed_form_is_autograds(dtype):
    """cross_entropy_sum_and_grad (used for the pieces of the built-in loss) against autograd through
    cross_entropy_sum, with masked labels; the gradient in the logits' dtype, as autograd returns it."""
    from titanlite.trainer.loss import cross_entropy_sum_and_grad

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, VOCAB, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (2, 5), generator=g)
    labels[0, 1:4] = -100
    loss, grad = cross_entropy_sum_and_grad(logits.detach(), labels)
    (ref_grad,) = torch.autograd.grad(ref := cross_entropy_sum(logits, labels), [logits])
    assert grad.dtype == ref_grad.dtype == dtype and grad.shape == logits.shape
    assert abs(float(loss) - float(ref.detach())) <= 1e-6 * abs(float(ref.detach()))
    assert (grad[0, 1:4] == 0).all()
    assert (grad.float() - ref_grad.float()).abs().max() <= (1e-6 if dtype == torch.float32 else 4e-3)


def test_chunk_sizes():
    assert chunk_sizes(62, 8) == [8] * 7 + [6]
    assert chunk_sizes(64, 4) == [16] * 4
    assert chunk_sizes(3, 8) == [1, 1, 1]  # never an empty piece
    assert sum(chunk_sizes(1000, 7)) == 1000 and len(chunk_sizes(1000, 7)) == 7


def test_the_benchmark_table_compares_with_the_first_setting():
    from titanlite.bench import loss_chunks as bench

    run = lambda mem, step, cpu: dict(peak_memory_gib=mem, step_time_s=step, run_cpu_s=cpu, loss_last=1.0)  # noqa: E731
    rows, text = bench.table({0: [run(4, 2, 10), run(6, 4, 30)], 8: [run(2, 2, 10), run(2, 1, 10)]})
    assert rows[0]["peak_memory_gib"] == 5 and rows[1]["memory_vs_first"] == 0.4  # medians of the repeats
    assert rows[1]["step_time_vs_first"] == 0.5 and rows[1]["run_cpu_vs_first"] == 0.5
    assert text.splitlines()[3].startswith("| 8 | 2.00 | 0.40 |")


def test_output_layers_the_chunked_loss_cannot_use():
    """Every family returns hidden states (titanlite.models.protocol); its output layer is checked on the module."""

    class Scaled(torch.nn.Linear):  # e.g. a float8 output layer: its forward is not F.linear
        def forward(self, x):
            return 2 * super().forward(x)

    model = tiny()
    ChunkedLoss.check(model)
    for head in (torch.nn.Linear(64, VOCAB), Scaled(64, VOCAB, bias=False)):  # refused, naming the key
        model.output = head
        with pytest.raises(ValueError, match="bias-free nn.Linear computing F.linear .*set training.loss_chunks = 0"):
            ChunkedLoss(cross_entropy_sum, 2)(model, torch.zeros(1, 2, 64), torch.zeros(1, 2, dtype=torch.long))


# ---------------------------------------------------------------------------- distributed (gloo)

PP = ["--model.n_layers", "4", "--parallelism.pipeline_parallel_degree", "2"]
QWEN3 = ["--model.name", "qwen3", "--model.head_dim", "32", "--model.ffn_hidden_dim", "128"]
CONFIGS = {  # name -> (data-parallel degree, options); each builds a Trainer on 2 ranks
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2_loss_parallel": (1, ["--parallelism.tensor_parallel_degree", "2"]),
    "tp2_gathered": (1, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_loss_parallel", "false"]),
    "qwen3_tied_fsdp2": (2, [*QWEN3, "--parallelism.data_parallel_shard_degree", "2"]),
    "pp2_1f1b": (1, [*PP, "--parallelism.pipeline_parallel_schedule", "1F1B"]),
    # zero bubble: the loss's backward runs twice (input gradients, then weight gradients); the last stage on rank 0
    "pp2_zbv": (1, [*PP, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]),
}


def chunks_worker(args: dict) -> dict:
    """Per configuration: this rank's loss sum and full gradients for 0 (the logits) and 1..8 chunks."""
    from titanlite.trainer.output_loss import output_loss

    cache_token_stores()
    out = {}
    for name, (dp, extra) in args["configs"].items():
        with tempfile.TemporaryDirectory() as dump:
            trainer = Trainer(make_config(dump, dp, extra + ["--training.local_batch_size", str(4 // dp)]))
            step, lp = trainer.train_step, trainer.parallel_dims.loss_parallel_enabled
            tokens, labels = args["batch"]
            rows = slice(trainer.dp_rank * (4 // dp), (trainer.dp_rank + 1) * (4 // dp))
            micro = {"input_ids": tokens[rows], "labels": labels[rows]}
            results = []
            for n in [0, *CHUNKS]:
                step.runtime = dataclasses.replace(
                    step.runtime, loss=output_loss(cross_entropy_sum, n, loss_parallel=lp)
                )
                if step.pipeline is not None:
                    step.pipeline.output_loss, step.pipeline.loss_fn = step.loss, step.pipeline.bind(step.loss)
                trainer.optimizer.zero_grad(set_to_none=True)
                loss = step.forward_backward(micro, 4 * 32)
                grads = {k: p.grad for k, p in trainer.model.named_parameters()}
                grads = {k: (g.full_tensor() if hasattr(g, "full_tensor") else g).clone() for k, g in grads.items()}
                results.append((loss.clone(), grads))
            out[name] = {"results": results, "has_loss": step.pipeline is None or step.pipeline.has_last}
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", backends(2))
def test_chunked_loss_equals_the_logits_loss_under_fsdp_tp_and_pipelining(backend):
    tokens, labels = batch(rows=4, seq=32, seed=1)
    per_rank = run_workers(
        chunks_worker, 2, {"configs": CONFIGS, "batch": (tokens, labels)}, backend=backend, timeout=400
    )
    report = []
    for name in CONFIGS:
        for rank, res in enumerate(per_rank):
            ref, *chunked = res[name]["results"]
            assert ref[1] and all(g.abs().sum() > 0 for g in ref[1].values()), f"{name}: a parameter got no gradient"
            if not res[name]["has_loss"]:  # an earlier pipeline stage: 0 here, the loss is the last stage's
                assert float(ref[0]) == 0 and all(float(loss) == 0 for loss, _ in chunked)
                ref, chunked = (torch.ones(()), ref[1]), [(torch.ones(()), grads) for _, grads in chunked]
            for n, got in zip(CHUNKS, chunked):
                errs = assert_matches(f"{name} rank {rank} {n} chunks", got, ref)
                report.append(f"{name:18s} rank {rank} {n} chunks: loss {errs[0]:.1e} grads {errs[1]:.1e}")
    print("\n".join(report))


# ---------------------------------------------------------------------------- the debug run, eager and compiled

DEBUG = [
    "--config",
    "train_configs/debug_model.toml",
    "--training.steps",
    "3",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "4",
    "--training.global_batch_size",
    "8",  # two micro-batches: accumulation
    "--lr_scheduler.warmup_steps",
    "1",
    "--validation.freq",
    "3",
    "--validation.steps",
    "2",
    "--checkpoint.enable",
    "false",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.log_freq",
    "1",
]


def debug_run(dump, *extra: str) -> dict[str, list[float]]:
    from titanlite.models import load_config

    cache_token_stores()  # the embedded corpus is tokenized once per process
    records = Trainer(load_config([*DEBUG, "--job.dump_folder", str(dump), *extra])).train()
    return {key: [r[key] for r in records if key in r] for key in ("loss", "grad_norm", "val_loss")}


@pytest.fixture(scope="module")
def unchunked_debug_run(tmp_path_factory):
    return debug_run(tmp_path_factory.mktemp("debug"), "--training.loss_chunks", "0")


def assert_runs_match(got: dict, ref: dict, rtol: float) -> None:
    for key, values in ref.items():
        assert len(got[key]) == len(values) == (1 if key == "val_loss" else 3), key
        rel = max(abs(a - b) / abs(b) for a, b in zip(got[key], values))
        assert rel <= rtol, f"{key}: {got[key]} vs {values} ({rel:.2e})"


def test_a_debug_run_with_chunks_has_the_losses_of_one_without(tmp_path, unchunked_debug_run):
    """Three steps of the debug model (two micro-batches each, validation at the end) with 8 chunks."""
    assert_runs_match(debug_run(tmp_path, "--training.loss_chunks", "8"), unchunked_debug_run, 1e-6)


def test_the_compiled_step_has_no_graph_breaks(tmp_path, unchunked_debug_run):
    """[compile] on, chunked, full activation checkpointing: the blocks (their checkpoint traced as a higher-order
    op), the embedding, the final norm and the pieces' loss are compiled by inductor, none with a graph break; the
    losses and grad norms are the eager unchunked run's (no AC) within compile's tolerance (inductor fuses and
    reorders the fp32 reductions: the parity tests' RTOL_COMPILE). Validation is off: its no-grad graphs are
    inductor's inference graphs, which the compiled decode loop runs (tests/eval/test_generate.py)."""
    from torch._dynamo.utils import counters

    counters.clear()
    full_ac = ("--activation_checkpoint.mode", "full")  # torch.compile once failed on its checkpoint's context_fn
    no_val = ("--validation.enable", "false")
    got = debug_run(tmp_path, "--compile.enable", "true", "--training.loss_chunks", "4", *full_ac, *no_val)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])  # the block, embedding, norm, loss
    assert got["val_loss"] == []
    assert_runs_match(got, {k: unchunked_debug_run[k] for k in ("loss", "grad_norm")}, 2e-4)
