"""In-loop samples (``[sampling]``): the model completes fixed prompts every ``freq`` steps (docs/evaluation.md).

Sampling leaves training bitwise as it was: its tokens come from a generator of its own, reseeded from ``[sampling]
seed`` each time (so successive samples differ only by what the model learned), float8 linears run in high
precision and the model goes back to training mode. A sharded model, or a family whose ``forward`` takes no
``cache``, is said at the start (it samples eagerly, or by recomputing the prefix).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from titanlite.data.chat import chat_prompt_ids, special_id
from titanlite.errors import ConfigError
from titanlite.generate import check_request, compile_refusal, generate, no_cache_reason, sequence_multiple
from titanlite.models.kv_cache import supports_cache
from titanlite.parallel.float8 import float8_disabled
from titanlite.trainer.hooks import Hook, LoopState
from titanlite.trainer.runtime import Runtime

logger = logging.getLogger("titanlite")


class SamplingHook(Hook):
    def __init__(
        self,
        section: Any,
        model: nn.Module,
        tokenizer: Any,
        runtime: Runtime | None = None,
    ):
        """``runtime``: where and in which dtype the model runs (default: one process on the model's device)."""
        self.section, self.model, self.tokenizer = section, model, tokenizer
        self.runtime = runtime or Runtime.of(model)
        self.device = self.runtime.device
        self.chat = getattr(section, "chat", False)
        if self.chat:  # each prompt is a user turn; a reply ends at <|eot_id|>
            try:
                self.prompt_ids = [chat_prompt_ids(tokenizer, p) for p in section.prompts]
                self.stop_ids = (tokenizer.eos_id, special_id(tokenizer, "<|eot_id|>"))
            except ValueError as e:
                raise ConfigError(f"sampling.chat: {e}") from None
        else:
            self.prompt_ids = [tokenizer.encode(p, bos=True) for p in section.prompts]
            self.stop_ids = (tokenizer.eos_id,)
        try:  # now, not at the first sample after freq steps of training
            check_request(model, self.prompt_ids, section.max_new_tokens, sequence_multiple(model))
        except ValueError as e:
            raise ConfigError(f"sampling.prompts / sampling.max_new_tokens: {e}") from None
        self.use_cache = supports_cache(model)  # a family without the cache protocol: samples recompute
        if not self.use_cache:
            logger.warning("sampling: %s", no_cache_reason(model))
        self.compile = getattr(section, "compile", False)
        if self.compile and (reason := compile_refusal(model, self.use_cache)):
            logger.warning("sampling.compile = true ignored: %s; samples decode eagerly", reason)
            self.compile = False

    def on_step_end(self, state: LoopState, result: Any) -> None:
        if state.step % self.section.freq == 0 or state.last_step:
            with state.side_work():
                samples = self.sample()
            state.log({"step": state.step, "samples": samples})
            for s in samples:
                logger.info("step %d | sample | %r -> %r", state.step, s["prompt"], s["completion"])

    @torch.no_grad()
    def sample(self) -> list[dict[str, str]]:
        """Each prompt and its completion (without the EOS, or with ``chat`` the <|eot_id|>, that ended it)."""
        s, model = self.section, self.model
        generator = torch.Generator(device=self.device).manual_seed(s.seed)
        autocast = self.runtime.autocast(model)
        was_training = model.training
        model.eval()
        try:
            with float8_disabled(model), autocast:
                out = generate(
                    model,
                    self.prompt_ids,
                    max_new_tokens=s.max_new_tokens,
                    generator=generator,
                    device=self.device,
                    use_cache=self.use_cache,
                    compile=self.compile,
                    temperature=s.temperature,
                    top_k=s.top_k,
                    top_p=s.top_p,
                    eos_ids=self.stop_ids,
                )
        finally:
            model.train(was_training)
        stop = self.stop_ids
        return [
            {"prompt": p, "completion": self.tokenizer.decode(ids[:-1] if ids and ids[-1] in stop else ids)}
            for p, ids in zip(s.prompts, out)
        ]
