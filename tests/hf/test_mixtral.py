"""moe.hf.mixtral: a Switchyard Transformer exported as a transformers Mixtral checkpoint, a Mixtral
checkpoint imported, ``model.init_from`` in the trainer (one process and 2 gloo ranks with ep=2).

Logits are compared at 1e-6 relative (``||a - b|| / ||b||``, fp32): the two models run the same
operations in the same order except the MoE combine, where ours sums a token's k weighted expert
outputs in one batched matmul (``routing_kernels.reference._combine_rows``) and transformers
multiplies each and adds it with ``index_add_``; that rounds differently, ~1e-7 relative (measured
1.6e-7 here). Weights are compared bit for bit: moving them is copies and transposes only."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as nnf

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from moe import MoEConfig  # noqa: E402
from moe.hf.mixtral import (  # noqa: E402
    MIXTRAL,
    TABLE,
    ZERO_IN_MIXTRAL,
    _read,
    export_mixtral,
    import_mixtral,
    import_mixtral_state_dict,
    to_mixtral_state_dict,
)
from moe.hf.safetensors_io import SafetensorsFiles as _Files  # noqa: E402
from moe.model import Transformer, TransformerConfig  # noqa: E402
from tests.support.training import SHORT, assemble_weights, cfg_of, check_same_training, metrics_rows  # noqa: E402
from zero import checkpoint as zc  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (tests/conftest.py)

RTOL = 1e-6  # see the module docstring
V, D, H, F, E, K, NL, L = 61, 32, 4, 24, 4, 2, 2, 24  # an odd vocabulary and sequence length on purpose


def _cfg(moe: dict | None = None, **kw) -> TransformerConfig:
    moe = MoEConfig(**{"d_model": D, "d_ff": F, "num_experts": E, "top_k": K, **(moe or {})})
    return TransformerConfig(
        **{"vocab_size": V, "d_model": D, "n_layers": NL, "n_heads": H, "d_ff": F, "max_seq_len": L, "moe": moe, **kw}
    )


def _ours(seed=0, **kw) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(_cfg(**kw)).eval()
    with torch.no_grad():
        for layer in model.moe_layers():
            # logits of std ~3 rather than ~0.1: each token's experts depend on the token, so a
            # wrongly mapped router or expert changes the outputs
            layer.router.weight.normal_(0.0, 0.5)
    return model


def _hf(seed=0, **kw):
    cfg = transformers.MixtralConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=NL,
        num_attention_heads=H,
        num_key_value_heads=H,
        max_position_embeddings=L,
        num_local_experts=E,
        num_experts_per_tok=K,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **kw,
    )
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.uniform_(0.5, 1.5)  # not all ones, so a norm gain mapped to the wrong place shows
    return model


def _close(a, b, what):
    err = ((a - b).norm() / b.norm()).item()
    assert err <= RTOL, f"{what}: relative error {err:.3g} > {RTOL}"


def _ids(n=3):
    torch.manual_seed(1)
    return torch.randint(0, V, (n, L))


@torch.no_grad()
def _logits_match(ours: Transformer, hf, what: str):
    ids = _ids()
    _close(ours(ids), hf(ids).logits, what)


def _equal_states(a: dict, b: dict):
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _from_pretrained(path):
    hf, info = transformers.MixtralForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    return hf.eval()


def test_the_table_names_every_tensor_of_both_models():
    ours, hf = _ours(), _hf()
    cfg = ours.cfg

    def names(templates, i=None):
        return {t.format(i=k) for t in templates for k in (range(NL) if i is None else [i])}

    rows = list(MIXTRAL.rows(cfg))  # the table's rows this config's blocks have
    assert {n for r, i in rows for n in names(r.ours, i)} | names(ZERO_IN_MIXTRAL) == set(ours.state_dict())
    assert {n for r, i in rows for n in names(r.module, i)} == set(hf.state_dict())
    assert {r for r, _ in rows} < set(TABLE)  # and some it has not (q/k norms, a qkv bias)
    # and the in-memory conversion fills a live transformers model exactly
    hf.load_state_dict(to_mixtral_state_dict(ours.state_dict(), cfg), strict=True)
    _logits_match(ours, hf, "ours vs transformers (state dict)")


@pytest.mark.parametrize("tied,shard_bytes", [(False, None), (True, 20_000)], ids=["untied-one-file", "tied-sharded"])
def test_export_loads_in_transformers_and_round_trips(tmp_path, tied, shard_bytes):
    ours = _ours(tie_embeddings=tied)
    kw = {} if shard_bytes is None else {"max_shard_bytes": shard_bytes}
    out = export_mixtral(ours, tmp_path / "mx", **kw)
    index = out / "model.safetensors.index.json"
    if shard_bytes is None:
        assert not index.exists() and (out / "model.safetensors").exists()
    else:
        weight_map = json.loads(index.read_text())["weight_map"]
        assert len(set(weight_map.values())) > 2
        assert ("lm_head.weight" in weight_map) is not tied  # a tied head is the embedding, written once
    hf = _from_pretrained(out)
    assert hf.config.tie_word_embeddings is tied and hf.config.eos_token_id is None
    _logits_match(ours, hf, "exported checkpoint in transformers")

    # the file is the Hub layout: what transformers itself writes for the same weights
    hf.save_pretrained(tmp_path / "theirs")
    ref = _from_pretrained(tmp_path / "theirs")
    _equal_states(hf.state_dict(), ref.state_dict())

    # round trip: the same config and the same bits
    back = import_mixtral(out)
    assert back.cfg == ours.cfg
    _equal_states(back.state_dict(), ours.state_dict())


def test_import_matches_transformers_in_both_file_layouts(tmp_path):
    hf = _hf()
    hf.save_pretrained(tmp_path / "hub")  # one tensor per expert under block_sparse_moe
    ours = import_mixtral(tmp_path / "hub").eval()
    _logits_match(ours, hf, "imported checkpoint")
    # transformers 5's own module layout (fused experts), as a raw state_dict() file
    (tmp_path / "fused").mkdir()
    hf.config.save_pretrained(tmp_path / "fused")
    safetensors_torch.save_file(
        {k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "fused" / "model.safetensors")
    )
    _equal_states(import_mixtral(tmp_path / "fused").state_dict(), ours.state_dict())
    # what each of 2 expert-parallel ranks reads: its experts' slice, the same from either layout
    for lo, hi in ((0, E // 2), (E // 2, E)):
        hub, fused = (_read(_Files(tmp_path / d), ours.cfg, lo, hi) for d in ("hub", "fused"))
        _equal_states(fused, hub)
        assert torch.equal(hub["blocks.1.ffn.experts.w2"], ours.blocks[1].ffn.experts.w2[lo:hi])
    # and back out: the same tensors transformers holds
    export_mixtral(ours, tmp_path / "again")
    _equal_states(_from_pretrained(tmp_path / "again").state_dict(), hf.state_dict())


def test_export_bf16_and_from_a_consolidated_file(tmp_path):
    ours = _ours()
    safetensors_torch.save_file(
        ours.state_dict(), str(tmp_path / "ours.safetensors")
    )  # our names, e.g. a consolidated checkpoint
    out = export_mixtral(tmp_path / "ours.safetensors", tmp_path / "mx", ours.cfg, dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    back = import_mixtral(out)
    # bf16 on disk, upcast exactly into the fp32 model
    _equal_states(back.state_dict(), {k: v.to(torch.bfloat16).float() for k, v in ours.state_dict().items()})
    # a tied model's file holds the embedding once (safetensors refuses two names for one tensor)
    tied = _ours(tie_embeddings=True)
    state = {k: v for k, v in tied.state_dict().items() if k != "lm_head.weight"}
    export_mixtral(state, tmp_path / "tied", tied.cfg)
    _equal_states(import_mixtral(tmp_path / "tied").state_dict(), tied.state_dict())


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(moe_every=2), r"model\.moe_every=2"),
        (dict(moe=dict(capacity_factor=1.25)), r"moe\.capacity_factor=1\.25"),
        (dict(moe=dict(expert_bias=True)), r"moe\.expert_bias=True"),
        (dict(moe=dict(num_shared_experts=1)), r"moe\.num_shared_experts=1"),
        (dict(moe=dict(score_func="sigmoid")), r"moe\.score_func='sigmoid'"),
        (dict(moe=dict(normalize_topk=False)), r"moe\.normalize_topk=False"),
    ],
)
def test_export_refuses_what_mixtral_cannot_compute(tmp_path, kw, match):
    model = _ours(**kw)
    with pytest.raises(ValueError, match=match):
        export_mixtral(model, tmp_path / "mx")
    assert not (tmp_path / "mx").exists()


def test_export_refuses_a_slice_of_the_experts_and_wrong_shapes(tmp_path):
    ours = _ours()
    state = {k: (v[: E // 2] if ".experts." in k else v) for k, v in ours.state_dict().items()}  # one ep rank's
    with pytest.raises(ValueError, match=r"2 of num_experts=4 experts; under expert parallelism"):
        export_mixtral(state, tmp_path / "mx", ours.cfg)
    with pytest.raises(ValueError, match=r"embed\.weight has shape \(61, 32\), the config's model \(64, 32\)"):
        export_mixtral(ours.state_dict(), tmp_path / "mx", dataclasses.replace(ours.cfg, vocab_size=64))
    with pytest.raises(ValueError, match=r"moe\.score_func='sigmoid'"):  # the checkpoint decides the routing
        import_mixtral_state_dict(_hf().state_dict(), _hf().config, score_func="sigmoid")


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(attention_bias=True), r"attention_bias=True"),
        (dict(quantization_config={"quant_method": "fp8"}), r"quantization_config='fp8'"),
        (dict(sliding_window=16), r"sliding_window=16"),
        (dict(hidden_act="gelu"), r"hidden_act='gelu'"),
        (
            dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
            r"rope_parameters=.*dynamic",
        ),
        (dict(router_jitter_noise=0.1), r"router_jitter_noise=0.1"),
    ],
)
def test_import_refuses_what_our_model_cannot_compute(tmp_path, kw, match):
    hf = _hf()
    for k, v in kw.items():
        setattr(hf.config, k, v)
    hf.config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):
        import_mixtral(tmp_path)


def test_import_refuses_unknown_tensors_and_other_models(tmp_path):
    hf = _hf()
    hf.save_pretrained(tmp_path / "mx")
    state = safetensors_torch.load_file(str(tmp_path / "mx" / "model.safetensors"))
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(D)
    safetensors_torch.save_file(state, str(tmp_path / "mx" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"q_proj\.bias"):
        import_mixtral(tmp_path / "mx")
    transformers.Qwen3MoeConfig(hidden_size=D, num_attention_heads=H).save_pretrained(tmp_path / "qwen")
    with pytest.raises(ValueError, match="model_type='qwen3_moe'"):
        import_mixtral(tmp_path / "qwen")


def test_import_into_a_model_checks_its_config(tmp_path):
    _hf().save_pretrained(tmp_path)
    other = Transformer(dataclasses.replace(_cfg(moe=dict(num_experts=8)), rope_theta=1e6))
    with pytest.raises(ValueError) as e:
        import_mixtral(tmp_path, other)
    assert "moe.num_experts=8 (checkpoint: num_local_experts=4)" in str(e.value)
    assert "model.rope_theta=1000000.0 (checkpoint: rope_parameters.rope_theta=10000.0)" in str(e.value)
    # training-time settings are free: capacity, aux losses, sequence length
    free = Transformer(_cfg(moe=dict(capacity_factor=1.5, aux_loss_coef=0.0), max_seq_len=8))
    import_mixtral(tmp_path, free)


# ---------------------------------------------------------------------------------------------
# model.init_from in the trainer

# the trainer's tiny model with the mixtral moe group, on the 256-byte vocabulary
TRAIN_MX = dict(
    vocab_size=256,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    intermediate_size=64,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
INIT_RUN = [
    *SHORT,
    "train.steps=2",
    "train.log_every=1",
    "train.eval_every=2",
    "moe.aux_loss_coef=0",
    "moe.z_loss_coef=0",
]


def _init_from_rank(rank, world, runs, run_dirs):
    from experiments.train import train

    return [train(cfg_of(*overrides), run_dir=run_dir, keep_weights=True) for overrides, run_dir in zip(runs, run_dirs)]


@pytest.mark.distributed
def test_init_from_one_process_and_two_ranks_with_ep2(tmp_path, stdlib):
    from experiments.train import train
    from experiments.training.build import build_model
    from tests.support.dist import run_distributed

    torch.manual_seed(3)
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**TRAIN_MX)).eval()
    hf.save_pretrained(tmp_path / "mx")
    overrides = [*INIT_RUN, f"model.init_from={tmp_path / 'mx'}"]

    model = build_model(cfg_of(*overrides))
    _equal_states(model.state_dict(), import_mixtral(tmp_path / "mx").state_dict())

    single = train(cfg_of(*overrides), run_dir=tmp_path / "one", data=stdlib, keep_weights=True)
    # ep=2, and ep=2 under ZeRO-3 (the engine builds its sharded flat buffers from the loaded weights)
    layouts = [["parallel=ep2"], ["parallel=ep2", "parallel.zero_stage=3"]]
    dirs = [tmp_path / f"two{i}" for i in range(len(layouts))]
    per_rank = run_distributed(_init_from_rank, 2, [[*overrides, *extra] for extra in layouts], dirs, timeout=300)
    for i, extra in enumerate(layouts):
        runs = [r[i] for r in per_rank]
        assert [s["layout"]["ep"] for s in runs] == [2, 2]
        got = dict(runs[0], weights=assemble_weights(runs, single["weights"]))
        check_same_training(
            got, metrics_rows(dirs[i]), single, metrics_rows(tmp_path / "one"), f"init_from under {extra}"
        )

    # both started from the checkpoint's function: the first loss is transformers' loss on that batch
    x, y = dataclasses.replace(stdlib, seed=0).get_batch("train", 0, 8, 32)
    with torch.no_grad():
        ref = nnf.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert abs(single["train_losses"][0] - ref) <= RTOL * ref, (single["train_losses"][0], ref)


def test_init_from_takes_the_config_and_names_a_conflicting_override(tmp_path):
    from experiments.training.hf_init import resolve_init_from

    transformers.MixtralConfig(**dict(TRAIN_MX, num_local_experts=4, num_key_value_heads=1)).save_pretrained(tmp_path)
    run = [*INIT_RUN, f"model.init_from={tmp_path}"]
    cfg = resolve_init_from(cfg_of(*run), overrides=run)  # model=tiny's values give way to the checkpoint's
    assert (cfg.moe.num_experts, cfg.model.n_kv_heads, cfg.model.hf_family) == (4, 1, "mixtral")
    assert cfg.model.max_seq_len == 32 and cfg.moe.aux_loss_coef == 0  # the run's own settings stay
    bad = [*run, "moe.num_experts=8"]
    with pytest.raises(
        ValueError, match=r"moe\.num_experts=8 conflicts with the checkpoint: .* has moe\.num_experts=4"
    ):
        resolve_init_from(cfg_of(*bad), overrides=bad)
    same = [*run, "moe.num_experts=4", "model.rope_theta=10000"]  # agreeing overrides are fine
    resolve_init_from(cfg_of(*same), overrides=same)


# ---------------------------------------------------------------------------------------------
# python -m experiments.checkpoint export-hf: a training checkpoint -> a transformers Mixtral directory

EXPORT_RUN = [*SHORT, "train.steps=2", "train.log_every=1", "train.eval_every=2", "train.checkpoint.every=2"]


def test_export_hf_turns_a_training_checkpoint_into_a_mixtral_directory(tmp_path, stdlib, monkeypatch, capsys):
    import weakref

    from experiments import checkpoint as ec
    from experiments.train import train
    from experiments.training.build import build_model

    cfg = cfg_of(*EXPORT_RUN)
    run = train(cfg, run_dir=tmp_path / "run", data=stdlib, keep_weights=True)
    ours = build_model(cfg).eval()
    ours.load_state_dict(run["weights"], strict=False)  # the parameters; the buffers (zero biases) as built

    # every tensor read from the checkpoint is dropped before the next is read: one at a time
    reads, live = [], []
    original = ec.CheckpointTensors._tensor

    def tracked(self, name, lo, hi):
        alive = [n for n, ref in live if ref() is not None]
        assert not alive, f"reading {name} while {alive} are still held"
        t = original(self, name, lo, hi)
        reads.append(name)
        live.append((name, weakref.ref(t)))
        return t

    monkeypatch.setattr(ec.CheckpointTensors, "_tensor", tracked)
    assert ec.main(["export-hf", str(tmp_path / "run" / "checkpoints"), str(tmp_path / "mx")]) == 0
    assert "wrote a transformers Mixtral checkpoint" in capsys.readouterr().out  # the one family that carries it
    assert len(reads) == len(set(reads)) and set(run["weights"]) <= set(reads)  # each once
    hf = _from_pretrained(tmp_path / "mx")
    assert hf.config.num_local_experts == ours.cfg.moe.num_experts and hf.config.vocab_size == 256
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _close(ours(ids), hf(ids).logits, "export-hf checkpoint in transformers")

    # one checkpoint named directly; bf16, sharded; a directory that already holds weights is refused
    assert (
        ec.main(
            [
                "export-hf",
                str(zc.step_dir(tmp_path / "run" / "checkpoints", 2)),
                str(tmp_path / "bf16"),
                "--dtype",
                "bf16",
                "--max-shard-bytes",
                "100000",
            ]
        )
        == 0
    )
    assert len(json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list((tmp_path / "bf16").glob("model-*-of-*.safetensors"))) > 2
    back = import_mixtral(tmp_path / "bf16")
    for name, w in run["weights"].items():
        assert torch.equal(back.state_dict()[name], w.to(torch.bfloat16).float()), name
    assert ec.main(["export-hf", str(tmp_path / "run" / "checkpoints"), str(tmp_path / "bf16")]) == 1
    assert "already holds" in capsys.readouterr().err


def test_export_hf_refuses_a_model_mixtral_cannot_compute(tmp_path, stdlib, capsys):
    from experiments import checkpoint as ec
    from experiments.train import train

    # DeepSeek-style routing: sigmoid scores, groups, a shared expert, expert biases
    train(
        cfg_of(*EXPORT_RUN, "moe=deepseek", "train.steps=1", "train.checkpoint.every=1", "train.eval_every=1"),
        run_dir=tmp_path / "run",
        data=stdlib,
    )
    assert ec.main(["export-hf", str(tmp_path / "run" / "checkpoints"), str(tmp_path / "mx")]) == 1
    err = capsys.readouterr().err
    # the run was not started from a transformers checkpoint: no family can carry it, each says why
    assert err.startswith(
        "error: no supported family can carry this model: moe.score_func='sigmoid' cannot be a Mixtral"
    )
    assert "model.attention='mha' cannot be a DeepSeek-V3 model" in err, err
    assert not (tmp_path / "mx").exists()
