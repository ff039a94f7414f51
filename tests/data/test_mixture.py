"""Weighted mixtures (titanlite.data.mixture) and packed, masked windows (titanlite.data.windows)."""

from __future__ import annotations

import math

import pytest
import torch

from titanlite.data.loader import build_dataloader
from titanlite.data.mixture import DataExhausted, MixtureWindows
from titanlite.data.windows import IGNORE_INDEX, TokenWindows, pack_documents

SIZES = [8000, 800, 4000]  # tokens per source: 1000, 100 and 500 windows of 8
WEIGHTS = [0.7, 0.2, 0.1]


def mixture(dp_rank=0, dp_world=1, on_exhausted="wrap", weights=WEIGHTS, batch_size=1, seed=3):
    sources = [
        TokenWindows(torch.arange(i * 100_000, i * 100_000 + n), 7, seed=i + 1, dp_rank=dp_rank, dp_world=dp_world)
        for i, n in enumerate(SIZES)
    ]
    kw = dict(seed=seed, dp_rank=dp_rank, dp_world=dp_world, on_exhausted=on_exhausted, batch_size=batch_size)
    return MixtureWindows(sources, weights, ["web", "code", "books"], **kw)


def take(dataset, n):
    it = iter(dataset)
    return [next(it) for _ in range(n)]


def test_proportions_match_the_weights_within_binomial_error():
    n = 20_000
    counts = torch.bincount(torch.stack([x["source"] for x in take(mixture(), n)]), minlength=3).tolist()
    for count, w in zip(counts, WEIGHTS):
        assert abs(count - n * w) < 4 * math.sqrt(n * w * (1 - w)), (counts, WEIGHTS)
    # the check has teeth: the same counts are far outside the band of a wrong weight
    assert abs(counts[1] - n * 0.25) > 4 * math.sqrt(n * 0.25 * 0.75)


