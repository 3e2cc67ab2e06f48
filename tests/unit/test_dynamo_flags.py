"""moepass/dynamo_flags.py: Dynamo's unbacked-value flags on for moepass's own frames, and for no other compile.

- importing moepass and compiling with it leaves every `torch._dynamo.config` value as it was (fresh process);
- a later `backend="inductor"` compile, in a process that compiled with moepass first, behaves as in one that did
  not: same result, same config before/after, same graphs and graph breaks;
- inside moepass's compiles the flags are on: `.tolist()` split sizes and a data-dependent row count trace into
  one graph, where another backend in the same process graph-breaks; the Inductor route likewise, only while
  installed and only for Inductor;
- DeepSeek-V3's reference MoE loop (bincount + `.tolist()` counts, `if counts[i] == 0: continue`, `torch.where` or
  `nonzero`), which cannot be traced with the flags, trains under moepass with Inductor's losses: its frames are
  traced again without the flags and graph-break where Inductor's do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import moepass
from expert_loop_moe import build, train_losses
from moepass import dynamo_flags, inductor_route
from moepass.backend import moepass_backend

BF16 = torch.bfloat16
HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------- what the flags are needed for

def split_by_counts(x, counts):
    """An EP exchange's host side: split sizes from `.tolist()` (capture_scalar_outputs), then rows chosen by a
    data-dependent mask (capture_dynamic_output_shape_ops)."""
    parts = x.split(counts.tolist())
    kept = x[x[:, 0] > 0]
    return torch.cat([p * (i + 1) for i, p in enumerate(parts)]).sum() + kept.sum()


def _split_inputs():
    return torch.randn(6, 8), torch.tensor([1, 3, 2])


def _graphs_and_breaks(compile_and_run) -> tuple[int, int]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compile_and_run()
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _config() -> dict:
    # sets sorted, as the probe below does: a copied set of the same strings may iterate in another order (a flake)
    return {k: repr(sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v)
            for k, v in torch._dynamo.config.get_config_copy().items()}


def test_moepass_compile_traces_split_sizes_in_one_graph_and_other_backends_still_break():
    before = _config()
    x, counts = _split_inputs()
    moepass_run = lambda: torch.compile(split_by_counts, backend="moepass",  # noqa: E731
                                        options={"passes": [], "inductor": False})(x, counts)
    assert _graphs_and_breaks(moepass_run) == (1, 0)
    assert _graphs_and_breaks(lambda: torch.compile(split_by_counts, backend="eager")(x, counts))[1] > 0
    assert _graphs_and_breaks(lambda: torch.compile(split_by_counts, backend="aot_eager")(x, counts))[1] > 0
    assert _config() == before


def test_the_inductor_route_gives_inductor_the_flags_only_while_installed():
    x, counts = _split_inputs()
    want = split_by_counts(x, counts)
    inductor_run = lambda: torch.testing.assert_close(  # noqa: E731
        torch.compile(split_by_counts, backend="inductor")(x, counts), want)
    before = _config()
    with inductor_route.route({"passes": []}):
        assert _config() == before  # install() sets nothing in Dynamo's config
        assert _graphs_and_breaks(inductor_run) == (1, 0)
        assert _graphs_and_breaks(lambda: torch.compile(split_by_counts, backend="aot_eager")(x, counts))[1] > 0
    assert _config() == before
    assert _graphs_and_breaks(inductor_run)[1] > 0
    torch._dynamo.reset()


def test_the_user_backend_is_found_through_dynamos_wrappers():
    from torch._dynamo.backends.distributed import DDPOptimizer
    from torch._dynamo.eval_frame import get_compiler_fn

    named = get_compiler_fn(torch._TorchCompileWrapper("moepass", None, None, None))
    assert dynamo_flags.wants_flags(named)
    assert dynamo_flags.wants_flags(get_compiler_fn(moepass_backend))
    # DDP splits the graph at bucket boundaries and hands each piece to the user's backend
    assert dynamo_flags.wants_flags(DDPOptimizer(bucket_bytes_cap=25 * 2**20, backend_compile_fn=named).compile_fn)
    for other in ("inductor", "aot_eager", "eager"):
        assert not dynamo_flags.wants_flags(get_compiler_fn(torch._TorchCompileWrapper(other, None, None, None)))
    assert not dynamo_flags.wants_flags(get_compiler_fn(torch._TorchCompileInductorWrapper("default", None, None)))


def test_data_dependent_errors_are_told_from_others():
    from torch._dynamo.exc import Unsupported, UserError, UserErrorType
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    guard = GuardOnDataDependentSymNode(None, "Could not extract specialized integer from data-dependent u0")
    assert dynamo_flags.is_data_dependent(guard)
    try:
        try:
            raise guard
        except GuardOnDataDependentSymNode:
            raise Unsupported("Data-dependent branching")  # noqa: B904  (raised as Dynamo does: context kept)
    except Unsupported as wrapped:
        assert dynamo_flags.is_data_dependent(wrapped)
    assert dynamo_flags.is_data_dependent(UserError(UserErrorType.ANTI_PATTERN, "Consider annotating your code"))
    assert not dynamo_flags.is_data_dependent(Unsupported("generator"))
    assert not dynamo_flags.is_data_dependent(RuntimeError("shape mismatch"))


# ---------------------------------------------------------------- the DeepSeek-V3 reference loop, trained

# CI trains the mixed loop on 2 experts (as many as the probe below): expert 0 takes its rows by torch.where, expert 1
# by nonzero, in half the graphs 4 experts compile; each spelling alone on 4 experts under -m extended
@pytest.mark.parametrize("select, n_experts", [("mixed", 2), pytest.param("where", 4, marks=pytest.mark.extended),
                                               pytest.param("nonzero", 4, marks=pytest.mark.extended)])
def test_data_dependent_expert_loop_trains_under_moepass_with_inductors_losses(select, n_experts):
    from torch._dynamo.utils import counters

    reference = build(select, n_experts)
    torch._dynamo.reset()
    want = train_losses(reference, torch.compile(reference, backend="inductor"))
    model = build(select, n_experts)
    torch._dynamo.reset()
    counters.clear()
    before = _config()
    with moepass.collecting() as report:
        got = train_losses(model, torch.compile(model, backend="moepass"))
    assert _config() == before
    # the frames holding the loop failed to trace with the flags and were traced again as Inductor traces them
    assert counters[dynamo_flags.COUNTER]["frames_traced_without_flags"] > 0 and report.graph_breaks > 0
    linear = {p["name"]: p for p in report.to_dict()["passes"]}["linear"]
    rewritten = {r["module"] for r in linear["rewrites"]}
    experts = {f"moe.experts.{e}.{w}" for e in range(n_experts) for w in ("w1", "w2", "w3")}
    assert experts <= rewritten, linear["skipped"]
    # MXFP8 (emulated) against BF16 GEMMs: the recipe's noise, well within a few percent of the loss
    assert all(abs(g - w) <= 0.02 * w for g, w in zip(got, want)), (got, want)
    assert got[-1] < 0.9 * got[0]  # it learns (untrained, the third batch's loss is 0.94x the first's)


# ---------------------------------------------------------------- a fresh process: nothing leaks

_PROBE = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    from torch._dynamo.utils import counters
    sys.path.insert(0, {independent!r})
    from expert_loop_moe import build, batch

    def config():  # sets sorted: their order differs from one process to the next
        return {{k: repr(sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v)
                for k, v in torch._dynamo.config.get_config_copy().items()}}

    at_start = config()
    if {moepass_first!r}:  # import moepass, then compile and train something else with it
        import moepass, moepass.inductor_route  # noqa: F401
        # test_quiet_terminal.py's user model and input: Inductor's kernels for it are compiled once per test run
        first = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).to(torch.bfloat16)
        torch.compile(first, backend="moepass")(torch.randn(32, 64, dtype=torch.bfloat16)).float().sum().backward()
    before = config()
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    model = build({select!r}, n_experts=2)
    x, _ = batch(0)
    try:
        torch.compile(model, backend="inductor")(x).float().sum().backward()
        result = "ok"
    except Exception as e:
        result = type(e).__name__
    print(json.dumps({{"result": result, "moepass_imported": "moepass" in sys.modules,
                      "unchanged_by_moepass": at_start == before, "before": before, "after": config(),
                      "graphs": counters["stats"]["unique_graphs"] - graphs,
                      "graph_breaks": sum(counters["graph_break"].values()) - breaks}}))
""")


def _probe(moepass_first: bool, select: str = "where") -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHDYNAMO_")}
    code = _PROBE.format(independent=os.path.join(os.path.dirname(HERE), "fixtures", "independent"), moepass_first=moepass_first, select=select)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_inductor_compile_after_a_moepass_compile_behaves_as_in_a_process_without_moepass():
    without, after_moepass = _probe(moepass_first=False), _probe(moepass_first=True)
    assert (without["moepass_imported"], after_moepass["moepass_imported"]) == (False, True)
    assert after_moepass["unchanged_by_moepass"]  # importing and compiling with moepass changed no config value
    assert without["result"] == after_moepass["result"] == "ok"
    assert without["before"] == after_moepass["before"] and without["after"] == after_moepass["after"]
    assert (without["graphs"], without["graph_breaks"]) == (after_moepass["graphs"], after_moepass["graph_breaks"])
    assert without["graph_breaks"] > 0  # the .tolist() and the data-dependent selections break the graph
