"""Why a pass leaves a node alone: one code per reason a user can act on, each with its why and its fix.

A pass records a skip as a `Reason`: its code and the text the report shows (which names the node's own values:
"K=48 not a multiple of 32"). `phrase` is a substring of every text recorded under the code (the tests check it),
so the README's table (moepass.report.left_alone) reads as "reason contains". The order here is the table's.
"""

from __future__ import annotations

import dataclasses
import enum


class SkipCode(enum.Enum):
    def __init__(self, passes: str, phrase: str, why: str, fix: str):
        self.passes = passes  # which pass(es) give it: "linear", "grouped_mm", "both" (of those two), "deepep"
        self.phrase = phrase
        self.why = why
        self.fix = fix

    # ---- low-precision GEMM passes (linear, grouped_mm)
    ROUTER_GATE = ("linear", "router gate", "its scores pick the experts; quantization noise would flip routing",
                   "`lowp.keep_router_bf16: false` to quantize it anyway")
    OUTPUT_HEAD = ("linear", "output head", "the vocabulary projection: the last GEMM of the model (no GEMM or "
                   "residual add after it) whose N is the vocabulary size, whose weight is the embedding's, whose "
                   "output feeds the loss, or a plain linear whose output the model's forward returns, combined with "
                   "no other GEMM's (the reason says which; an expert's GEMM never is one, and a linear that only "
                   "ends a graph cut by a graph break or DDP stays eligible)",
                   "`lowp.keep_output_head_bf16: false`")
    EXCLUDED = ("both", "excluded by lowp.exclude", "your exclude pattern matches its module path",
                "edit `lowp.exclude`")
    NOT_INCLUDED = ("both", "matches no lowp.include", "your include patterns miss its module path",
                    "edit `lowp.include` (paths are state_dict names: `layers.3.moe.experts`)")
    NOT_BF16 = ("both", "not bfloat16", "only GEMMs that run in BF16 are rewritten (BF16 operands, or FP32 ones a "
                "BF16 autocast region casts); not: an fp32 model or router outside autocast, an fp16 autocast region, "
                "torch._grouped_mm on fp32 operands (autocast leaves it in fp32)",
                "train in bfloat16 (`model.to(torch.bfloat16)`, FSDP2 `MixedPrecisionPolicy(param_dtype=torch."
                "bfloat16)`) or run the step under `torch.autocast(device_type, dtype=torch.bfloat16)`; cast "
                "`torch._grouped_mm`'s operands to bfloat16 in the model")
    NOT_A_MULTIPLE = ("both", "not a multiple of", "the recipe's kernels need K and N in whole blocks (the reason "
                      "names the recipe and its block)", "pad the hidden or intermediate size")
    EMPTY_GEMM = ("both", "empty GEMM", "K or N is 0 (a zero-width expert): nothing to quantize", "-")
    NOT_2D_WEIGHT = ("linear", "expected a 2-D weight", "a batched or 1-D product, not a linear", "-")
    BATCHED_GEMM = ("linear", "a batched product per", "a GEMM per head or per expert on a stacked weight (an "
                    "einsum subscript shared by x, the weight and the output; bmm, baddbmm or matmul of 3-D stacks): "
                    "moepass has no low-precision batched GEMM op", "experts: index the stack per expert (`x_e @ "
                    "W[e]`) or use `torch._grouped_mm` with group offsets; per-head products stay BF16")
    GEMM_FORM = ("linear", "not a linear form", "a GEMM on a parameter that is not x times one [K, N] or [N, K] "
                 "weight (the parameter on the left, two parameters, two contracted subscripts, a scaled addmm)",
                 "write it as `x @ W`, `F.linear` or a two-operand einsum contracting one subscript")
    NOT_MOE_FORM = ("grouped_mm", "only the MoE form", "a grouped GEMM that is not x[M,K] @ w[E,K,N] with group "
                    "offsets (a batched 3-D x 3-D product)", "-")
    GROUPED_BIAS = ("grouped_mm", "with bias", "grouped GEMMs with bias are not supported", "-")
    OUT_DTYPE = ("grouped_mm", "out_dtype=", "a non-BF16 output was asked for", "-")
    OFFS_NOT_INT32 = ("grouped_mm", "offs is", "group offsets are not int32", "`torch.cumsum(..., dtype=torch.int32)`")
    LEFT_IN_BF16 = ("both", "left in BF16:", "recipe auto on this GPU: no FP8 tensor cores, or FP8 slower than BF16 "
                    "at this size and token count, as decided by this GPU model's shipped table (moepass/recipes/"
                    "fp8_auto_table_<gpu>.json), a measurement on this GPU (auto.measure) or the size rule "
                    "recipes.auto.FP8_ROWWISE_MIN; the reason names which",
                    "`recipe: fp8_rowwise` (or `mxfp8`) to force it")
    NO_KERNEL = ("both", "no kernel for", "the recipe you asked for has no kernel for this GEMM kind on this device "
                 "(blockwise: torch._scaled_mm takes its scales on sm_90 only; grouped GEMMs also on moepass's "
                 "Triton kernels on GPUs with FP8 tensor cores, and on DeepGEMM on request where it is installed)",
                 "`<recipe>.kernel: emulated` to run its numerics anyway (slower than BF16), or another recipe")
    NO_METADATA = ("both", "no recorded tensor metadata", "Dynamo recorded no shape for an operand", "report it: a bug")
    TP_UNEVEN = ("both", "splits unevenly", "tensor parallelism shards a dim unevenly over the mesh: the "
                 "low-precision blocks need equal shards", "sizes divisible by the tensor-parallel degree")
    TP_PLACEMENTS = ("both", "tensor parallelism:", "the GEMM's DTensor operands are mixed with plain tensors, on "
                     "different meshes, or placed in a layout the ops' sharding strategies do not take as it is "
                     "(rewriting would add communication)", "the colwise / rowwise / sequence-parallel plans of "
                     "`torch.distributed.tensor.parallel`")
    TORCHAO_CONVERTED = ("both, weights_before_gemm", "converted by torchao (", "you converted it with torchao "
                         "(a MoE-training `quantize_` config, Float8Linear, MXFP8Linear or another torchao tensor "
                         "subclass or autograd function): torchao's recipe, kernels and wgrad precision run it as set",
                         "`lowp.take_over_torchao: true` hands tensor-subclass weights to moepass's recipe; opaque "
                         "torchao calls stay torchao's unless you leave them unconverted")
    # ---- quantize_once
    NO_ROWS_FORM = ("quantize_once", "no rows form", "the expert GEMM's recipe or kernel quantizes x inside its own "
                    "kernels (mxfp8 through torchao's grouped GEMMs, blockwise on DeepGEMM)", "-")
    ROWS_ARE_DTENSORS = ("quantize_once", "rows are DTensors", "expert tensor parallelism: the rows are quantized "
                         "where the GEMM reads them", "-")
    DISPATCH_STAYS_BF16 = ("quantize_once", "dispatch sends BF16", "the rows an EP dispatch receives are read by "
                           "more than expert GEMMs that take quantized rows (a routing weight applied before the "
                           "experts, BF16 rows saved for the wgrad), or its backend is DeepEP and the rows' scales "
                           "are not DeepEP's FP8 layout, one fp32 scale per 128 columns (blockwise's 1x128 tiles and "
                           "fp8_rowwise's row scale are; MXFP8's 1x32 power-of-two scales are not), or the hidden "
                           "size is not a multiple of 128", "`quantize_once.saved_rows: fp8`; recipe `blockwise` or "
                           "`fp8_rowwise`; `deepep.backend: reference` to send any scales over torch.distributed")
    SWIGLU_STAYS_BF16 = ("quantize_once", "SwiGLU inputs stay BF16", "`quantize_once.swiglu_inputs: fp8` asked for "
                         "the SwiGLU making an expert GEMM's rows to keep gate and up in FP8, but gate, up or its "
                         "output is read by more than that SwiGLU and the GEMM, or they are not BF16 [M, K], or the "
                         "recipe has no fused SwiGLU", "-")
    # ---- weights_before_gemm
    OUTPUT_READ_ELSEWHERE = ("weights_before_gemm", "unweighted output is also read", "the GEMM's output is read "
                             "besides its product with the routing weights (returned, logged, another op), so the "
                             "backward would keep it anyway", "-")
    WEIGHT_WITH_BIAS = ("weights_before_gemm", "has a bias", "the GEMM adds a bias, which a weight moved onto its "
                        "input would scale too", "-")
    WEIGHT_ON_DTENSORS = ("weights_before_gemm", "operands are DTensors", "tensor parallelism: the weight stays on "
                          "the output, where the DTensor placements were planned", "-")
    # ---- quantize_once, weights_before_gemm
    REWRITE_ERROR = ("quantize_once, weights_before_gemm", "could not rewrite", "an unexpected error while "
                     "rewriting (the GEMM stays as the earlier passes left it)", "report it: a bug")
    # ---- deepep
    NOT_A_PAIR = ("deepep", "not part of a dispatch/combine pair", "an all-to-all that is not an MoE token exchange "
                  "(no later all-to-all sends the rows back)", "-")
    NO_COUNTS_EXCHANGE = ("deepep", "no counts all-to-all", "the token all-to-all's split sizes do not come from "
                          "exchanged per-expert counts", "-")
    BINCOUNT_LENGTH = ("deepep", "bincount's length is data dependent", "`bincount(ids, minlength=E)` has "
                       "max(E, max(ids) + 1) entries; moepass proves it is E only when the ids provably lie in [0, E) "
                       "(top-k, argmax or argsort indices over E experts, `% E`, `.clamp(0, E - 1)`, through views, "
                       "casts and gathers); the reason says where the proof stopped", "pass `minlength=E` and derive "
                       "the ids from the router's top-k over E experts, add `torch._check(counts.size(0) == E)` after "
                       "the bincount, or count with `zeros(E).scatter_add_(0, ids, ones)`")
    NOT_COUNT_PER_EXPERT = ("deepep", "count per expert", "the counts exchange does not send an integer count per "
                            "expert", "exchange `tokens_per_expert` ([E] or [ranks, E/ranks])")
    EXPERTS_UNEVEN = ("deepep", "not split evenly", "experts are not split evenly over the ranks",
                      "a number of experts divisible by the EP size")
    NO_TOPK_IDS = ("deepep", "top-k expert ids", "no integer [T, K] tensor feeds both the counts and the rows sent",
                   "-")
    NO_TOKEN_ROWS = ("deepep", "could not find the token rows x", "the rows sent are not gathered from one [T, D] "
                     "tensor", "-")
    SLOTS_DROPPED = ("deepep", "top-k slots per expert", "slots are dropped (capacity factor) or padding rows are "
                     "sent: DeepEP sends every (token, expert) slot", "turn token dropping off")
    SPLITS_NOT_RANK_SUMS = ("deepep", "split sizes are not the per-rank sums", "split sizes that are not the rows "
                            "per rank", "-")
    ROWS_NOT_X = ("deepep", "rows sent are not x[token]", "the rows sent are transformed (beyond a routing weight) "
                  "or not sorted by expert", "-")
    ROWS_BACK_NOT_COMPUTED = ("deepep", "rows sent back are not computed", "the combine does not send the experts' "
                              "output back", "-")
    READS_ROW_COUNT = ("deepep", "read the received row count", "Dynamo traced the experts' row count as the "
                       "split-size sum, which the rewrite cannot supply",
                       "derive it from the group sizes: `int(group_sizes.sum())`")
    NOT_COMPUTED_FROM = ("deepep", "not computed from", "the index code reads something besides the routing and the "
                         "counts (or failed on a sample routing: the reason says which node)", "-")
    NOT_A_PERMUTATION = ("deepep", "not a permutation of the received rows", "the receiver pads or drops rows "
                         "(torchao's permute_and_pad, torchtitan's MXFP8 dispatcher)",
                         "not supported yet: use the unpadded dispatcher")
    NOT_GROUPED = ("deepep", "does not group the received rows", "the experts' input is not grouped by local expert",
                   "-")
    NOT_UNPERMUTED = ("deepep", "un-permuted", "the rows sent back are not the experts' output in received order", "-")
    READS_RECEIVED_ROWS = ("deepep", "read the received rows other than", "the experts read the received rows "
                           "directly, not only through their expert-major input", "-")
    GROUP_SIZES = ("deepep", "group sizes", "the experts' group sizes are not the received rows per local expert "
                   "(padded, or from elsewhere)", "-")
    NOT_SLOT_SUM = ("deepep", "not the sum of each token's K returned rows", "the combine averages, or weights "
                    "differently than once per slot", "-")
    NO_RESULT = ("deepep", "result computed from the returned rows", "no token-shaped result is a sum of the returned "
                 "rows with one routing-weight tensor (e.g. no routing weights at all)", "-")
    VALUE_ESCAPES = ("deepep", "inside the EP region) is also used by", "a value between the two exchanges is read "
                     "outside the region (logged, stored, returned)", "read it outside the compiled region, or drop it")
    TOO_NARROW = ("deepep", "too narrow", "rows narrower than the digits that identify a token in the checks", "-")
    DYNAMIC_RESULT_SHAPE = ("deepep", "dynamic token count is neither", "a dynamic-shape result shaped neither "
                            "[T, D] nor like x", "-")
    UNSAMPLED_SIZE = ("deepep", "cannot be sampled", "a size with a symbol the checks cannot give a value", "-")
    DEEPEP_BF16 = ("deepep", "DeepEP takes bfloat16", "DeepEP sends bfloat16 tokens only",
                   "bf16 tokens, or `deepep.backend: reference`")
    NO_DYNAMIC_SHAPES = ("deepep", "capture_dynamic_output_shape_ops is off", "the received row count could not be "
                         "traced", "moepass turns it on while it traces its own frames; this frame was traced again "
                         "without it after failing with it on a data-dependent value (the moepass.dynamo_flags log names "
                         "it): torch._check that value, or move that code out of the EP frame")
    WEIGHTS_NOT_SCALING = ("deepep", "do not scale them", "routing weights reach the rows sent without multiplying "
                           "them (or multiply them without reaching them as the checks see it)", "-")
    NOT_IDENTIFIED = ("deepep", "were not identified", "the analysis named no result or routing weights for the "
                      "region", "report it: a bug")
    ANALYSIS_ERROR = ("deepep", "could not analyse the region", "an unexpected error in the analysis",
                      "report it: a bug")
    # ---- the coverage census (moepass.report.coverage): unaccounted, and strict mode fails on it
    OPAQUE_WEIGHT_OP = ("census", "opaque op", "a call moepass cannot look into (a custom op outside torch's own "
                        "libraries, an `allow_in_graph` autograd.Function, a `nonstrict_trace` function, a higher-order "
                        "op without a body) reads a weight of 2 or more dims: a GEMM inside it is unseen (the reason "
                        "names the op and the weight)", "write its GEMMs with torch (`F.linear`, `x @ W`, "
                        "`torch._grouped_mm`), or report the op so that moepass reads it as the GEMM it is (as it "
                        "reads transformers::grouped_mm_fallback)")


@dataclasses.dataclass(frozen=True)
class Reason:
    """Why one node is left alone: its code and the text the report shows."""

    code: SkipCode
    text: str

    def __str__(self) -> str:
        return self.text

    def plus(self, more: str) -> Reason:
        """The same reason with `more` appended to its text."""
        return Reason(self.code, self.text + more)
