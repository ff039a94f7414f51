"""``torch.compile`` policy (``[compile] enable, components, backend, mode``).

- ``"model"``: each transformer block's forward is compiled separately with ``fullgraph=True``
  (a graph break inside a block is then an error, not a silent slowdown). Blocks share one code
  object, so the compiled graph is reused by every block (dynamo lifts the parameters as inputs)
  and compile time does not grow with depth. The compiled function replaces ``block.forward`` on
  the instance, so parameter names do not change (no ``_orig_mod.`` prefix in checkpoints) and
  FSDP2's hooks, registered on the block later, stay outside the graph. Compiling after AC
  traces the checkpoint closure as one higher-order op; compiling after TP traces the DTensor ops.
  The modules around the blocks (:data:`END_MODULES`: the embedding and the final norm, where the
  model, or its pipeline stage, has them; not a tensor-parallel embedding, whose sharded lookup this
  torch fails to compile) are compiled the same way, so the step's forward and
  backward run compiled code except for the output matmul (a plain GEMM) and the loop itself; no
  compiled region has a graph break (``TORCH_LOGS=graph_breaks`` prints none; tested), except under context
  parallelism: there each block breaks once, around its attention, which gathers the keys and values over the
  CP ranks in autograd functions and runs eagerly (:func:`titanlite.models.llama3.model.context_parallel_attention`).
- ``"loss"``: the loss function is compiled (the cross-entropy's log-softmax, gather and sum fuse
  and the fp32 upcast of the logits is not materialized); not fullgraph, so a registered loss that
  breaks still runs. With ``[training] loss_chunks`` it is the loss of each piece
  (:mod:`titanlite.trainer.output_loss`), called with the same shapes every time.

With tensor parallelism the graphs contain collectives that name their process group, and in this
torch version the AOTAutograd on-disk cache does not key on those names: a graph cached by an
earlier run whose groups were created in another order (another parallelism layout, or several
Trainers in one process) is reused with a wrong group name and fails ("Could not resolve the
process group"). Compiled functions that run on DTensors therefore run under a scoped
``torch._functorch.config.patch(enable_autograd_cache=False)``: the cache is looked up and filled
only while AOTAutograd compiles a forward, so scoping the calls suffices and nothing is switched
off for the rest of the process. Inductor's own FX graph cache, whose key includes the group names,
still makes recompilation cheap.

The same cache does not key on SDPA's kernel priority either (``[training] sdpa_kernel``), which decides the attention
kernel when AOTAutograd traces a block: a run choosing a kernel would load the graph of an earlier run with torch's
choice. With a chosen kernel the compiled calls therefore skip that cache the same way (the inductor cache keys on
the traced graph, which names the kernel).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch._functorch.config
from torch import nn
from torch.distributed.tensor import DTensor

from titanlite.errors import ConfigError

# Modules of a decoder besides its blocks that "model" compiles, by attribute name (absent or None: skipped)
END_MODULES = ("tok_embeddings", "norm")


class CompilePolicy:
    """``fullgraph``: a graph break inside a block is an error; off under context parallelism, whose attention (the
    K/V all-gather and its autograd function) runs eagerly between the compiled parts of each block.

    ``backend`` and ``mode`` go to every ``torch.compile`` call: ``aot_eager`` traces exactly what inductor would be
    given (Dynamo and AOTAutograd, graph breaks and all) but runs the graphs with eager kernels, so no kernel is
    generated; ``mode = "reduce-overhead"`` makes inductor replay each compiled region as a CUDA graph.
    ``autograd_cache``: False for compiled calls that must not load AOTAutograd's cached graphs (see the module
    docstring: a chosen SDPA kernel)."""

    def __init__(
        self,
        enable: bool = False,
        components: Sequence[str] = ("model", "loss"),
        fullgraph: bool = True,
        backend: str = "inductor",
        mode: str = "default",
        autograd_cache: bool = True,
    ):
        unknown = sorted(set(components) - {"model", "loss"})
        if unknown:
            raise ConfigError(f"compile.components: unknown component(s) {', '.join(unknown)}; use model, loss")
        self.model = enable and "model" in components
        self.loss = enable and "loss" in components
        self.fullgraph = fullgraph
        self.options = {"backend": backend} | ({"mode": mode} if mode != "default" else {})
        self.autograd_cache = autograd_cache

    @classmethod
    def from_config(cls, section, context_parallel: bool = False, sdpa_kernel: str = "auto") -> CompilePolicy:
        """From ``[compile]``, under context parallelism or not, with ``[training] sdpa_kernel``."""
        options = {"backend": section.backend, "mode": section.mode, "autograd_cache": sdpa_kernel == "auto"}
        return cls(section.enable, section.components, not context_parallel, **options)

    def apply(self, model: nn.Module) -> int:
        """Compile every block of ``model.layers``, and the :data:`END_MODULES` it has, in place; returns how many
        blocks."""
        if not self.model:
            return 0
        ends = [m for name in END_MODULES if (m := getattr(model, name)) is not None]  # None on some pipeline stages
        for module in [*model.layers.values(), *ends]:
            on_dtensors = any(isinstance(p, DTensor) for p in module.parameters())  # TP applied
            if on_dtensors and isinstance(module, nn.Embedding):
                # the vocabulary-sharded lookup fails to compile in this torch ("Mixing fake modes"); a lookup
                # gains nothing from compiling anyway
                continue
            module.forward = self.compile(module.forward, on_dtensors, fullgraph=self.fullgraph)
        return len(model.layers)

    def compile(self, fn: Callable, on_dtensors: bool = False, fullgraph: bool = False) -> Callable:
        """``fn`` compiled with this policy's backend and mode (AOTAutograd's cache skipped on DTensors, or always
        without ``autograd_cache``)."""
        skip_cache = on_dtensors or not self.autograd_cache
        return compile_fn(fn, skip_cache, fullgraph=fullgraph, **self.options)

    def compile_loss(self, fn: Callable, tensor_parallel: bool = False) -> Callable:
        return self.compile(fn, tensor_parallel) if self.loss else fn


def compile_fn(fn: Callable, skip_autograd_cache: bool = False, **options) -> Callable:
    """``torch.compile(fn, **options)``; with ``skip_autograd_cache``, called without the AOTAutograd cache (on
    DTensors, or with a chosen SDPA kernel: see the module docstring)."""
    compiled = torch.compile(fn, **options)
    if not skip_autograd_cache:
        return compiled

    @functools.wraps(fn)
    def without_autograd_cache(*args, **kwargs):
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compiled(*args, **kwargs)

    return without_autograd_cache
