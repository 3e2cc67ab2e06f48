"""What moepass will not rewrite, and why: every skip reason a pass gives, with what a user can do about it.

A row's `phrase` is a substring of the reasons the passes record (the first row whose phrase matches
explains a reason, so specific phrases come before general ones), so a report's reason can be explained
(`explain`) and the tests check that every reason they provoke is documented here. The README's section
is printed from this table (`moepass left-alone`), as the options table is from the options.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LeftAlone:
    passes: str  # which pass(es) give the reason
    phrase: str  # a substring of the recorded reason
    why: str
    fix: str


ROWS: tuple[LeftAlone, ...] = (
    # ---- low-precision GEMM passes (linear, grouped_mm)
    LeftAlone("linear", "router gate", "its scores pick the experts; quantization noise would flip routing",
              "`lowp.keep_router_bf16: false` to quantize it anyway"),
    LeftAlone("linear", "output head", "the vocabulary projection (no GEMM or residual add after it in its "
              "graph; the last GEMM before a graph break looks the same)", "`lowp.keep_output_head_bf16: false`"),
    LeftAlone("both", "excluded by lowp.exclude", "your exclude pattern matches its module path",
              "edit `lowp.exclude`"),
    LeftAlone("both", "matches no lowp.include", "your include patterns miss its module path",
              "edit `lowp.include` (paths are state_dict names: `layers.3.moe.experts`)"),
    LeftAlone("both", "not bfloat16", "only BF16 GEMMs are rewritten (an fp32 router, an fp32 model)",
              "train in bfloat16 (`model.to(torch.bfloat16)`)"),
    LeftAlone("both", "not a multiple of", "the kernels need K and N in whole blocks (32 for MXFP8, 16 for FP8 "
              "rowwise)", "pad the hidden or intermediate size"),
    LeftAlone("both", "empty GEMM", "K or N is 0 (a zero-width expert): nothing to quantize", "-"),
    LeftAlone("linear", "expected a 2-D weight", "a batched or 1-D product, not a linear", "-"),
    LeftAlone("grouped_mm", "only the MoE form", "a grouped GEMM that is not x[M,K] @ w[E,K,N] with group "
              "offsets (a batched 3-D x 3-D product)", "-"),
    LeftAlone("grouped_mm", "with bias", "grouped GEMMs with bias are not supported", "-"),
    LeftAlone("grouped_mm", "out_dtype=", "a non-BF16 output was asked for", "-"),
    LeftAlone("grouped_mm", "offs is", "group offsets are not int32", "`torch.cumsum(..., dtype=torch.int32)`"),
    LeftAlone("both", "left in BF16:", "recipe auto on this GPU: no FP8 tensor cores, or FP8 measured slower than "
              "BF16 at this size and token count (moepass/fp8_auto_table_h200.json, or the size rule "
              "fp8_recipe.FP8_ROWWISE_MIN for shapes it does not hold)", "`recipe: fp8_rowwise` (or `mxfp8`) to force it"),
    LeftAlone("both", "no recorded tensor metadata", "Dynamo recorded no shape for an operand", "report it: a bug"),
    # ---- deepep
    LeftAlone("deepep", "not part of a dispatch/combine pair", "an all-to-all that is not an MoE token exchange "
              "(no later all-to-all sends the rows back)", "-"),
    LeftAlone("deepep", "no counts all-to-all", "the token all-to-all's split sizes do not come from exchanged "
              "per-expert counts", "-"),
    LeftAlone("deepep", "bincount's length is data dependent", "`bincount(ids, minlength=E)` has max(E, max(ids) + 1) "
              "entries; moepass proves it is E only when the ids provably lie in [0, E) (top-k, argmax or argsort "
              "indices over E experts, `% E`, `.clamp(0, E - 1)`, through views, casts and gathers); the reason says "
              "where the proof stopped", "pass `minlength=E` and derive the ids from the router's top-k over E "
              "experts, add `torch._check(counts.size(0) == E)` after the bincount, or count with "
              "`zeros(E).scatter_add_(0, ids, ones)`"),
    LeftAlone("deepep", "count per expert", "the counts exchange does not send an integer count per expert",
              "exchange `tokens_per_expert` ([E] or [ranks, E/ranks])"),
    LeftAlone("deepep", "not split evenly", "experts are not split evenly over the ranks",
              "a number of experts divisible by the EP size"),
    LeftAlone("deepep", "top-k expert ids", "no integer [T, K] tensor feeds both the counts and the rows sent", "-"),
    LeftAlone("deepep", "could not find the token rows x", "the rows sent are not gathered from one [T, D] tensor",
              "-"),
    LeftAlone("deepep", "top-k slots per expert", "slots are dropped (capacity factor) or padding rows are sent: "
              "DeepEP sends every (token, expert) slot", "turn token dropping off"),
    LeftAlone("deepep", "split sizes are not the per-rank sums", "split sizes that are not the rows per rank", "-"),
    LeftAlone("deepep", "rows sent are not x[token]", "the rows sent are transformed (beyond a routing weight) "
              "or not sorted by expert", "-"),
    LeftAlone("deepep", "rows sent back are not computed", "the combine does not send the experts' output back",
              "-"),
    LeftAlone("deepep", "read the received row count", "Dynamo traced the experts' row count as the split-size "
              "sum, which the rewrite cannot supply", "derive it from the group sizes: `int(group_sizes.sum())`"),
    LeftAlone("deepep", "not computed from", "the index code reads something besides the routing and the counts "
              "(or failed on a sample routing: the reason says which node)", "-"),
    LeftAlone("deepep", "not a permutation of the received rows", "the receiver pads or drops rows (torchao's "
              "permute_and_pad, torchtitan's MXFP8 dispatcher)", "not supported yet: use the unpadded dispatcher"),
    LeftAlone("deepep", "does not group the received rows", "the experts' input is not grouped by local expert",
              "-"),
    LeftAlone("deepep", "un-permuted", "the rows sent back are not the experts' output in received order", "-"),
    LeftAlone("deepep", "read the received rows other than", "the experts read the received rows directly, not "
              "only through their expert-major input", "-"),
    LeftAlone("deepep", "group sizes", "the experts' group sizes are not the received rows per local expert "
              "(padded, or from elsewhere)", "-"),
    LeftAlone("deepep", "not the sum of each token's K returned rows", "the combine averages, or weights "
              "differently than once per slot", "-"),
    LeftAlone("deepep", "result computed from the returned rows", "no token-shaped result is a sum of the returned "
              "rows with one routing-weight tensor (e.g. no routing weights at all)", "-"),
    LeftAlone("deepep", "inside the EP region) is also used by", "a value between the two exchanges is read "
              "outside the region (logged, stored, returned)", "read it outside the compiled region, or drop it"),
    LeftAlone("deepep", "too narrow", "rows narrower than the digits that identify a token in the checks", "-"),
    LeftAlone("deepep", "dynamic token count is neither", "a dynamic-shape result shaped neither [T, D] nor like x",
              "-"),
    LeftAlone("deepep", "cannot be sampled", "a size with a symbol the checks cannot give a value", "-"),
    LeftAlone("deepep", "DeepEP takes bfloat16", "DeepEP sends bfloat16 tokens only", "bf16 tokens, or "
              "`deepep.backend: reference`"),
    LeftAlone("deepep", "capture_dynamic_output_shape_ops is off", "the received row count could not be traced",
              "do not reset torch._dynamo.config after importing moepass"),
    LeftAlone("deepep", "could not analyse the region", "an unexpected error in the analysis", "report it: a bug"),
)


def explain(reason: str) -> LeftAlone | None:
    """The documented row a recorded skip reason falls under, or None."""
    return next((row for row in ROWS if row.phrase in reason), None)


def left_alone_table_markdown() -> str:
    rows = ["| pass | reason contains | why | what you can do |", "|---|---|---|---|"]
    rows += [f"| {r.passes} | `{r.phrase}` | {r.why} | {r.fix} |" for r in ROWS]
    return "\n".join(rows)
