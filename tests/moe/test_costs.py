"""moe.costs: each pipeline layer's parameters (exact, against the model), FLOPs (against the model's
own counts) and saved activation bytes (against what autograd saves), for MHA/GQA/MLA attention,
dense FFNs, MoE layers with shared experts, and tied embeddings."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as nnf
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

import routing_kernels as rk
from moe import MoEConfig
from moe.costs import model_costs
from moe.model import Transformer, TransformerConfig
from zero.memory import count_params
from zero.plan import load_profile

pytestmark = pytest.mark.usefixtures("one_thread")

V, D = 97, 48


def _configs():
    m = MoEConfig(d_model=D, d_ff=40, num_experts=6, top_k=2)
    shared = MoEConfig(
        d_model=D,
        d_ff=24,
        num_experts=6,
        top_k=3,
        num_shared_experts=1,
        shared_d_ff=24,
        shared_expert_gate=True,
        activation="gelu",
        capacity_factor=1.25,
    )
    common = dict(vocab_size=V, d_model=D, d_ff=72, max_seq_len=64)
    return {
        "mha, moe every other": TransformerConfig(**common, n_layers=3, n_heads=4, moe=m, moe_every=2),
        "gqa, bias, head norm, tied": TransformerConfig(
            **common, n_layers=2, n_heads=6, n_kv_heads=2, moe=m, tie_embeddings=True, qkv_bias=True, qk_norm="head"
        ),
        "gqa, head_dim, proj norm": TransformerConfig(
            **common, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=10, moe=m, qk_norm="proj", dense_layers=[0]
        ),
        "mla, shared experts": TransformerConfig(
            **common,
            n_layers=3,
            n_heads=3,
            moe=shared,
            attention="mla",
            q_lora_rank=16,
            kv_lora_rank=12,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=10,
            first_k_dense=1,
        ),
        "mla without q lora, dense": TransformerConfig(
            **common,
            n_layers=2,
            n_heads=3,
            moe_every=0,
            attention="mla",
            kv_lora_rank=12,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=10,
        ),
    }


CONFIGS = _configs()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_counts_are_the_models_exactly(name):
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    model = Transformer(cfg)
    costs = model_costs(cfg, 32)
    assert costs.param_counts() == count_params(model)
    assert len(costs.blocks) == model.num_pipeline_layers
    # each pipeline layer on its own (what a pipeline rank holds)
    for i, b in enumerate(costs.blocks):
        part = model.pipeline_stage(i, i + 1) if not cfg.tie_embeddings else None
        if part is not None:
            assert {"dense": b.params_dense, "expert": b.params_expert} == count_params(part), b.name
    assert costs.tied == ((0, cfg.n_layers + 1) if cfg.tie_embeddings else None)
    moe_blocks = [b for b in costs.blocks if b.is_moe]
    assert len(moe_blocks) == len(model.moe_layers())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_flops_are_six_per_active_matmul_weight_plus_the_models_attention(name):
    cfg = CONFIGS[name]
    L = 32
    model = Transformer(cfg)
    # the weights of matrix products one token passes through: every matrix but the embedding
    # lookup (the tied head uses it), top_k of E routed experts
    weights = 0.0
    for pname, p in model.named_parameters():
        if p.dim() < 2 or pname == "embed.weight":
            continue
        if "experts.w" in pname and "shared" not in pname:
            layer = cfg.moe
            weights += p.numel() * layer.top_k / layer.num_experts
        else:
            weights += p.numel()
    if cfg.tie_embeddings:
        weights += model.embed.weight.numel()
    want = 6 * weights + model.attention_flops_per_token(L)
    assert model_costs(cfg, L).model_flops_per_token() == pytest.approx(want, rel=1e-12)


class _Saved:
    """Bytes of distinct storages saved for backward (parameters and buffers left out)."""

    def __init__(self, model):
        self.skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.seen, self.live = set(), 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.skip and ptr not in self.seen:
            self.seen.add(ptr)
            self.live += t.untyped_storage().nbytes()
        return t


GROUPED = pytest.param(
    "grouped",
    "grouped_mm",
    marks=pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm"),
)


@pytest.mark.parametrize("kernel,backend", [("fused", "cpu_blocks"), GROUPED])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_saved_activations_per_layer_within_ten_percent_of_autograds(name, kernel, backend):
    # the GPU's grouped path runs here too (torch runs _grouped_mm on the CPU)
    cfg = CONFIGS[name]
    B, L = 4, 32
    torch.manual_seed(0)
    model = Transformer(cfg)
    costs = model_costs(cfg, L, experts=kernel)
    saved = _Saved(model)
    marks = []
    for m in [model.embed, *model.blocks, model.norm]:
        m.register_forward_hook(lambda mod, args, out: marks.append(saved.live))
    x = torch.randint(0, V, (B, L))
    with rk.use_expert_backend(backend), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        logits = model(x)
        nnf.cross_entropy(logits.float().flatten(0, 1), x.flatten())
    marks.append(saved.live)
    per_layer = [marks[0]] + [b - a for a, b in zip(marks, marks[1:])]
    per_layer = per_layer[:-2] + [per_layer[-2] + per_layer[-1]]  # the head: final norm, lm_head, loss
    for b, got in zip(costs.blocks, per_layer):
        assert b.act_bytes * B * L == pytest.approx(got, rel=0.1), b.name


@pytest.mark.parametrize("kernel,backend", [("fused", "cpu_blocks"), GROUPED])
@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if c.moe_every and c.moe.capacity_factor is None])
def test_rows_mode_saves_what_the_costs_add_per_routed_row(name, kernel, backend):
    """Between All-to-All exchanges (expert parallelism: the experts take rows in expert order, not
    tokens) an MoE layer saves ``rows_mode_row_bytes`` more per routed row than in tokens mode: the
    dispatcher's two row gathers' indices, and with the fused CPU kernel its input rows and the
    outputs the combine weights. Measured on a one-rank gloo group, the same layer through
    ``AllToAllDispatcher`` against its local path (dropless: every slot a row)."""
    import torch.distributed as dist

    from moe.dispatch import AllToAllDispatcher

    cfg = CONFIGS[name]
    B, L = 4, 32
    costs = model_costs(cfg, L, experts=kernel)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        per_mode = {}
        for mode in ("tokens", "rows"):
            torch.manual_seed(0)
            model = Transformer(cfg)
            if mode == "rows":
                for layer in model.moe_layers():
                    layer.dispatcher = AllToAllDispatcher(dist.group.WORLD)
            saved, marks = _Saved(model), []
            for m in [model.embed, *model.blocks]:
                m.register_forward_hook(lambda mod, args, out: marks.append(saved.live))
            with rk.use_expert_backend(backend), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                model(torch.randint(0, V, (B, L)))
            per_mode[mode] = [b - a for a, b in zip(marks, marks[1:])]
    finally:
        dist.destroy_process_group()
    moe = [b for b in costs.blocks[1:-1] if b.is_moe]
    assert moe
    for b, tokens, rows in zip(costs.blocks[1:-1], per_mode["tokens"], per_mode["rows"]):
        # a few bytes of scalars aside
        want = B * L * b.top_k * b.rows_mode_row_bytes if b.is_moe else 0
        assert rows - tokens == pytest.approx(want, abs=16), b.name


@pytest.mark.parametrize("ckpt", [False, True])
def test_the_cpu_kernels_kept_buffers_are_its_pools(monkeypatch, ckpt):
    # the CPU expert kernel's pool keeps its buffers from step to step: after two steps, what each
    # MoE layer's pool holds beyond the saved hiddens (h1, h3: activations) is the planner's
    # kernel_buffers, buffer for buffer, the weight gradients included (lent as p.grad, dropped by
    # zero_grad here and by the engine's hook in training: kept by the pool) (dropless: the rows
    # are T * K every step; tokens mode, one process); under checkpointing the hiddens too (idle
    # in the pool between the forward and the recomputation)
    from routing_kernels.cpu.pool import BufferPool, pool_for
    from zero.plan import LayoutRecord
    from zero.plan.terms import _Costing

    monkeypatch.setattr(BufferPool, "min_bytes", 0)  # a tiny layer's buffers are pooled too
    cfg = dataclasses.replace(CONFIGS["mha, moe every other"], checkpoint_activations=ckpt)
    B, L = 4, 32
    torch.manual_seed(0)
    model = Transformer(cfg)
    costs = model_costs(cfg, L, experts="fused")
    x = torch.randint(0, V, (B, L))
    with rk.use_expert_backend("cpu_blocks"):
        for _ in range(2):
            nnf.cross_entropy(model(x).float().flatten(0, 1), x.flatten()).backward()
            model.zero_grad(set_to_none=True)
    rec = LayoutRecord(world=1, batch_size=B, checkpoint_activations=ckpt)
    cst = _Costing(rec, costs, load_profile("cpu_2core"), skew=None)
    layers = model.moe_layers()
    moe_costs = [b for b in costs.blocks if b.is_moe]
    assert len(layers) == len(moe_costs) >= 1
    for layer, b in zip(layers, moe_costs):
        slots = pool_for(layer.experts.w1)._slots
        kept = sum(
            buf.untyped_storage().nbytes()
            for slot, bufs in slots.items()
            if slot not in (() if ckpt else ("h1", "h3"))
            for buf, _ in bufs
        )
        assert cst.pooled(b) == kept > 0, (b.name, {k: [tuple(t.shape) for t, _ in v] for k, v in slots.items()})


_VIEWS = {"view", "as_strided", "slice", "select", "t", "transpose", "expand", "unsqueeze", "squeeze", "permute"}
_VIEWS |= {"split", "split_with_sizes", "unbind", "_unsafe_view", "alias", "detach", "reshape"}
_PRODUCTS = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu"}
_ALLOCATIONS = {"new_empty", "empty", "empty_like"}  # memory handed out, not touched


class _Dispatched(TorchDispatchMode):
    """Operators dispatched, and the bytes the non-matmul, non-view ones read and write (weights
    left out: they are the matmuls' operands; an allocation touches nothing; ``index_select`` reads
    the rows it selects, not its whole source)."""

    def __init__(self, skip):
        super().__init__()
        self.skip, self.ops, self.bytes = skip, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        name = func._schema.name.split("::")[1]
        if name in _VIEWS or name in _PRODUCTS or name in _ALLOCATIONS:
            return out
        # an out= tensor is written once: counted as the output, not again as an argument
        kw = {k: v for k, v in (kwargs or {}).items() if k != "out"}
        tensors = tree_flatten((args, kw, out))[0]
        if name == "index_select":
            tensors = [args[2], out, out]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.skip:
                self.bytes += t.numel() * t.element_size()
        return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_operator_counts_are_the_forwards(name):
    # the fixed per-operator cost of the step time rests on these
    cfg = CONFIGS[name]
    B, L = 4, 32
    torch.manual_seed(0)
    model = Transformer(cfg)
    costs = model_costs(cfg, L, experts="fused")
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randint(0, V, (B, L))
    with _Dispatched(skip) as d:
        h = model.embed(x)
    assert d.ops == costs.blocks[0].ops
    cos, sin = model.rope_cos[:L], model.rope_sin[:L]
    for block, cost in zip(model.blocks, costs.blocks[1:-1]):
        with _Dispatched(skip) as d:
            h = block(h, cos, sin)
        assert cost.ops == pytest.approx(d.ops, rel=0.02), cost.name
    with _Dispatched(skip) as d:
        nnf.cross_entropy(model.lm_head(model.norm(h)).float().flatten(0, 1), x.flatten())
    assert d.ops == costs.blocks[-1].ops


def _wide_configs():
    """Proportions of the open checkpoints, at widths a test runs: Mixtral's (GQA, F = 3.5 D, 8
    experts top-2) and DeepSeek-V3's (MLA, a first dense block, 64 fine-grained experts top-6 with
    sigmoid group routing and a shared expert)."""
    mixtral = MoEConfig(d_model=512, d_ff=1792, num_experts=8, top_k=2)
    deepseek = MoEConfig(
        d_model=384,
        d_ff=96,
        num_experts=64,
        top_k=6,
        score_func="sigmoid",
        num_groups=4,
        topk_groups=2,
        route_scale=2.5,
        expert_bias=True,
        aux_loss_coef=0.0,
        seq_aux_loss_coef=1e-4,
        num_shared_experts=1,
        shared_d_ff=192,
    )
    common = dict(vocab_size=V, max_seq_len=256)
    return {
        "mixtral's proportions": TransformerConfig(
            **common, d_model=512, n_layers=1, n_heads=8, n_kv_heads=2, d_ff=1792, moe=mixtral
        ),
        "deepseek-v3's proportions": TransformerConfig(
            **common,
            d_model=384,
            n_layers=2,
            n_heads=6,
            d_ff=1024,
            first_k_dense=1,
            moe=deepseek,
            attention="mla",
            q_lora_rank=96,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
        ),
    }


ELEMENTWISE_CONFIGS = {**CONFIGS, **_wide_configs()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(ELEMENTWISE_CONFIGS))
def test_elementwise_bytes_are_the_forwards_operator_by_operator(monkeypatch, name, dtype):
    # the bandwidth term of the step time rests on these. Counted per token from the widths, so a
    # block whose proportions differ from the small models' (Mixtral's F = 3.5 D, DeepSeek's
    # fine-grained experts) must hold too. SDPA is attention's product (the GPU's fused kernel; the
    # CPU's math fallback for MLA's unequal head dims is not what the planner models). Within 1%:
    # the cos/sin tables' reads and the per-call scalars are not counted (0.3% at most here)
    import moe.attention

    attend = moe.attention.attend

    def attend_as_a_product(*args, **kwargs):
        with _disable_current_modes():
            return attend(*args, **kwargs)

    monkeypatch.setattr(moe.attention, "attend", attend_as_a_product)
    cfg = ELEMENTWISE_CONFIGS[name]
    B, L = (16, 32) if cfg.max_seq_len < 256 else (2, 256)
    torch.manual_seed(0)
    model = Transformer(cfg)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    costs = model_costs(cfg, L, act_dtype=dtype, experts="fused")
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randint(0, V, (B, L))
    cos, sin = model.rope_cos[:L], model.rope_sin[:L]
    with rk.use_expert_backend("loop"), torch.no_grad():  # the reference path the count follows
        h = model.embed(x)
        for block, cost in zip(model.blocks, costs.blocks[1:-1]):
            with _Dispatched(skip) as d:
                h = block(h, cos, sin)
            assert cost.elementwise_bytes * B * L == pytest.approx(d.bytes, rel=0.01), cost.name


class _OpaqueAttention(torch.autograd.Function):
    """``attend`` whose forward and backward the counting modes do not see: SDPA's backward is
    attention's product (one kernel on either device), not elementwise traffic."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        import moe.attention

        with _disable_current_modes(), torch.enable_grad():
            ins = [t.detach().requires_grad_() for t in (q, k, v)]
            out = moe.attention.attend.__wrapped__(*ins, mask, scale)
            ctx.inner = (ins, out)
            return out.detach()

    @staticmethod
    def backward(ctx, grad):
        ins, out = ctx.inner
        with _disable_current_modes():
            grads = torch.autograd.grad(out, ins, grad)
        return (*grads, None, None)


