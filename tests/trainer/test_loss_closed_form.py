"""Which gradient the chunked loss's pieces take, built from a config as the trainer builds it
(:func:`titanlite.trainer.assemble.config_loss`, :func:`titanlite.trainer.output_loss.output_loss`): the
built-in cross-entropy's closed form (:data:`titanlite.trainer.output_loss.LOSS_GRADIENTS`), compiled where
``[compile]`` compiles the loss, as in the shipped GPU configs.

Which branch runs is seen by a spy wrapped around the registered closed form (it records whether dynamo was tracing
it), not by a flag of the loss. Reference: the same pieces differentiated by autograd (the loss wrapped in a lambda,
which has no closed form), eager. The closed form computes the same fp32 log-softmax, eager or fused by inductor, so
they agree to fp32 rounding: within 1e-6 of each tensor's largest entry (measured on CPU: the loss equal, the
gradients within 1e-7).
"""

from __future__ import annotations

import pytest
import torch

from titanlite.models import get_model_spec, load_config
from titanlite.models.registry import model_args_for
from titanlite.parallel import ParallelDims
from titanlite.trainer.assemble import config_loss
from titanlite.trainer.loss import cross_entropy_sum
from titanlite.trainer.output_loss import LOSS_GRADIENTS, ChunkedLoss, output_loss

VOCAB = 512
RTOL = 1e-6
SMALL_MODEL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2"]
SMALL_MODEL += ["--model.vocab_size", str(VOCAB), "--model.tokenizer_path", ""]


@pytest.fixture
def closed_form_calls(monkeypatch) -> list[bool]:
    """Every registered closed form replaced by a spy that records, per call (or trace), whether it was compiling."""
    calls: list[bool] = []
    for key, closed in list(LOSS_GRADIENTS.items()):

        def spy(logits, labels, closed=closed):
            calls.append(torch.compiler.is_compiling())
            return closed(logits, labels)

        monkeypatch.setitem(LOSS_GRADIENTS, key, spy)
    return calls


def trainer_loss(config: str) -> tuple[torch.nn.Module, ChunkedLoss]:
    """A small model of ``config``'s family and the output loss of ``config``, built as the trainer builds them."""
    cfg = load_config(["--config", config, *SMALL_MODEL])
    dims, spec = ParallelDims(world_size=1), get_model_spec(cfg.model.name)
    torch.manual_seed(0)
    model = spec.model_cls(model_args_for(cfg.model, VOCAB))
    model.init_weights()
    loss = output_loss(config_loss(cfg, dims), cfg.training.loss_chunks, loss_parallel=dims.loss_parallel_enabled)
    assert isinstance(loss, ChunkedLoss) and loss.chunks > 1, "the shipped config computes the loss in chunks"
    return model, loss


def loss_and_grads(model: torch.nn.Module, loss: ChunkedLoss) -> list[torch.Tensor]:
    """The token-sum loss of one batch (a third of its labels masked, 62 tokens: uneven pieces) and the gradients of
    the hidden states and the output weight."""
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, VOCAB, (2, 31), generator=g), torch.randint(0, VOCAB, (2, 31), generator=g)
    labels[torch.rand(2, 31, generator=g) < 0.3] = -100
    model.zero_grad(set_to_none=True)
    hidden = model(tokens, return_hidden=True).detach().requires_grad_()
    total = loss(model, hidden, labels)
    total.backward()
    return [total.detach(), hidden.grad, model.output.weight.grad]


def assert_close(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    for name, a, b in zip(["loss", "hidden states' gradient", "output weight's gradient"], got, ref):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err <= RTOL, f"{name}: off by {err:.2e} of its largest entry"


def autograd_reference(model: torch.nn.Module, loss: ChunkedLoss) -> list[torch.Tensor]:
    """The same pieces, each differentiated by autograd: a loss function with no closed form."""
    by_autograd = ChunkedLoss(lambda logits, labels: cross_entropy_sum(logits, labels), loss.chunks)
    assert by_autograd.closed_form is None
    return loss_and_grads(model, by_autograd)


@pytest.mark.parametrize("config", ["train_configs/llama1b.toml", "train_configs/llama8b.toml"])
def test_the_shipped_gpu_configs_run_the_compiled_closed_form(config, closed_form_calls):
    """[compile] components = ["model", "loss"]: the pieces take the closed form, traced by dynamo, and give
    autograd's loss and gradients."""
    model, loss = trainer_loss(config)
    got = loss_and_grads(model, loss)
    assert closed_form_calls, f"{config}: the chunked loss differentiated its pieces by autograd, not in closed form"
    assert all(closed_form_calls), f"{config}: the closed form ran eagerly although the config compiles the loss"
    assert_close(got, autograd_reference(model, loss))


def test_the_debug_config_runs_the_eager_closed_form(closed_form_calls):
    """No [compile]: the pieces take the closed form, eagerly, and give autograd's loss and gradients."""
    model, loss = trainer_loss("train_configs/debug_model.toml")
    got = loss_and_grads(model, loss)
    assert closed_form_calls and not any(closed_form_calls), closed_form_calls
    assert_close(got, autograd_reference(model, loss))
