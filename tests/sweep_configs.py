"""Seeded generator of small DeepSeek-V3-style MoE training configs for the robustness sweep (test_sweep.py).

`generate(n, seed)` is deterministic: the same (n, seed) gives the same configs, and config i does not depend
on n. Axes drawn per config:

  model        moepass.models DeepSeek-V3 ("ds") or tests/independent/hf_style_moe ("hf", sigmoid router only)
  dims         hidden dim and expert / dense FFN widths, multiples of 32 and not (MXFP8 needs K, N % 32 == 0)
  experts      1..32 routed experts, top-k 1..E (some top-k = E), group-limited routing or none
  score        softmax or sigmoid (the hf model is sigmoid only), route norm on or off
  shared       0, 1 or 2 shared experts (0: a zero-width shared FFN, as both models spell "off")
  tokens       per rank batch x seq, including 0 tokens (ds only: the hf model cannot run them) and 1 token
  routing      random init; "hot": the selection bias sends every token's first choice to one expert;
               "spiky": one gate row scaled x100 (saturated scores, about half the tokens pick that expert)
  shapes       static, torch.compile(dynamic=True), or torch._dynamo.mark_dynamic on the batch or seq dim
  ep           1, or 2 gloo ranks (ds only); ranks may get unequal token counts, one of them none
  inductor     False for most (the rewritten graph runs eagerly: compile cost stays seconds);
               real Inductor for every INDUCTOR_EVERY-th config, kept to one layer; a third of those on an
               empty batch (plain Inductor's backward fails there; moepass must not)

Configs are valid by construction except about 1 in 20 ds configs drawn without the routing constraints
(top-k, groups) and EP configs whose expert count is odd: moepass.models rejects those with ValueError at
build, which the sweep counts as "rejected by the model", not as a failure. Pure Python: no torch import.

Not an axis: dtype. Under torch.compile, torch._grouped_mm's fake kernel takes BF16 only, so a float32 MoE cannot
be compiled by any backend; the models are BF16 (the hf router's float32 linear still meets the dtype skip).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable

# multiples of 8 but not all of 32: torch._grouped_mm itself needs 16-byte row strides (8 BF16 elements)
HIDDEN_DIMS = (32, 40, 48, 64, 72, 96, 120, 128)
EXPERT_WIDTHS = (16, 24, 32, 56, 64, 96)
DENSE_WIDTHS = (32, 64, 72, 80)
EXPERT_COUNTS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)
INDUCTOR_EVERY = 31  # config i runs real Inductor when i % INDUCTOR_EVERY == INDUCTOR_EVERY - 1
UNCONSTRAINED_ROUTING_P = 0.05  # ds configs drawn ignoring the routing constraints (the model may reject them)


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    index: int
    seed: int  # weights, tokens and targets
    model: str  # "ds" (moepass.models) or "hf" (tests/independent/hf_style_moe)
    dim: int
    moe_inter_dim: int  # one routed (and one shared) expert's hidden width
    inter_dim: int  # dense FFN hidden width (layers before n_dense_layers)
    n_layers: int
    n_dense_layers: int
    n_heads: int
    q_lora_rank: int  # 0: plain query projection
    kv_lora_rank: int
    qk_rope_head_dim: int
    vocab_size: int
    n_experts: int
    top_k: int
    n_expert_groups: int
    n_limited_groups: int
    score_func: str
    route_norm: bool
    n_shared_experts: int
    batch: tuple[int, ...]  # per EP rank
    seq: int
    routing: str  # "random", "hot" or "spiky"
    shapes: str  # "static", "dynamic" or "mark_dynamic:<dim>"
    ep: int
    inductor: bool

    @property
    def id(self) -> str:
        groups = f"g{self.n_expert_groups}l{self.n_limited_groups}" if self.n_expert_groups > 1 else "nog"
        tokens = "+".join(str(b) for b in self.batch)
        parts = [f"c{self.index:03d}", self.model, f"d{self.dim}f{self.moe_inter_dim}",
                 f"E{self.n_experts}k{self.top_k}", groups, self.score_func[:4] + ("n" if self.route_norm else ""),
                 f"sh{self.n_shared_experts}", f"L{self.n_layers}", f"t{tokens}x{self.seq}", self.routing,
                 self.shapes.replace(":", ""), f"ep{self.ep}", "ind" if self.inductor else "eager"]
        return "-".join(parts)

    def tokens_on(self, rank: int) -> int:
        return self.batch[rank] * self.seq

    @property
    def uses_constrained_routing(self) -> bool:
        """What moepass.models' config check accepts (the hf model has no check, so its configs always do)."""
        if self.n_experts % self.n_expert_groups or not 1 <= self.n_limited_groups <= self.n_expert_groups:
            return False
        per_group = self.n_experts // self.n_expert_groups
        if self.top_k > self.n_limited_groups * per_group:
            return False
        return not (self.n_expert_groups > 1 and self.score_func == "sigmoid" and per_group < 2)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _routing_shape(rng: random.Random, model: str, n_experts: int, score_func: str) -> tuple[int, int, int]:
    """(groups, limited groups, top-k), valid for the model."""
    # sigmoid group scores sum each group's top-2 (ds with groups; hf always, its single group included)
    min_per_group = 2 if score_func == "sigmoid" else 1
    group_choices = [g for g in _divisors(n_experts) if g > 1 and n_experts // g >= min_per_group]
    groups = 1
    if group_choices and rng.random() < 0.5:
        groups = rng.choice(group_choices)
    limited = rng.randint(1, groups)
    reachable = limited * (n_experts // groups)
    top_k = reachable if rng.random() < 0.15 else rng.randint(1, min(reachable, 4))
    return groups, limited, top_k


def _unconstrained_routing(rng: random.Random, n_experts: int) -> tuple[int, int, int]:
    groups = rng.randint(1, 4)
    return groups, rng.randint(1, groups + 1), rng.randint(1, n_experts + 2)


def _tokens(rng: random.Random, ep: int, model: str) -> tuple[tuple[int, ...], int]:
    kind = rng.random()
    # the hf model's attention reshapes to (b, s, -1), as transformers does: 0 tokens fail it uncompiled
    if kind < 0.08 and model == "ds":
        return (0,) * ep, rng.randint(2, 8)  # empty batch on every rank
    if kind < 0.16:
        return (1,) * ep, 1  # one token per rank
    seq = rng.randint(1, 12)
    batch = tuple(rng.randint(1, 3) for _ in range(ep))
    if ep > 1 and rng.random() < 0.15:
        batch = (batch[0], 0)  # one rank has nothing to send, the other does
    return batch, seq


def _shapes(rng: random.Random, batch: tuple[int, ...], seq: int) -> str:
    kind = rng.random()
    if kind < 0.6:
        return "static"
    if kind < 0.8:
        return "dynamic"
    # mark a dim that is >= 2 on every rank: Dynamo specializes sizes 0 and 1
    dims = [d for d, sizes in ((0, batch), (1, (seq,))) if min(sizes) >= 2]
    return f"mark_dynamic:{rng.choice(dims)}" if dims else "dynamic"


def draw(index: int, seed: int) -> SweepConfig:
    """Config `index` of the sweep seeded `seed` (independent of how many are drawn)."""
    rng = random.Random(f"{seed}:{index}")
    inductor = index % INDUCTOR_EVERY == INDUCTOR_EVERY - 1
    model = "ds" if rng.random() < 0.7 else "hf"
    if inductor:  # Inductor configs cycle: ds on an empty batch, hf, ds
        model = ("ds", "hf", "ds")[index // INDUCTOR_EVERY % 3]
    ep = 2 if model == "ds" and rng.random() < 0.3 else 1
    score_func = rng.choice(("softmax", "sigmoid")) if model == "ds" else "sigmoid"
    counts = [e for e in EXPERT_COUNTS if model == "ds" or e >= 2]
    if ep > 1 and rng.random() < 0.95:
        counts = [e for e in counts if e % ep == 0]
    n_experts = rng.choice(counts)
    if model == "ds" and rng.random() < UNCONSTRAINED_ROUTING_P:
        groups, limited, top_k = _unconstrained_routing(rng, n_experts)
    else:
        groups, limited, top_k = _routing_shape(rng, model, n_experts, score_func)
    n_layers = 1 if inductor else rng.choice((1, 2))
    batch, seq = _tokens(rng, ep, model)
    if inductor and index // INDUCTOR_EVERY % 3 == 0:
        batch = (0,) * ep
    shapes = _shapes(rng, batch, seq)
    if shapes == "dynamic" and seq in batch and seq >= 2:
        seq += 1  # batch == seq would be duck-sized into one symbol: the second step's new seq would recompile
    return SweepConfig(
        index=index,
        seed=seed * 100_003 + index,
        model=model,
        dim=rng.choice(HIDDEN_DIMS),
        moe_inter_dim=rng.choice(EXPERT_WIDTHS),
        inter_dim=rng.choice(DENSE_WIDTHS),
        n_layers=n_layers,
        n_dense_layers=rng.randint(0, n_layers - 1),
        n_heads=rng.choice((1, 2)),
        q_lora_rank=rng.choice((0, 0, 16, 32)),
        kv_lora_rank=rng.choice((16, 32)),
        qk_rope_head_dim=rng.choice((8, 16)),
        vocab_size=rng.choice((64, 96)),
        n_experts=n_experts,
        top_k=top_k,
        n_expert_groups=groups,
        n_limited_groups=limited,
        score_func=score_func,
        route_norm=rng.random() < 0.5,
        n_shared_experts=rng.choice((0, 1, 1, 2)),
        batch=batch,
        seq=seq,
        routing=rng.choices(("random", "hot", "spiky"), weights=(70, 15, 15))[0],
        shapes=shapes,
        ep=ep,
        inductor=inductor,
    )


def generate(n: int, seed: int) -> list[SweepConfig]:
    return [draw(i, seed) for i in range(n)]


def axis_values(c: SweepConfig) -> set[str]:
    """The axis buckets a config covers: the CI slice must hold each one that the sweep holds."""
    top_k = "topk=1" if c.top_k == 1 else "topk=E" if c.top_k == c.n_experts else "topk=mid"
    experts = "E=1" if c.n_experts == 1 else "E<=8" if c.n_experts <= 8 else "E>8"
    sizes = [c.tokens_on(r) for r in range(c.ep)]
    one_rank_empty = 0 in sizes and max(sizes) > 0
    tokens = {0: "T=0", 1: "T=1"}.get(max(sizes) if one_rank_empty else min(sizes), "T>1")
    values = {
        f"model={c.model}", experts, top_k, f"score={c.score_func}", f"routing={c.routing}",
        f"shapes={c.shapes.split(':')[0]}", f"ep={c.ep}", f"inductor={c.inductor}", tokens,
        "groups" if c.n_expert_groups > 1 else "no-groups",
        "shared" if c.n_shared_experts else "no-shared",
        "dim%32" if c.dim % 32 == 0 else "dim!%32",
        "expert-width%32" if c.moe_inter_dim % 32 == 0 else "expert-width!%32",
    }
    values.add("dense+moe layers" if c.n_dense_layers else "moe layers only")
    values.add("q-lora" if c.q_lora_rank else "no-q-lora")
    if c.ep > 1:  # the EP region analysis meets these apart from the rest
        values |= {f"ep2 x {v}" for v in (tokens, f"shapes={c.shapes.split(':')[0]}", f"routing={c.routing}")}
    if one_rank_empty:
        values.add("ep-one-rank-empty")
    elif len(set(c.batch)) > 1:
        values.add("ep-uneven-tokens")
    return values


def covering_subset(configs: Iterable[SweepConfig], cost, exclude=lambda c: False) -> list[SweepConfig]:
    """Greedy set cover of `axis_values` over the configs not excluded: each step takes the config with the
    most new buckets per unit of `cost(config)` (ties: lowest index). Deterministic in its inputs."""
    pool = [c for c in configs if not exclude(c)]
    wanted = set().union(*(axis_values(c) for c in pool))
    chosen: list[SweepConfig] = []
    while wanted:
        best = max(pool, key=lambda c: (len(axis_values(c) & wanted) / cost(c), -c.index))
        chosen.append(best)
        wanted -= axis_values(best)
    return sorted(chosen, key=lambda c: c.index)