@pytest.mark.parametrize("name", list(ELEMENTWISE_CONFIGS))
def test_backward_bytes_are_the_backwards_operator_by_operator(monkeypatch, name):
    # the backward's share of the bandwidth term rests on these: per block, the backward's
    # non-matmul bytes on the CPU's kernels (the fused routed experts, autograd elsewhere), counted
    # as the forward's are, against moe.costs' per-class factors of the forward's bytes. Within 8%:
    # three factors stand for every operator's backward, and the configs' mixes differ (7.6% at
    # most here, against up to 25% for one factor of 2.3 for all)
    import functools

    import moe.attention

    attend = moe.attention.attend

    @functools.wraps(attend)
    def opaque(q, k, v, mask=None, scale=None):
        return _OpaqueAttention.apply(q, k, v, mask, scale)

    monkeypatch.setattr(moe.attention, "attend", opaque)
    cfg = ELEMENTWISE_CONFIGS[name]
    B, L = (16, 32) if cfg.max_seq_len < 256 else (2, 256)
    torch.manual_seed(0)
    model = Transformer(cfg)
    costs = model_costs(cfg, L, experts="fused")
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randint(0, V, (B, L))
    cos, sin = model.rope_cos[:L], model.rope_sin[:L]
    h = model.embed(x).detach()
    for block, cost in zip(model.blocks, costs.blocks[1:-1]):
        h_in = h.requires_grad_()
        y = block(h_in, cos, sin)
        with _Dispatched(skip) as d:
            y.backward(torch.randn_like(y))
        assert cost.backward_bytes * B * L == pytest.approx(d.bytes, rel=0.08), cost.name
        h = y.detach()


