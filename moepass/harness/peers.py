"""What users would run instead of moepass: torchtitan 0.3.0's low-precision recipes, applied with torchao.

`torchao_fp8` is torchtitan's Hopper recipe (its `deepseek_v3_671b_float8` config): every linear through
`convert_to_float8_training` with the "rowwise" recipe except the router gates and the output head, and the
routed experts' grouped GEMMs through `quantize_(..., Float8TrainingOpConfig)`, with token groups padded to
16 rows by torchao's `permute_and_pad`, as torchtitan's `TorchAOTokenDispatcher` does (torchao 0.18's own
`pad_token_groups_for_grouped_mm` is not supported for FP8: "not yet supported"). As
torchtitan's float8 converter does, the rowwise recipe turns on Inductor's `emulate_precision_casts`.
`torchao_mxfp8` is its Blackwell recipe: torchao's MXFP8 linears and MXFP8 expert GEMMs (RCEIL scales),
token groups padded to 32. Both are then compiled by plain Inductor, as torchtitan compiles them.

The weights become torchao tensor subclasses, so AdamW is forced to `fused=True` (torch otherwise falls back to
a per-parameter loop for every parameter once one is a subclass); bench and converge use it on CUDA for all,
as torchtitan does by default (`train.adamw`).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..device_arch import probe
from ..torchao_import import torchao_import

# torchtitan's deepseek_v3 float8 config: filter_fqns=["lm_head", "router.gate"]; this model calls its head "output"
KEEP_BF16 = ("lm_head", "output", "router.gate")
# least compute capability each needs: FP8 grouped GEMMs (torch._scaled_grouped_mm) need sm_90, MXFP8 sm_100
PEERS = {"torchao_fp8": (9, 0), "torchao_mxfp8": (10, 0)}


def peer_problem(name: str, device: torch.device) -> str | None:
    """Why peer variant `name` cannot run on `device`, or None."""
    need = f"sm_{PEERS[name][0]}{PEERS[name][1]}"
    gpu = probe(device, "FP8", f"{name} needs a CUDA GPU of {need} or newer")
    if isinstance(gpu, str):
        return gpu
    if gpu.capability < PEERS[name]:
        return f"{name} needs {need} or newer; {gpu}"
    try:
        with torchao_import():
            import torchao  # noqa: F401
    except ImportError:
        return f"{name} needs torchao (pip install torchao==0.18.0)"
    return None


def _is_expert_module(module: nn.Module, fqn: str) -> bool:
    """A module holding 3-D expert weights run through torch._grouped_mm (torchtitan: `GroupedExperts`)."""
    params = list(module.parameters(recurse=False))
    return bool(params) and all(p.dim() == 3 for p in params)


def _converts_linear(module: nn.Module, fqn: str) -> bool:
    """torchtitan's float8 module filter: nn.Linear, both dims multiples of 16, not a filtered FQN."""
    return (isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
            and not any(name in fqn for name in KEEP_BF16))


def convert_to_peer(name: str, model: nn.Module) -> dict:
    """Convert `model` in place to peer recipe `name`; returns what was converted (for the bench JSON)."""
    with torchao_import():
        from torchao.quantization.quant_api import quantize_

    linears = [fqn for fqn, m in model.named_modules() if _converts_linear(m, fqn)]
    experts = [fqn for fqn, m in model.named_modules() if _is_expert_module(m, fqn)]
    if name == "torchao_fp8":
        with torchao_import():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            from torchao.prototype.moe_training.config import Float8TrainingOpConfig

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                                   module_filter_fn=_converts_linear)
        quantize_(model, config=Float8TrainingOpConfig(), filter_fn=_is_expert_module)
        for fqn in experts:
            _pad_token_groups(model.get_submodule(fqn), 16)
    elif name == "torchao_mxfp8":
        with torchao_import():
            from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
            from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

        for fqn in linears:  # torchtitan's MXFP8LinearConverter builds MXFP8Linear (an nn.Linear) in their place
            linear = model.get_submodule(fqn)
            linear.__class__ = MXFP8Linear
            linear.kernel_preference, linear.scale_calculation_mode, linear.wgrad_with_hp = _mxfp8_linear_defaults()
        op_config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe("mxfp8_rceil"))
        quantize_(model, config=op_config, filter_fn=_is_expert_module)
        for fqn in experts:
            _pad_token_groups(model.get_submodule(fqn), 32)  # torchtitan's MXFP8 pad_multiple
    else:
        raise ValueError(f"moepass: unknown peer variant {name!r}; known: {sorted(PEERS)}")
    return {"linears": len(linears), "expert_modules": len(experts), "kept_bf16": list(KEEP_BF16)}


def _pad_token_groups(experts: nn.Module, multiple: int) -> None:
    """Run `experts(x, tokens_per_expert)` on token groups padded to `multiple` rows, as torchtitan's
    TorchAOTokenDispatcher does for the quantized grouped GEMMs (EP=1: pad, experts, strip the padding)."""
    params = list(inspect.signature(experts.forward).parameters)
    if len(params) != 2:
        raise ValueError(f"moepass: peer variants pad token groups around experts.forward(x, tokens_per_expert); "
                         f"{type(experts).__name__}.forward takes {params}")
    inner = experts.forward

    def forward(x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        with torchao_import():
            from torchao.prototype.moe_training.ep.permute import permute_and_pad

        shape, padded, indices, padded_counts, _ = permute_and_pad(
            x, tokens_per_expert, 1, tokens_per_expert.shape[0], multiple)
        out = inner(padded, padded_counts)
        unpadded = out.new_empty(shape)  # torchtitan's _unpermute: scatter back, drop the sentinel row
        unpadded[indices, :] = out
        return unpadded[:-1]

    experts.forward = forward


def _mxfp8_linear_defaults() -> tuple:
    """MXFP8Linear's constructor defaults: AUTO kernels, RCEIL scales, MXFP8 weight gradient."""
    with torchao_import():
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    return KernelPreference.AUTO, ScaleCalculationMode.RCEIL, False


def inductor_options(name: str) -> dict | None:
    """Inductor config torchtitan sets for the recipe (pytorch/pytorch#150859 for rowwise FP8), as torch.compile's
    options=."""
    return {"emulate_precision_casts": True} if name == "torchao_fp8" else None
