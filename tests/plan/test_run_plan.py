"""Token budgets and seq_len stages (titanlite.plan.run_plan) against hand arithmetic."""

from __future__ import annotations

import pytest

from titanlite.plan.run_plan import plan_steps

BASE = dict(steps=100, tokens=-1, seq_len=2048, local_batch_size=8, grad_accum_steps=2, dp_degree=4)


def test_without_a_schedule_or_budget_one_stage_of_steps():
    plan = plan_steps(**BASE)
    (s,) = plan.stages
    assert (plan.total_steps, s.first_step, s.last_step, s.seq_len, s.local_batch_size) == (100, 1, 100, 2048, 8)
    assert s.tokens_per_step == 8 * 4 * 2 * 2048 == 131_072
    assert plan.log_lines[0] == (
        "100 steps x 131,072 tokens (local batch 8 x dp 4 x grad accumulation 2 x seq_len 2048) = 13,107,200 tokens"
    )


def test_a_token_budget_becomes_steps_exactly_or_with_the_overshoot_said():
    exact = plan_steps(**{**BASE, "tokens": 131_072 * 61})
    assert exact.total_steps == 61 and exact.total_tokens == 131_072 * 61
    assert exact.log_lines[-1].endswith("exactly the budget")
    over = plan_steps(**{**BASE, "tokens": 1_000_000})
    assert over.total_steps == 8  # ceil(1e6 / 131072) = ceil(7.63)
    assert over.log_lines[-1].endswith(f"{8 * 131_072 - 1_000_000:,} tokens over it (the last step does not fit whole)")


def test_stages_by_fraction_keep_the_global_batch_in_tokens():
    plan = plan_steps(**BASE, schedule=[{"seq_len": 2048, "fraction": 0.9}, {"seq_len": 4096}])
    a, b = plan.stages
    assert (a.first_step, a.last_step, b.first_step, b.last_step) == (1, 90, 91, 100)
    assert (a.local_batch_size, b.local_batch_size) == (8, 4)
    assert a.tokens_per_step == b.tokens_per_step == 131_072
    assert plan.stage_index(90) == 0 and plan.stage_index(91) == 1 and plan.max_seq_len == 4096


def test_stages_with_a_budget_and_their_own_batch():
    sched = [{"seq_len": 1024, "steps": 10}, {"seq_len": 2048, "global_batch_size": 128}]
    plan = plan_steps(**{**BASE, "tokens": 10 * 131_072 + 5 * 262_144}, schedule=sched)
    a, b = plan.stages
    assert (a.local_batch_size, a.grad_accum_steps, a.tokens_per_step) == (16, 2, 131_072)
    assert (b.local_batch_size, b.grad_accum_steps, b.tokens_per_step) == (8, 4, 262_144)  # 128 = 8 x 4 dp x 4
    assert b.steps == 5 and plan.total_tokens == 10 * 131_072 + 5 * 262_144 and plan.total_steps == 15


@pytest.mark.parametrize(
    "schedule, message",
    [
        ([{"seq_len": 3000, "fraction": 1.0}], r"seq_len_schedule\[0\].seq_len = 3000 does not divide"),
        ([{"seq_len": 2048, "fraction": 0.5, "steps": 3}, {"seq_len": 4096}], "sets both fraction and steps"),
        ([{"seq_len": 2048}, {"seq_len": 4096}], r"\[0\] sets neither fraction nor steps"),
        ([{"seq_len": 2048, "fraction": 1.5}], r"fraction = 1.5 must be in \(0, 1\]"),
        ([{"seq_len": 2048, "fraction": 0.5}, {"seq_len": 4096, "fraction": 0.3}], "add up to 0.8"),
        ([{"seq_len": 2048, "steps": 60}, {"seq_len": 4096, "steps": 60}], "add up to 120 steps but training.steps"),
        ([{"seq_len": 2048, "steps": 100}, {"seq_len": 4096}], r"\[1\] gets 0 steps"),
        ([{"seq_len": 4096, "global_batch_size": 6}], r"global_batch_size = 6 must be a multiple of .* = 16"),
    ],
)
def test_bad_schedules_are_one_line_errors_naming_the_stage(schedule, message):
    with pytest.raises(ValueError, match=message):
        plan_steps(**BASE, schedule=schedule)


def test_a_budget_resumed_after_a_batch_change_plans_the_remaining_tokens():
    """Checkpoint at step 6 with 384 tokens (64 per step before); now 131,072 tokens per step: the rest of a
    1,000,000-token budget is ceil(999,616 / 131,072) = 8 more steps. Unchanged progress keeps the plan."""
    plan = plan_steps(**{**BASE, "tokens": 1_000_000}, resumed=(6, 384))
    assert plan.total_steps == 6 + 8 and plan.total_tokens == 384 + 8 * 131_072
    assert plan.tokens_through(6) == 384 and plan.tokens_through(7) == 384 + 131_072
    over = 8 * 131_072 - 999_616
    assert plan.log_lines[-1].endswith(
        f"14 steps train {384 + 8 * 131_072:,} tokens, {over:,} tokens over it (the last step does not fit whole)"
    )
    assert plan_steps(**{**BASE, "tokens": 1_000_000}, resumed=(6, 6 * 131_072)) == plan_steps(
        **{**BASE, "tokens": 1_000_000}
    )
    done = plan_steps(**{**BASE, "tokens": 1_000_000}, resumed=(20, 1_000_000))  # the budget is already trained
    assert done.total_steps == 20 and done.total_tokens == 1_000_000
    with pytest.raises(
        ValueError,
        match="seq_len_schedule: the checkpoint of step 6 has seen 384 tokens but this config's stages give 786,432",
    ):
        plan_steps(**{**BASE, "tokens": 1_000_000}, schedule=[{"seq_len": 2048}], resumed=(6, 384))


def test_a_huge_budget_is_exact_only_when_it_is():
    """Integer arithmetic: 10**30 + 1 tokens do not fit whole steps (float division called it exact)."""
    per_step = 131_072
    assert plan_steps(**{**BASE, "tokens": per_step * 10**25}).log_lines[-1].endswith("exactly the budget")
    odd = plan_steps(**{**BASE, "tokens": 10**30 + 1})
    assert odd.total_steps == -(-(10**30 + 1) // per_step)
    assert odd.log_lines[-1].endswith(
        f"{odd.total_steps * per_step - 10**30 - 1:,} tokens over it (the last step does not fit whole)"
    )
