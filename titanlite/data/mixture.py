"""A weighted mixture of data sources, sampled window by window, resumable exactly (docs/recipes.md).

Global window ``g`` (all data-parallel ranks' windows counted together) comes from the source a uniform draw
``u_g`` falls into on the cumulative weights; draws come in blocks of ``BLOCK`` from a generator seeded by
``(seed, block)``, so the sources depend on the seed and weights only, not on ranks or workers. The ``k``-th pick
of a source gives the ``k``-th window of its own shuffled order; read to its end, it wraps to a new epoch
(``on_exhausted = "wrap"``, logged) or raises :class:`DataExhausted` (``"stop"``). As in ``TokenWindows``, rank
``r`` takes global window ``pos + r``; every rank advances every source's cursor for the whole row, so each knows
the windows per source (``"source_counts"``, with no communication) and a resume with another data-parallel degree
continues exactly. Items are the source's plus ``"source"`` (its index) and ``"source_counts"``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from titanlite.data.windows import CHANGE_OF_KIND, TokenWindows, check_repartition
from titanlite.errors import DataError, UserError

logger = logging.getLogger(__name__)

BLOCK = 4096  # source draws per generator seed


class DataExhausted(UserError, RuntimeError):
    """A mixture source ran out with ``training.mixture_on_exhausted = "stop"``: the run stopped as its config
    asked (exit status 1)."""

    exit_code = 1


class MixtureWindows(IterableDataset):
    """Stateful iterable over one rank's windows of a weighted mixture (see the module docstring)."""

    def __init__(
        self,
        sources: Sequence[TokenWindows],
        weights: Sequence[float],
        names: Sequence[str],
        *,
        seed: int = 0,
        dp_rank: int = 0,
        dp_world: int = 1,
        batch_size: int = 1,
        on_exhausted: str = "wrap",
    ):
        if not (len(sources) == len(weights) == len(names)) or not sources:
            raise DataError("a mixture needs one weight and one name per source, and at least one source")
        if on_exhausted not in ("wrap", "stop"):
            raise DataError(f"on_exhausted must be 'wrap' or 'stop', got {on_exhausted!r}")
        self.sources, self.names = list(sources), list(names)
        self.weights = [float(w) for w in weights]
        if bad := [(n, w) for n, w in zip(names, self.weights) if not 0 < w < math.inf]:
            raise DataError(f"mixture source {bad[0][0]!r} has weight {bad[0][1]}: weights must be finite and > 0")
        self.seed, self.dp_rank, self.dp_world, self.batch_size = seed, dp_rank, dp_world, batch_size
        self.on_exhausted = on_exhausted
        shares = self.weights
        if not math.isfinite(sum(shares)):  # the sum of huge weights overflows: only their ratios count
            shares = [w / max(shares) for w in shares]
        self.bounds = torch.tensor(shares, dtype=torch.float64).cumsum(0) / sum(shares)
        self.pos, self.sample = 0, 0  # global windows taken by all ranks; this rank's samples
        self.epochs = [0] * len(sources)
        self.cursors = [0] * len(sources)
        self._block: tuple[int, list[int]] | None = None

    # ---- the deterministic sequence of sources ----
    def source_of(self, g: int) -> int:
        """The source of global window ``g``."""
        block = g // BLOCK
        if self._block is None or self._block[0] != block:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 7_919 * block + 104_729)
            u = torch.rand(BLOCK, generator=gen, dtype=torch.float64)
            picks = torch.searchsorted(self.bounds, u, right=True).clamp(max=len(self.sources) - 1)
            self._block = (block, picks.tolist())
        return self._block[1][g % BLOCK]

    def _take(self, s: int, orders: dict[int, torch.Tensor], log: bool) -> int:
        """The next window index of source ``s`` (advancing its cursor, wrapping or stopping at its end)."""
        src = self.sources[s]
        if self.cursors[s] >= src.num_windows:
            if self.on_exhausted == "stop":
                raise DataExhausted(
                    f"training data source {self.names[s]!r} ran out after {self.epochs[s] + 1} epoch(s) of "
                    f"{src.num_windows} windows (training.mixture_on_exhausted = 'stop')"
                )
            self.epochs[s], self.cursors[s] = self.epochs[s] + 1, 0
            orders.pop(s, None)
            if log:
                logger.info(
                    "mixture source %r: starting epoch %d (%d windows)", self.names[s], self.epochs[s], src.num_windows
                )
        if s not in orders:
            orders[s] = src._order(self.epochs[s])
        w = int(orders[s][self.cursors[s]])
        self.cursors[s] += 1
        return w

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        orders: dict[int, torch.Tensor] = {}
        n = len(self.sources)
        while True:
            row = [self.source_of(self.pos + j) for j in range(self.dp_world)]
            taken = [self._take(s, orders, log=worker == 0) for s in row]
            counts = torch.bincount(torch.tensor(row), minlength=n)
            mine = (self.sample // self.batch_size) % num_workers == worker
            self.pos += self.dp_world
            self.sample += 1
            if mine:
                s = row[self.dp_rank]
                item = self.sources[s]._window(taken[self.dp_rank])
                item["source"] = torch.tensor(s)
                item["source_counts"] = counts
                yield item

    # ---- checkpointing ----
    def setup(self) -> dict[str, Any]:
        """What must not change for a resume: the sources, their weights and windowing, the seed."""
        return {
            "names": list(self.names),
            "weights": list(self.weights),
            "num_windows": [src.num_windows for src in self.sources],
            "seq_len": self.sources[0].seq_len,
            "seed": self.seed,
        }

    def state_dict(self) -> dict[str, Any]:
        state = {"pos": self.pos, "sample": self.sample, "dp_world": self.dp_world}
        return {**state, "epochs": list(self.epochs), "cursors": list(self.cursors), "setup": self.setup()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "setup" not in state:  # a single source's TokenWindows state
            raise DataError(
                f"cannot resume the mixture: the checkpoint was saved without training.mixture (one source) and "
                f"this run has one; {CHANGE_OF_KIND}"
            )
        saved, now = state["setup"], self.setup()
        if saved["names"] != now["names"]:
            raise DataError(
                f"cannot resume the mixture: checkpoint has sources {saved['names']}, this run has {now['names']}"
            )
        for key in ("seq_len", "seed"):
            if saved[key] != now[key]:
                raise DataError(
                    f"cannot resume the mixture: checkpoint has {key}={saved[key]}, this run has {now[key]}"
                )
        for key, what in (("weights", "weight"), ("num_windows", "number of windows")):
            for name, old, new in zip(now["names"], saved[key], now[key]):
                if old != new:
                    raise DataError(
                        f"cannot resume the mixture: source {name!r} {what} changed from {old} to {new}"
                        + (" (its data changed)" if key == "num_windows" else "")
                    )
        if state["dp_world"] != self.dp_world:
            check_repartition("the mixture", state["dp_world"], self.dp_world, state["sample"], self.batch_size)
            logger.info(
                "mixture: re-partitioning from %d to %d data-parallel ranks at window %d",
                state["dp_world"],
                self.dp_world,
                state["pos"],
            )
        self.pos, self.sample = int(state["pos"]), int(state["sample"])
        self.epochs, self.cursors = [int(e) for e in state["epochs"]], [int(c) for c in state["cursors"]]