def test_windows_come_from_their_source_in_its_own_order_and_wrap():
    m = mixture()
    items = take(m, 3000)
    for s in range(len(SIZES)):  # the source's k-th window is its permutation's k-th (epoch by epoch)
        mine = [x["input_ids"] for x in items if int(x["source"]) == s]
        src = m.sources[s]
        order = torch.cat([src._order(e) for e in range(len(mine) // src.num_windows + 1)])
        for k, ids in enumerate(mine):
            assert torch.equal(ids, src._window(int(order[k]))["input_ids"])
    assert m.epochs[1] >= 4  # 100 windows, ~600 draws: wrapped several times


def test_source_counts_give_every_rank_the_global_count():
    a, b = mixture(0, 2), mixture(1, 2)
    xa, xb = take(a, 50), take(b, 50)
    for ia, ib in zip(xa, xb):
        assert torch.equal(ia["source_counts"], ib["source_counts"])
        expected = torch.bincount(torch.stack([ia["source"], ib["source"]]), minlength=3)
        assert torch.equal(ia["source_counts"], expected)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_bitwise(workers):
    full = [b["input_ids"] for b in take(build_dataloader(None, dataset=mixture(batch_size=4), batch_size=4), 12)]
    loader = build_dataloader(None, dataset=mixture(batch_size=4), batch_size=4, num_workers=workers)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    again = build_dataloader(None, dataset=mixture(batch_size=4), batch_size=4, num_workers=workers)
    again.load_state_dict(state)
    rest = [b["input_ids"] for b in take(again, 7)]
    assert all(torch.equal(x, y) for x, y in zip(rest, full[5:]))


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_a_data_parallel_change_continues_the_global_sequence(before, after):
    reference = [x["input_ids"] for x in take(mixture(), 40)]

    def row(ranks, n):  # the global order: rank 0's window, rank 1's, ... per cursor row
        its = [iter(r) for r in ranks]
        return [next(it)["input_ids"] for _ in range(n) for it in its], ranks

    got, old = row([mixture(r, before) for r in range(before)], 20 // before)
    new = [mixture(r, after) for r in range(after)]
    for r in new:
        r.load_state_dict(old[0].state_dict())
    got += row(new, 20 // after)[0]
    assert all(torch.equal(x, y) for x, y in zip(got, reference))


def test_stop_raises_data_exhausted_also_from_a_worker():
    with pytest.raises(DataExhausted, match="source 'code' ran out after 1 epoch.*mixture_on_exhausted = 'stop'"):
        take(mixture(on_exhausted="stop"), 2000)
    loader = build_dataloader(None, dataset=mixture(on_exhausted="stop"), batch_size=8, num_workers=1)
    with pytest.raises(DataExhausted, match="source 'code' ran out"):
        take(loader, 400)


def test_a_changed_setup_is_refused_by_name():
    state = mixture().state_dict()
    with pytest.raises(ValueError, match="source 'code' weight changed from 0.2 to 0.3"):
        mixture(weights=[0.7, 0.3, 0.1]).load_state_dict(state)
    with pytest.raises(ValueError, match="checkpoint has seed=3, this run has 4"):
        mixture(seed=4).load_state_dict(state)


def test_pack_documents_keeps_whole_documents():
    offsets = [0, 3, 5, 12, 13, 20]  # documents of 3, 2, 7, 1 and 7 tokens, windows of 6
    starts, lengths, truncated = pack_documents(offsets, 6)
    assert starts.tolist() == [0, 5, 12, 13] and lengths.tolist() == [5, 6, 1, 6] and truncated == 2


def test_packed_windows_pad_mask_and_separate_documents():
    eos = 99
    docs = [[1, 2, eos], [3, 4, 5, eos], [6, eos]]  # 3 + 4 + 2 tokens; windows of seq_len + 1 = 8
    tokens = torch.tensor([t for d in docs for t in d])
    mask = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 1], dtype=torch.uint8)  # 1 = train on this token
    offsets = [0, 3, 7, 9]
    w = TokenWindows(tokens, 7, shuffle=False, eos_id=eos, mask=mask, doc_offsets=offsets)
    assert w.num_windows == 2
    first, second = w._window(0), w._window(1)
    assert first["input_ids"].tolist() == [1, 2, eos, 3, 4, 5, eos]
    # targets 2, eos, 3, 4, 5, eos, pad: kept where the target's mask is 1, never the padding
    assert first["labels"].tolist() == [2, eos, IGNORE_INDEX, IGNORE_INDEX, 5, IGNORE_INDEX, IGNORE_INDEX]
    assert second["input_ids"].tolist() == [6, eos, eos, eos, eos, eos, eos]
    assert second["labels"].tolist() == [eos, *[IGNORE_INDEX] * 6]
    assert first["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert second["document_ids"].tolist() == [0, 0, 1, 2, 3, 4, 5]  # each pad its own document


@pytest.mark.parametrize("eos", [99, 98], ids=["end_of_text", "eot_is_eos"])
def test_packed_document_ids_keep_each_conversation_whole(eos):
    """An Instruct tokenizer's EOS is <|eot_id|>, which also ends every message: the document ids of a
    packed window come from the conversation offsets, so each conversation stays one document."""
    eot = 98
    docs = [[1, eot, 2, 3, eot, eos], [4, eot, 5, eot, eos]]  # two conversations of two messages each
    tokens = torch.tensor([t for d in docs for t in d])
    w = TokenWindows(tokens, 13, shuffle=False, eos_id=eos, doc_offsets=[0, 6, 11])
    window = w._window(0)
    assert window["input_ids"].tolist() == [*docs[0], *docs[1], eos, eos]
    assert window["document_ids"].tolist() == [0] * 6 + [1] * 5 + [2, 3]


def test_huge_weights_are_normalized_safely_and_non_finite_ones_refused():
    """Two weights of 1e308 are 50/50 (their sum overflowed to inf and gave the first source every window);
    inf or NaN is refused by name (inf got 0% of the windows)."""
    n = 4_000
    picks = torch.stack([x["source"] for x in take(mixture(weights=[1e308, 1e308, 1e308]), n)])
    counts = torch.bincount(picks, minlength=3).tolist()
    for count in counts:
        assert abs(count - n / 3) < 4 * math.sqrt(n * 2 / 9), counts
    for bad in (math.inf, math.nan, 0.0):
        with pytest.raises(ValueError, match="mixture source 'code' has weight .*: weights must be finite and > 0"):
            mixture(weights=[1.0, bad, 1.0])
