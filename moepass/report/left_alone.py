"""What moepass will not rewrite, and why: every skip code a pass records, with what a user can do about it.

Each skip in a report carries its code (moepass.skips.SkipCode: why and fix); `explain` looks one up. The README's
section is printed from the codes (`left_alone_table_markdown`), as the options table is from the options.
"""

from __future__ import annotations

from ..skips import SkipCode

ROWS: tuple[SkipCode, ...] = tuple(SkipCode)


def explain(skip) -> SkipCode | None:
    """The documented code of a skip: a SkipCode, its name ("ROUTER_GATE"), or a record carrying `.code` (a report's
    Skip, the EP analysis's RegionSkip, a Reason); None when it has none."""
    code = getattr(skip, "code", skip)
    if isinstance(code, str):
        return SkipCode.__members__.get(code)
    return code if isinstance(code, SkipCode) else None


def left_alone_table_markdown() -> str:
    rows = ["| pass | reason contains | why | what you can do |", "|---|---|---|---|"]
    rows += [f"| {r.passes} | `{r.phrase}` | {r.why} | {r.fix} |" for r in ROWS]
    return "\n".join(rows)
