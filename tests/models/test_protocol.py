"""The model-family contract (titanlite.models.protocol): checked when a family registers, kept by every built-in
family, and the registries hold their built-ins whatever was imported before."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from titanlite.models import ModelSpec, get_model_spec, model_names, register_model
from titanlite.models.protocol import ARGS_MEMBERS, MODULE_MEMBERS

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ("llama3", "llama3_moe", "qwen3", "qwen3_moe")


@dataclasses.dataclass
class Args:
    vocab_size: int = 16
    n_layers: int = 1
    max_seq_len: int = 8
    tie_word_embeddings: bool = False


def forward(self, tokens, document_ids=None, return_hidden=False):
    raise NotImplementedError


def init_weights(self, buffer_device=None):
    raise NotImplementedError


def model_class(drop: str = "") -> type:
    """A model class declaring every member of the contract but ``drop``."""
    annotations = {name: "nn.Module | None" for name in MODULE_MEMBERS if name != drop}
    methods = {name: fn for name, fn in (("forward", forward), ("init_weights", init_weights)) if name != drop}
    return type("Toy", (nn.Module,), {"__annotations__": annotations, **methods})


def args_class(drop: str = "") -> type:
    return dataclasses.make_dataclass(
        "ToyArgs", [(f.name, f.type, f.default) for f in dataclasses.fields(Args) if f.name != drop]
    )


def spec(name: str, model_cls: type, args_cls: type = Args) -> ModelSpec:
    return ModelSpec(name=name, args_cls=args_cls, flavors={}, model_cls=model_cls)


def refusal(s: ModelSpec) -> str:
    with pytest.raises(ValueError) as e:
        register_model(s)
    assert s.name not in model_names()
    return str(e.value)


@pytest.mark.parametrize("member", MODULE_MEMBERS)
def test_a_model_without_a_member_is_refused_naming_it(member):
    msg = refusal(spec(f"toy_no_{member}", model_class(drop=member)))
    why = f"Toy declares no {member!r} (a class annotation, as in ModelFamily)"
    assert msg == f"model family 'toy_no_{member}' cannot register: {why}"


@pytest.mark.parametrize(
    "method, why",
    [("forward", "Toy.forward() takes no 'tokens' parameter"), ("init_weights", "Toy has no init_weights()")],
)
def test_a_model_without_a_method_is_refused(method, why):
    assert refusal(spec("toy_method", model_class(drop=method))).endswith(why)  # nn.Module's forward takes *input


@pytest.mark.parametrize(
    "fn, param",
    [
        (lambda self, tokens, document_ids=None: None, "return_hidden"),
        (lambda self, tokens, return_hidden=False: None, "document_ids"),
        (lambda self, tokens, **kwargs: None, "document_ids"),  # **kwargs would swallow what it does not do
    ],
)
def test_a_forward_without_the_contracts_parameters_is_refused(fn, param):
    cls = type("Toy", (model_class(),), {"forward": fn})
    msg = refusal(spec("toy_forward", cls))
    assert msg == f"model family 'toy_forward' cannot register: Toy.forward() takes no {param!r} parameter"
    cls = type("Toy", (model_class(),), {"init_weights": lambda self: None})
    assert refusal(spec("toy_init", cls)).endswith("Toy.init_weights() takes no 'buffer_device' parameter")


@pytest.mark.parametrize("field", ARGS_MEMBERS)
def test_args_without_a_field_are_refused(field):
    msg = refusal(spec("toy_args", model_class(), args_class(drop=field)))
    assert msg == f"model family 'toy_args' cannot register: its args ToyArgs have no {field!r} field"


def test_a_model_with_every_member_registers():
    s = register_model(spec("toy_complete", model_class()))
    assert get_model_spec("toy_complete") is s
    with pytest.raises(ValueError, match="model family 'llama3' is already registered"):
        register_model(dataclasses.replace(get_model_spec("llama3"), flavors={}))


@pytest.mark.parametrize("name", FAMILIES)
def test_every_built_in_family_keeps_the_contract(name):
    """Registered (so checked), and a model built on the meta device has the declared members' types (what
    ``return_hidden`` returns: tests/trainer/test_output_loss.py)."""
    import torchtitan_ext.qwen3  # noqa: F401  (an extension: registers "qwen3" when imported)
    import torchtitan_ext.qwen3_moe  # noqa: F401

    s = get_model_spec(name)
    flavor = min(s.flavors.values(), key=lambda a: a.n_layers * a.dim)
    with torch.device("meta"):
        model = s.model_cls(flavor)
    assert isinstance(model.layers, nn.ModuleDict) and len(model.layers) == flavor.n_layers
    assert isinstance(model.output, nn.Linear) and model.output.bias is None
    assert model.output.out_features == flavor.vocab_size and isinstance(model.tok_embeddings, nn.Embedding)
    assert isinstance(model.norm, nn.Module) and model.args is flavor


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO)},
    )


def test_registries_hold_their_built_ins_in_a_fresh_interpreter():
    """Nothing imported beforehand: each lookup finds its built-in (no import elsewhere has to register it)."""
    code = """
import sys
from titanlite import components
assert "titanlite.trainer.loss" not in sys.modules and "titanlite.optim" not in sys.modules  # nothing imported
from titanlite.trainer.loss import cross_entropy_sum
assert components.get("loss", "cross_entropy") is cross_entropy_sum
for kind, table in components.BUILTINS.items():
    for name in table:
        assert components.get(kind, name) is not None, (kind, name)
assert components.names("optimizer")[:2] == ["AdamW", "Adam"]
from titanlite.models import get_model_spec, model_names
assert "titanlite.models.llama3" not in sys.modules
assert model_names() == ["llama3", "llama3_moe"] and get_model_spec("llama3_moe").name == "llama3_moe"
print("ok")
"""
    out = _fresh(code)
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr[-2000:]


def test_a_component_under_a_built_in_name_is_refused():
    from titanlite import components
    from titanlite.trainer.loss import cross_entropy_sum

    assert components.register("loss", "cross_entropy", cross_entropy_sum) is cross_entropy_sum  # the same: idempotent
    with pytest.raises(ValueError, match="a loss named 'cross_entropy' is already registered"):
        components.register("loss", "cross_entropy", lambda logits, labels: logits.sum())
