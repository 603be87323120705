"""``model.init_from`` of a fine-grained family in the trainer: a tiny random Qwen3-MoE checkpoint
(per-head q/k norms, head_dim 10, grouped-query attention, a dense first block, 4 experts of 8)
trained 10 steps under pp2 x ep2 x ZeRO-3 on 4 gloo ranks against one process; the checkpoint's
config becomes the run's; each rank reads only its stage's layers and its own experts; ``export-hf``
of the 4-rank run's checkpoint loads in transformers with the trained model's logits.

Tolerances: the 4-rank run against one process, as tests/zero/test_pipeline.py's pp2 x ep2 x ZeRO-3
case (same micro-batches: one process accumulates 4, each rank runs 4 of half the rows): losses,
gradient norms and aux losses within 1e-5 relative, weights within 1e-5 absolute (AdamW's
g / (|g| + eps) turns rounding near eps into lr-sized steps, tests/support/training.py). The
exported model against ours: 1e-6 relative in norm (tests/hf/test_families.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.support.training import SHORT, assemble_stages, cfg_of, metrics_rows  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 10
RUN = [*SHORT, f"train.steps={STEPS}", "train.log_every=1", f"train.eval_every={STEPS}"]
RTOL, WEIGHT_ATOL, EXPORT_RTOL = 1e-5, 1e-5, 1e-6  # see the module docstring
QWEN3 = dict(
    vocab_size=256,  # the byte-level run's vocabulary
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=10,
    intermediate_size=48,
    moe_intermediate_size=8,
    num_experts=4,
    num_experts_per_tok=2,
    mlp_only_layers=[0],
    norm_topk_prob=True,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def _checkpoint(path):
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # routing that depends on the token
    hf.save_pretrained(path)
    return hf


def _rank(rank, world, overrides, run_dir):
    """The 4-rank run, and the checkpoint tensors this rank read (name, slice)."""
    from experiments.train import train
    from moe.hf.safetensors_io import SafetensorsFiles

    torch.set_num_threads(1)
    reads, original = [], SafetensorsFiles._tensor

    def tracked(self, name, lo, hi):
        reads.append(name)
        return original(self, name, lo, hi)

    SafetensorsFiles._tensor = tracked
    summary = train(cfg_of(*overrides), run_dir=run_dir, keep_weights=True)
    summary["reads"] = reads
    return summary


@pytest.mark.distributed
def test_qwen3_moe_init_from_trains_under_pp2_ep2_zero3_like_one_process(tmp_path, stdlib):
    from experiments import checkpoint as ec
    from experiments.train import train
    from experiments.training.build import build_model, build_plan
    from experiments.training.hf_init import resolve_init_from
    from tests.support.dist import run_distributed

    _checkpoint(tmp_path / "qwen3")
    init = [*RUN, f"model.init_from={tmp_path / 'qwen3'}"]
    single = train(cfg_of(*init, "train.grad_accum=4"), run_dir=tmp_path / "one", data=stdlib, keep_weights=True)
    dist = [*init, "parallel=pp2_ep2_zero3", f"train.checkpoint.every={STEPS}"]
    got = run_distributed(_rank, 4, dist, tmp_path / "four", timeout=600)

    rows, ref_rows = metrics_rows(tmp_path / "four"), metrics_rows(tmp_path / "one")
    np.testing.assert_allclose(got[0]["train_losses"], single["train_losses"], rtol=RTOL, err_msg="losses")
    for key in ("grad_norm", "aux_loss"):
        np.testing.assert_allclose([r[key] for r in rows], [r[key] for r in ref_rows], rtol=RTOL, err_msg=key)
    weights = assemble_stages(got, single["weights"])
    for name, w in single["weights"].items():
        torch.testing.assert_close(weights[name], w, rtol=0, atol=WEIGHT_ATOL, msg=lambda m: f"{name}: {m}")
    assert single["train_losses"][-1] < single["train_losses"][0]

    # each rank read its stage's layers only and, of each MoE block, its own 2 experts (the Hub
    # layout: one tensor per expert)
    plan = build_plan(resolve_init_from(cfg_of(*dist), overrides=dist))
    for s in got:
        pp_rank, ep_rank = s["layout"]["rank"] // s["layout"]["dp"], s["layout"]["rank"] % 2
        layers = set(range(*plan.ranges[pp_rank]))
        blocks = {int(n.split(".")[2]) for n in s["reads"] if n.startswith("model.layers.")}
        assert blocks == {k - 1 for k in layers if 1 <= k <= 3}, (s["layout"], blocks)
        assert ("model.embed_tokens.weight" in s["reads"]) == (0 in layers)
        assert ("lm_head.weight" in s["reads"]) == (4 in layers)
        experts = {int(n.split(".")[5]) for n in s["reads"] if ".mlp.experts." in n}
        assert experts == ({2 * ep_rank, 2 * ep_rank + 1} if blocks - {0} else set()), (s["layout"], experts)

    # the 4-rank checkpoint leaves as a Qwen3-MoE directory with the trained model's logits
    assert ec.main(["export-hf", str(tmp_path / "four" / "checkpoints"), str(tmp_path / "out")]) == 0
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ours = build_model(cfg_of(*init)).eval()
    ours.load_state_dict(weights, strict=False)  # the parameters; the zero expert biases as built
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = hf.eval()(ids).logits, ours(ids)
    assert ((a - b).norm() / b.norm()).item() <= EXPORT_RTOL


def test_init_from_takes_the_whole_config_and_refuses_another_vocabulary(tmp_path):
    from experiments.training.build import build_model
    from experiments.training.hf_init import resolve_init_from
    from moe.hf import import_model

    hf = _checkpoint(tmp_path / "qwen3")
    init = [*RUN, f"model.init_from={tmp_path / 'qwen3'}"]
    cfg = resolve_init_from(cfg_of(*init), overrides=init)
    assert (cfg.model.n_layers, cfg.model.head_dim, cfg.model.qk_norm, cfg.model.dense_layers) == (3, 10, "head", [0])
    assert (cfg.moe.d_ff, cfg.moe.num_experts, cfg.model.hf_family) == (8, 4, "qwen3_moe")
    model = build_model(cfg_of(*init))
    ref = import_model(tmp_path / "qwen3")
    want = dataclasses.replace(ref.cfg, max_seq_len=32, moe=dataclasses.replace(ref.cfg.moe, aux_loss_coef=0.01))
    assert model.cfg == dataclasses.replace(want, moe=dataclasses.replace(want.moe, z_loss_coef=0.001))
    for name, t in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        b = model.eval()(ids)
        assert ((hf(ids).logits - b).norm() / b.norm()).item() <= EXPORT_RTOL

    bad = [*init, "model.head_dim=8"]
    with pytest.raises(ValueError, match=r"model\.head_dim=8 conflicts with the checkpoint: .* has model\.head_dim=10"):
        resolve_init_from(cfg_of(*bad), overrides=bad)
    with pytest.raises(ValueError, match=r"model\.vocab_size=300\) differs from the checkpoint's vocab_size=256"):
        resolve_init_from(cfg_of(*init, "data.vocab_size=300"), overrides=[])
