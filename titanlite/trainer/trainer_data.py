"""Where the trainer's batches come from: the training loader (one source's windows or a weighted mixture, per
seq_len stage) and the validation loaders, from ``[training]`` and ``[validation]`` (the datasets themselves:
:mod:`titanlite.data.recipe`)."""

from __future__ import annotations

import functools
from typing import Any

from titanlite.data.loader import build_dataloader
from titanlite.data.recipe import SourceData, load_sources, source_windows, training_dataset
from titanlite.data.staged import StagedLoader


class TrainerData:
    """The data builders of :class:`titanlite.trainer.Trainer` (override them in a subclass of it); they read its
    ``cfg``, ``tokenizer``, ``model_args``, ``run_plan``, ``parallel_dims`` and ``dp_rank``."""

    @functools.cached_property
    def train_sources(self) -> list[tuple[SourceData, float]]:
        """``[training]``'s data: each source and its weight (:func:`~titanlite.data.recipe.load_sources`)."""
        return load_sources(self.cfg.training, self.cfg.validation, "train", self.tokenizer, self.block_causal)

    @property
    def block_causal(self) -> bool:
        """Block-causal attention: documents packed in a window do not attend to one another."""
        # optional in the family contract (titanlite.models.protocol): a family without it masks causally only
        return getattr(self.model_args, "attn_mask_type", "causal") != "causal"

    @property
    def eos_id_for_documents(self) -> int | None:
        """The EOS id that separates documents for block-causal attention (None for causal attention)."""
        return self.tokenizer.eos_id if self.block_causal else None

    def window_options(self) -> dict:
        """How every loader cuts and shares windows: the loss mask, document ends, padding and this rank's share."""
        t, dims = self.cfg.training, self.parallel_dims
        return dict(
            loss_mask=t.loss_mask,
            eos_id=self.eos_id_for_documents,
            pad_id=self.tokenizer.eos_id,
            dp_rank=self.dp_rank,
            dp_world=dims.dp_degree,
        )

    def build_train_loader(self):
        """The training batches; with a ``seq_len_schedule``, a :class:`StagedLoader` over the stages."""
        if not self.cfg.training.seq_len_schedule:
            return self.build_train_dataloader()
        build = lambda i: self.build_train_dataloader(stage=i)  # noqa: E731
        return StagedLoader(build, self.run_plan.stage_index(1), num_stages=len(self.run_plan.stages))

    def build_train_dataloader(self, stage: int | None = None):
        """The training batches: one source's windows, or a weighted mixture of ``[training] mixture``; at
        ``stage``'s seq_len and local batch (its data order seeded from the seed and the stage)."""
        t = self.cfg.training
        seq_len, batch, seed = t.seq_len, t.local_batch_size, t.seed
        if stage is not None:
            s = self.run_plan.stages[stage]
            seq_len, batch, seed = s.seq_len, s.local_batch_size, t.seed + 1_000 * stage
        sources = self.train_sources
        dataset = training_dataset(
            [s for s, _ in sources],
            [w for _, w in sources],
            seq_len,
            mixture=bool(t.mixture),
            on_exhausted=t.mixture_on_exhausted,
            seed=seed,
            batch_size=batch,
            **self.window_options(),
        )
        return build_dataloader(None, dataset=dataset, batch_size=batch)

    def build_val_loaders(self) -> dict[str, tuple[float, Any]]:
        """``[validation]``: a finite, unshuffled loader per source (name -> (weight, loader))."""
        c, t = self.cfg, self.cfg.training
        kw = dict(batch_size=t.local_batch_size, shuffle=False, infinite=False, **self.window_options())
        loaders = {}
        for data, weight in load_sources(c.training, c.validation, "val", self.tokenizer, self.block_causal):
            name = f"val/{data.name}" if self.cfg.validation.mixture else "val"
            windows = source_windows(data, t.seq_len, seed=t.seed, name=name, **kw)
            loaders[data.name] = (weight, build_dataloader(None, dataset=windows, batch_size=t.local_batch_size))
        return loaders
