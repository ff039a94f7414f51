"""Context parallelism without processes: the load-balanced chunking, the attention function against full
attention (every rank's queries simulated in one process), the one-line errors and the planner's memory model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titanlite.config import parse_config
from titanlite.errors import ConfigError
from titanlite.models.attention import block_causal_bool_mask
from titanlite.models.context_attention import ContextMask, context_attention
from titanlite.models.llama3.model import repeat_kv
from titanlite.parallel.context_parallel import ContextParallel, chunk_positions, rank_major_order, shard_sequence
from titanlite.parallel.parallel_dims import ParallelDims


def test_chunks_pair_an_early_and_a_late_chunk():
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert chunk_positions(12, 3, 2).tolist() == [4, 5, 6, 7]
    for seq_len, cp in ((8, 1), (24, 3), (40, 4)):
        every = torch.cat([chunk_positions(seq_len, cp, r) for r in range(cp)])
        assert sorted(every.tolist()) == list(range(seq_len))  # each token on exactly one rank
        # causal work (the number of keys each query sees) is the same on every rank
        work = {int((chunk_positions(seq_len, cp, r) + 1).sum()) for r in range(cp)}
        assert len(work) == 1
        x = torch.arange(3 * seq_len).view(3, seq_len)
        gathered = torch.cat([shard_sequence(x, cp, r) for r in range(cp)], 1)  # what an all-gather returns
        assert torch.equal(gathered.index_select(1, rank_major_order(seq_len, cp)), x)
    with pytest.raises(ValueError, match="not a multiple of 2 x context-parallel degree"):
        chunk_positions(10, 3, 0)


def full_reference(q, k, v, ids):
    mask = None if ids is None else block_causal_bool_mask(ids)
    return F.scaled_dot_product_attention(q, k, v, is_causal=ids is None, attn_mask=mask)


def sorted_document_ids(batch: int, seq_len: int, generator) -> torch.Tensor:
    """Growing ids per row (as the loader's), short documents crossing chunk boundaries; row 0 is one document."""
    starts = (torch.rand(batch, seq_len, generator=generator) < 0.2).long()
    starts[0] = 0
    return starts.cumsum(-1)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("n_rep", [1, 2, 4])
def test_attention_function_equals_full_attention(documents, n_rep):
    """Outputs and the gradients of q, k, v (fp64) for CP 1 to 4, with chunks of odd sizes (5 and 3 tokens)."""
    g = torch.Generator().manual_seed(n_rep)
    for seq_len, cp in ((10, 1), (30, 3), (24, 4), (20, 2)):
        b, kv_heads, d = 3, 2, 8
        q = torch.randn(b, kv_heads * n_rep, seq_len, d, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (
            torch.randn(b, seq_len, kv_heads, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv"
        )
        ids = sorted_document_ids(b, seq_len, g) if documents else None
        full_k, full_v = (repeat_kv(t, n_rep).transpose(1, 2) for t in (k, v))  # GQA's expansion after the gather
        ref = full_reference(q, full_k, full_v, ids)
        grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        want = torch.autograd.grad(ref, (q, k, v), grad)
        out, got = torch.zeros_like(ref), [torch.zeros_like(t) for t in (q, k, v)]
        for rank in range(cp):
            pos = chunk_positions(seq_len, cp, rank)
            mask = ContextMask(ContextParallel(None, cp, rank, seq_len), seq_len // (2 * cp), ids)
            local = context_attention(q[:, :, pos], full_k, full_v, mask)
            out[:, :, pos] = local.detach()
            for total, part in zip(got, torch.autograd.grad(local, (q, k, v), grad[:, :, pos])):
                total += part
        torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)
        for name, a, w in zip("qkv", got, want):
            torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10, msg=f"grad of {name}, cp {cp}")


def test_attention_function_fp32_and_bf16():
    """The fused kernels' dtypes: fp32 close to full attention; bf16 within bf16's precision."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=g) for _ in "qkv")
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        ref = full_reference(q.to(dtype), k.to(dtype), v.to(dtype), None)
        for rank in range(2):
            pos = chunk_positions(64, 2, rank)
            out = context_attention(
                q[:, :, pos].to(dtype), k.to(dtype), v.to(dtype), ContextMask(ContextParallel(None, 2, rank, 64), 16)
            )
            torch.testing.assert_close(out.float(), ref[:, :, pos].float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--training.seq_len", "36"], "training.seq_len (36) must be a multiple of 2 x parallelism.context_parallel"),
        (
            ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "40"],
            "must be a multiple of 2 x parallelism.context_parallel_degree (4) x tensor_parallel_degree (2)",
        ),
    ],
)
def test_config_refuses_what_cannot_split(options, message):
    with pytest.raises(ConfigError) as e:
        parse_config(["--parallelism.context_parallel_degree", "4", *options])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_degrees_with_context_parallelism():
    d = ParallelDims(cp=2, tp=2, world_size=16)
    assert (d.dp_shard, d.dp_degree, d.fsdp_degree, d.fsdp_enabled, d.cp_enabled) == (4, 4, 8, True, True)
    assert [d.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # tp, then cp innermost
    assert ParallelDims(cp=2, world_size=2).fsdp_enabled  # FSDP shards over the CP ranks
    with pytest.raises(ConfigError, match="context_parallel_degree \\(2\\) x tensor_parallel_degree \\(1\\) = 8"):
        ParallelDims(dp_shard=4, cp=2, world_size=4)
    assert ParallelDims(cp=2, ep=4, world_size=4).dp_shard == 2  # expert parallelism borrows the CP ranks
    with pytest.raises(ConfigError, match=r"expert_parallel_degree=3 must divide .* \(2\) x .*context_parallel_degree"):
        ParallelDims(cp=2, ep=3, world_size=4)


@pytest.mark.parametrize(
    "degrees, rank, ep_ranks, expert_fsdp_ranks",
    [
        (dict(dp_replicate=2, cp=2, ep=2, world_size=8), 5, [4, 5], [[1, 3], [5, 7]]),  # EP = CP peers; HSDP
        (dict(cp=2, ep=4, world_size=4), 1, [0, 1, 2, 3], [1]),  # EP over dp_shard x cp
        (dict(cp=2, ep=2, tp=2, world_size=8), 6, [4, 6], [2, 6]),  # TP innermost, outside the expert groups
    ],
)
def test_expert_groups_under_context_parallelism(degrees, rank, ep_ranks, expert_fsdp_ranks):
    """The expert-parallel group takes the innermost ranks of dp_shard x cp, the experts' FSDP mesh the others
    (one rank of a fake process group of the world's size)."""
    import torch.distributed as dist

    from titanlite.utils import torch_compat

    dist.init_process_group("fake", rank=rank, world_size=degrees["world_size"], store=torch_compat.fake_store())
    try:
        dims = ParallelDims(**degrees)
        dims.build_mesh("cpu")
        assert dims.ep_mesh.mesh.tolist() == ep_ranks and dims.expert_fsdp_mesh.mesh.tolist() == expert_fsdp_ranks
        sizes = sorted(dist.get_world_size(g) for g in dims.all_groups())
        if dims.tp > 1:  # the flattened dp_shard x cp x tp group of the gradient norm: every rank
            assert sizes[-1] == degrees["world_size"]
    finally:
        dist.destroy_process_group()


def test_sequence_level_aux_loss_adds_up_over_cp_ranks(monkeypatch):
    """Each CP rank's sequence-level MoE aux loss, its counts summed over the ranks (a stubbed all-reduce), adds up
    to the whole sequences' loss."""
    from titanlite.models.moe import balance
    from titanlite.models.moe.args import MoEConfig
    from titanlite.models.moe.router import TopKRouter, one_hot_counts

    cfg = MoEConfig(num_experts=4, top_k=2, aux_loss_coef=0.01, aux_loss_level="seq")
    torch.manual_seed(0)
    router = TopKRouter(8, cfg)
    router.init_weights(0.5)
    x = torch.randn(3, 16, 8)
    whole = balance.aux_loss_sum(router(x.view(-1, 8)), cfg, (3, 16))
    routings = [router(shard_sequence(x, 2, r).reshape(-1, 8)) for r in range(2)]
    counts = sum(one_hot_counts(r.experts.view(3, 16), 4).float() for r in routings)  # 8 tokens x top 2 each
    monkeypatch.setattr(balance, "all_reduce_counts", lambda c, group: counts if group == "cp" else c)
    monkeypatch.setattr(balance.dist, "get_world_size", lambda group: 2)
    parts = [balance.aux_loss_sum(r, cfg, (3, 8), seq_group="cp") for r in routings]
    torch.testing.assert_close(sum(parts), whole)
    own = sum(balance.aux_loss_sum(r, cfg, (3, 8)) for r in routings)  # each rank's counts alone: another loss
    assert not torch.allclose(own, whole)


def test_planner_divides_activations_by_cp():
    """Activations and logits per GPU are a CP rank's share of the sequence, plus the gathered keys and values;
    FSDP shards the parameters over dp_shard x cp."""
    from titanlite.models.flops import ModelShape
    from titanlite.plan.memory import RunSetup, memory_breakdown

    shape = ModelShape(4096, 32, 32, 8, 14336, 128256)
    one = memory_breakdown(shape, RunSetup(num_gpus=8, seq_len=65536, local_batch_size=1, ac_mode="full"))
    two = memory_breakdown(shape, RunSetup(num_gpus=8, seq_len=65536, local_batch_size=1, ac_mode="full", cp=2))
    assert two["parameters"] == one["parameters"] and two["optimizer"] == one["optimizer"]
    assert two["logits"] == one["logits"] / 2
    gathered = 2 * 2 * 65536 * (1024 + 4096)  # bf16 K and V of the whole sequence, and their GQA copies
    assert two["activations"] == pytest.approx(one["activations"] / 2 + gathered)
    assert RunSetup(num_gpus=8, cp=2).dp_degree == 4 and RunSetup(num_gpus=8, cp=2).fsdp_shards == 8


def test_block_causal_without_document_ids_is_refused_under_cp_as_without():
    """A block-causal model given no document ids: the same ValueError with context parallelism as without (never a
    silent fall back to causal attention)."""
    from titanlite.models import build_model

    torch.manual_seed(0)
    model = build_model("llama3", "debugmodel", device="cpu", n_layers=1, attn_mask_type="block_causal")
    model.init_weights()
    tokens = torch.randint(0, 256, (1, 8))
    message = "block_causal' needs document_ids"
    with pytest.raises(ValueError, match=message):
        model(tokens)
    cp = ContextParallel(group=None, degree=2, rank=0).for_length(16)  # this rank's 8 of 16 tokens
    with pytest.raises(ValueError, match=message):
        model(tokens, context_parallel=cp)