def test_checkpointing_saves_the_block_input_and_bf16_halves_it():
    cfg = CONFIGS["mha, moe every other"]
    fp32, bf16 = model_costs(cfg, 16), model_costs(cfg, 16, act_dtype="bf16")
    for a, b in zip(fp32.blocks[1:-1], bf16.blocks[1:-1]):
        assert a.act_bytes_checkpointed == 4 * D and b.act_bytes_checkpointed == 2 * D
        assert b.act_bytes < a.act_bytes
    moe_block = fp32.blocks[2]
    assert moe_block.is_moe and moe_block.top_k == 2 and moe_block.row_bytes == 4 * D


@pytest.mark.parametrize("name", ["mha, moe every other", "gqa, bias, head norm, tied"])
def test_the_layers_checkpointed_are_the_ones_the_models_backward_runs_again(name):
    """``BlockCost.checkpointed``: the layers whose forward a checkpointed model runs a second time
    in its backward, counted by hooks on the model's own pipeline layers (the embedding, each
    block, the head's product): the blocks twice, the ends once."""
    cfg = dataclasses.replace(CONFIGS[name], checkpoint_activations=True)
    torch.manual_seed(0)
    model = Transformer(cfg).train()
    layers = [model.embed, *model.blocks, model.lm_head]  # the head's layer: the final norm, then lm_head
    calls = [0] * len(layers)
    for i, mod in enumerate(layers):
        # a pre-hook: the recomputation stops as soon as it has what the backward needs (torch's
        # early stop), before a forward hook would run
        mod.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    x = torch.randint(0, V, (2, 16))
    nnf.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    costs = model_costs(cfg, 16)
    assert len(costs.blocks) == len(layers)
    assert calls == [2 if b.checkpointed else 1 for b in costs.blocks]
    assert calls.count(1) == 2 and calls.count(2) == cfg.n_layers


def test_bad_arguments_name_the_value():
    cfg = CONFIGS["mha, moe every other"]
    with pytest.raises(ValueError, match=r"act_dtype='fp16' is invalid"):
        model_costs(cfg, 16, act_dtype="fp16")
    with pytest.raises(ValueError, match=r"seq_len=65 is invalid.*max_seq_len=64"):
        model_costs(cfg, 65)
    with pytest.raises(ValueError, match=r"experts='sparse' is invalid"):
        model_costs(cfg, 16, experts="sparse")
