"""moepass/harness/peers.py: torchtitan's torchao recipes as bench variants (what users run instead of moepass)."""

import pytest
import torch

from helpers import TINY
from moepass.harness import bench, peers, variants
from moepass.harness.corpus import Batches, load_corpus
from moepass.harness.model_spec import ModelSpec
from moepass.harness.ranks import Ranks
from moepass.harness.timing import add_speedups
from moepass.models import build_model


def test_peer_variants_compile_with_plain_inductor_after_conversion():
    vs = {v.name: v for v in variants.resolve_variants(["inductor", "all", "torchao_fp8", "torchao_mxfp8"])}
    for name in peers.PEERS:
        assert vs[name].backend == "inductor" and vs[name].peer == name
    assert vs["all"].peer is None and vs["inductor"].prepare(torch.nn.Linear(2, 2)) is None
    assert vs["torchao_fp8"].options == {"emulate_precision_casts": True}  # Inductor config, as torchtitan sets it
    assert vs["torchao_mxfp8"].options is None


def test_peer_on_a_device_without_its_kernels_is_recorded_with_the_reason_and_the_rest_run():
    train_tokens, _ = load_corpus(None)
    batches = Batches(train_tokens, 2, 16)
    vs = variants.resolve_variants(["torchao_fp8", "eager"])
    entries = [bench.run_variant(v, ModelSpec(overrides=TINY), batches, steps=2, warmup=1, lr=1e-3, seed=0,
                                 ranks=Ranks(), ep=1) for v in vs]
    assert entries[0]["status"] == "unavailable" and "sm_90" in entries[0]["error"]
    assert entries[1]["status"] == "ok" and add_speedups(entries) == "eager"
    assert "n/a" in bench.table(entries, 1) and "FAILED" not in bench.table(entries, 1)


def test_converge_says_a_peer_cannot_run_here_instead_of_training_plain_inductor_under_its_name():
    from moepass.harness.converge import train_variant

    (peer,) = variants.resolve_variants(["torchao_fp8"])
    entry = train_variant(peer, ModelSpec(overrides=TINY), None, None, steps=2, lr=1e-3, lr_warmup=0, seed=0,
                          device=torch.device("cpu"), val_n=1, log_every=1)
    assert entry["status"] == "unavailable" and "sm_90" in entry["error"] and "loss" not in entry


# the conversions on the tiny DeepSeek-V3 (a dense and an MoE layer, every kind of linear the debug flavor has): what
# is converted depends on each module's role, not its size, and the debug flavor's 4.8M weights cost seconds a build

@pytest.mark.parametrize("name, linear_cls, weight_cls", [
    ("torchao_fp8", "Float8Linear", "Float8TrainingWeightWrapperTensor"),
    ("torchao_mxfp8", "MXFP8Linear", "MXFP8TrainingWeightWrapperTensor"),
])
def test_conversion_keeps_router_gates_and_output_head_bf16(name, linear_cls, weight_cls):
    model = build_model("debug", **TINY)
    plain = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    done = peers.convert_to_peer(name, model)
    kinds = {fqn: type(m).__name__ for fqn, m in model.named_modules()}
    assert kinds["output"] == "Linear"
    gates = [fqn for fqn in kinds if fqn.endswith("router.gate")]
    assert gates and all(kinds[g] == "Linear" for g in gates)
    converted = [fqn for fqn, k in kinds.items() if k == linear_cls]
    assert len(converted) == done["linears"] == plain - len(gates) - 1
    experts = [fqn for fqn, m in model.named_modules() if fqn.endswith("experts") and "shared" not in fqn]
    assert experts and done["expert_modules"] == len(experts)
    for fqn in experts:
        assert all(type(p.data).__name__ == weight_cls for p in model.get_submodule(fqn).parameters())


def test_fused_adamw_updates_torchao_subclass_weights_as_plain_ones():
    # the bench's AdamW is fused on CUDA (train.adamw); fused on CPU runs the same update rule
    updated = []
    for convert in (True, False):
        torch.manual_seed(0)
        model = build_model("debug", **TINY)
        if convert:
            peers.convert_to_peer("torchao_fp8", model)
        params = list(model.parameters())
        gen = torch.Generator().manual_seed(0)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.0, fused=True)
        opt.step()
        opt.step()
        updated.append([p.detach().float() for p in params])
        kinds = {type(p).__name__ for p in params}
        assert ("Float8TrainingWeightWrapperTensor" in kinds) == convert
    torch.manual_seed(0)
    start = [p.detach().float() for p in build_model("debug", **TINY).parameters()]
    assert all(not torch.equal(a, s) for a, s in zip(updated[0], start) if a.numel() > 64)
    assert all(torch.equal(a, b) for a, b in zip(*updated))


def test_unknown_peer_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown peer variant"):
        peers.convert_to_peer("torchao_fp4", build_model("debug", **TINY))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="torchao's FP8 recipe (its grouped GEMMs) needs an sm_90+ GPU")
def test_torchao_fp8_trains_the_same_model_as_inductor_on_gpu():
    """The peer variant runs end to end (linears, padded expert groups) and its losses track BF16's."""
    train_tokens, _ = load_corpus(None)
    batches = Batches(train_tokens, 4, 256)
    spec = ModelSpec(flavor="debug")
    entries = [bench.run_variant(v, spec, batches, steps=4, warmup=1, lr=1e-3, seed=0,
                                 ranks=Ranks(device=torch.device("cuda")), ep=1)
               for v in variants.resolve_variants(["inductor", "torchao_fp8"])]
    base, peer = entries
    assert peer["status"] == "ok", peer.get("error")
    assert peer["converted"]["expert_modules"] > 0 and peer["converted"]["linears"] > 0
    assert abs(peer["losses"][0] - base["losses"][0]) / base["losses"][0] < 0.02  # same weights, same batch
