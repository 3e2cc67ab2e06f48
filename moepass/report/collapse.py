"""Identical layers said once: `layers.1-60.moe.experts: w1, w3, w2 -> fp8_rowwise grouped GEMM (x60)`.

A module path's numeric parts (layer, expert) are what differ between identical layers: paths equal but for them
share a key (`layers.{}.moe.experts`), and the numbers fold into ranges. GEMMs fold by key, outcome and the GEMMs
each module holds; skips and rewrites by pass, key and what was recorded.
"""

from __future__ import annotations

import dataclasses
import re

from .coverage import BF16, LOW_PRECISION, NOT_WEIGHT, TORCHAO, GemmUse

_NUMBER = re.compile(r"(?<![^.])\d+(?![^.])")  # a whole dotted component that is a number


def layer_key(path: str) -> tuple[str, tuple[int, ...]]:
    """`layers.3.moe.experts.7` -> (`layers.{}.moe.experts.{}`, (3, 7))."""
    numbers = tuple(int(n) for n in _NUMBER.findall(path))
    return _NUMBER.sub("{}", path.replace("{", "(").replace("}", ")")), numbers


def ranges(values) -> str:
    """{1, 2, 3, 5, 7, 8} -> "1-3,5,7-8"."""
    values, spans = sorted(set(values)), []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def pattern(key: str, numbers: list[tuple[int, ...]]) -> str:
    """The key with each numeric part written as the range of its values over `numbers`."""
    columns = [ranges(column) for column in zip(*numbers)] if numbers and numbers[0] else []
    return key.format(*columns) if columns else key


@dataclasses.dataclass
class Folded:
    """Modules equal but for their numbers, and what they have in common."""
    modules: str  # the pattern: "layers.1-60.moe.experts"
    names: list[str]  # what each holds ("w1", "w3", "w2"), in graph order
    outcome: str  # "fp8_rowwise grouped GEMM", "BF16: ROUTER_GATE", ...
    count: int  # how many modules
    status: str = ""  # a GEMM's coverage status; '' for skips and rewrites
    nodes: int = 0  # nodes (GEMMs, skips, rewrites) in all of them
    flops: int = 0

    def line(self) -> str:
        names = f" {', '.join(self.names)}" if self.names else ""
        count = f" (×{self.count})" if self.count > 1 else ""
        return f"{self.modules or '<top>'}:{names} → {self.outcome}{count}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def gemm_outcome(use: GemmUse) -> str:
    if use.status == LOW_PRECISION and use.code == TORCHAO:
        return f"left to torchao: {use.note}" if use.note else "left to torchao"
    if use.status == LOW_PRECISION and not use.op.startswith("moepass."):
        return f"{use.op} (already low precision)"
    if use.status == LOW_PRECISION:
        op = use.op.removeprefix("moepass.")
        for spelled, said in (("_grouped_mm_rows", " grouped GEMM on rows quantized once"),
                              ("_grouped_mm", " grouped GEMM"), ("_linear", " linear")):
            if op.endswith(spelled):
                op = op.removesuffix(spelled) + said
                break
        return op + (" (wgrad BF16)" if use.lowp_flops < use.flops else "")
    if use.status == BF16:
        return f"BF16: {use.code or 'no code'}"
    if use.status == NOT_WEIGHT:
        return "not a weight GEMM (activations only: outside the coverage)"
    return f"UNACCOUNTED {use.op}"


def _owner_and_name(use: GemmUse) -> tuple[str, str]:
    """A linear is named by its module (`layers.0.attn.wq`), a weight of a module by its own name (`experts.w1`),
    a GEMM on no weight by its op."""
    named_by_weight = use.module == use.weight or use.module.endswith("." + use.weight)  # (node_module.module_path)
    if use.module and (use.weight == "weight" or named_by_weight):
        owner, _, name = use.module.rpartition(".")
        return owner, name
    return use.module, use.weight or use.op


def fold_gemms(uses: list[GemmUse]) -> list[Folded]:
    """GEMMs folded over identical modules: one line per (module pattern, outcome, GEMMs each module holds)."""
    per_owner: dict[tuple[str, str], list[GemmUse]] = {}
    for use in uses:
        owner, _ = _owner_and_name(use)
        per_owner.setdefault((owner, gemm_outcome(use)), []).append(use)
    folded: dict[tuple, tuple[list, list[GemmUse]]] = {}
    for (owner, outcome), members in per_owner.items():
        names = list(dict.fromkeys(_owner_and_name(u)[1] for u in members))
        key, numbers = layer_key(owner)
        entry = folded.setdefault((key, outcome, tuple(names)), ([], []))
        entry[0].append(numbers)
        entry[1].extend(members)
    return [Folded(pattern(key, numbers), list(names), outcome, len(numbers), members[0].status, len(members),
                   sum(u.flops for u in members))
            for (key, outcome, names), (numbers, members) in folded.items()]


def fold_records(records, text) -> list[tuple[str, Folded]]:
    """(pass name, Folded) for rewrites or skips, given as (pass name, record) pairs: folded over identical modules
    by pass, module pattern and `text(record)` with the record's own module path written as its key."""
    groups: dict[tuple, list] = {}
    for name, r in records:
        key, numbers = layer_key(r.module)
        said = text(r).replace(r.module, key) if r.module else text(r)
        groups.setdefault((name, key, said), []).append((numbers, r.module))
    out = []
    for (name, key, said), members in groups.items():
        numbers = list(dict.fromkeys(n for n, _ in members))
        modules = pattern(key, numbers)
        out.append((name, Folded(modules, [], said.replace(key, modules) if key else said, len(numbers),
                                 nodes=len(members))))
    return out
