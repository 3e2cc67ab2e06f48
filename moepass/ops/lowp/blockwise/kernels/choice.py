"""Which blockwise FP8 implementation can run on a device, and why.

"scaled_mm": torch._scaled_mm with DeepSeek's 1x128 / 128x128 scales (gemm.py): sm_90 only (aten's
  _check_deepseek_support allows its "DeepSeek style" scaling on major 9 alone), torch >= 2.11, a CUDA >= 12.9 build
  (cuBLASLt's blockwise scaling); checked once per device by running it against the emulated GEMM. Grouped GEMMs
  run it once per token group.
"triton": grouped GEMMs as moepass's two Triton kernels (triton_grouped.py: every token group in one launch, no host
  sync), linears on "scaled_mm"; where triton imports, the GPU has FP8 tensor cores, and a one-time check against the
  emulated GEMM passes. "auto" picks it for grouped GEMMs only where "scaled_mm" does not run: measured slower than
  the per-group loop (choose_blockwise_kernel).
"deepgemm": grouped GEMMs through DeepGEMM (torchao 0.18's blockwise grouped kernels; deepgemm.py), on request only,
  when `deep_gemm` is installed and a one-time self-check against the emulated ops passes in a separate process
  (DeepGEMM's HEAD has been seen to segfault at its first grouped kernel: a crash there must not take the training
  job down). "auto" never picks it: see choose_blockwise_kernel for what was measured.
"emulated": the numerics reference anywhere (gemm.emulated_mm_nt).
Elsewhere (CUDA without either) "auto" finds no kernel and the planner keeps the GEMM in BF16 with the reason.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import torch

from moepass.device_arch import CudaDevice, probe

KERNELS = ("emulated", "scaled_mm", "triton", "deepgemm")
EMULATED = ("the same quantization, dequantized operands and an fp32 GEMM; runs on CPU and any CUDA GPU, slower "
            "than BF16")
MIN_TORCH = (2, 11)  # blockwise scales through torch._scaled_mm measured on H200 from torch 2.11
MIN_CUDA = (12, 9)  # cuBLASLt's 1x128 / 128x128 FP32 block scaling
PROBE_MAX_REL_ERROR = 1e-2  # same quantized operands: only fp32 accumulation order and bf16 rounding differ
DEEPGEMM_CHECK_TIMEOUT_S = 600  # DeepGEMM compiles its kernels on first use
DEEPGEMM_CHECK_MODULE = "moepass.ops.lowp.blockwise.kernels.deepgemm_check"
KERNEL_OPTION = "blockwise.kernel"  # the option these reasons name (the recipe's kernel_option)


def check_kernel_name(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}: 'scaled_mm' = torch._scaled_mm with blockwise "
                         "scales (sm_90), 'triton' = moepass's Triton grouped GEMMs, 'deepgemm' = DeepGEMM grouped "
                         "GEMMs, 'emulated' = the reference numerics")


def _version(text: str | None) -> tuple[int, ...]:
    return tuple(int(p) for p in (text or "0").split("+")[0].split(".")[:2] if p.isdigit())


def _no_modes():
    """Real tensors even when called from an op's fake implementation during tracing."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm()).item()


def first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


@functools.cache
def _scaled_mm_problem_on(index: int) -> str | None:
    """None when torch._scaled_mm takes blockwise scales on cuda:<index> and matches the emulated GEMM, else why."""
    if _version(torch.__version__) < MIN_TORCH:
        return f"torch {torch.__version__}: blockwise scales in torch._scaled_mm need torch >= 2.11"
    if _version(torch.version.cuda) < MIN_CUDA:
        return f"torch built with CUDA {torch.version.cuda}: cuBLASLt's blockwise FP8 scaling needs CUDA >= 12.9"
    from .. import quant
    from . import gemm

    with _no_modes(), torch.no_grad():
        gen = torch.Generator(device="cpu").manual_seed(0)
        # M = 200 and K / 128 = 3: the row and K padding gemm.scaled_mm_nt adds for cuBLASLt's alignment, exercised
        a, b = (torch.randn(rows, 384, generator=gen).to(f"cuda:{index}", torch.bfloat16) for rows in (200, 256))
        a_q, a_s = quant.quantize_tiles(a)
        for b_blocks in (True, False):  # the forward / dgrad form, and the wgrad's
            b_q, b_s = quant.quantize_blocks(b) if b_blocks else quant.quantize_tiles(b)
            form = "1x128 x 128x128" if b_blocks else "1x128 x 1x128"
            try:
                got = gemm.scaled_mm_nt(a_q, a_s, b_q, b_s, b_blocks)
            except Exception as e:  # noqa: BLE001  (any refusal means: not on this torch / GPU)
                return f"torch._scaled_mm refused {form} blockwise scales: {first_line(e)}"
            error = relative_error(got, gemm.emulated_mm_nt(a_q, a_s, b_q, b_s, b_blocks))
            if not error <= PROBE_MAX_REL_ERROR:
                return (f"torch._scaled_mm with {form} blockwise scales is off the emulated GEMM by {error:.3g} "
                        f"(relative; allowed {PROBE_MAX_REL_ERROR})")
    return None


def scaled_mm_problem(cuda: CudaDevice) -> str | None:
    if cuda.capability[0] != 9:
        return f"{cuda}: torch._scaled_mm takes blockwise (1x128, 128x128) scales on sm_90 only"
    problem = _scaled_mm_problem_on(cuda.index)
    return f"{cuda}: {problem}" if problem else None


@functools.cache
def _triton_problem_on(index: int) -> str | None:
    """None when moepass's Triton grouped kernels run on cuda:<index> and match the emulated GEMM in both forms
    (an empty group, rows after the last group, a group that is not a whole row tile), else why."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    from .. import quant
    from . import gemm

    with _no_modes(), torch.no_grad():
        gen = torch.Generator(device="cpu").manual_seed(0)
        device = f"cuda:{index}"
        ends = torch.tensor([70, 70, 200], dtype=torch.int32, device=device)
        x = torch.randn(205, 256, generator=gen).to(device, torch.bfloat16)
        w = torch.randn(3, 384, 256, generator=gen).to(device, torch.bfloat16)
        tokens = torch.randn(128 + 256, 640, generator=gen).to(device, torch.bfloat16)  # [N + K, P]: 5 tiles
        padded_ends = torch.tensor([128, 128, 640], dtype=torch.int32, device=device)
        cases = {"M-grouped (forward, dgrad)": (*quant.quantize_tiles(x), *quant.quantize_blocks(w), ends),
                 "K-grouped (wgrad)": (*quant.quantize_tiles(tokens[:128]), *quant.quantize_tiles(tokens[128:]),
                                       padded_ends)}
        for form, args in cases.items():
            try:
                from . import triton_grouped  # a triton that cannot build it fails here: the same verdict

                got = triton_grouped.grouped_mm_nt(*args)
            except Exception as e:  # noqa: BLE001  (a compile or launch failure means: not on this GPU / triton)
                return f"the Triton {form} kernel failed: {first_line(e)}"
            error = relative_error(got, gemm._grouped_mm_nt(*args, "emulated"))
            if not error <= PROBE_MAX_REL_ERROR:
                return (f"the Triton {form} kernel is off the emulated GEMM by {error:.3g} (relative; allowed "
                        f"{PROBE_MAX_REL_ERROR})")
    return None


def triton_problem(cuda: CudaDevice) -> str | None:
    if cuda.capability < (8, 9):
        return f"{cuda}: Triton's FP8 tensor-core dot needs sm_89 or newer"
    problem = _triton_problem_on(cuda.index)
    return f"Triton grouped kernels: {problem}" if problem else None


@functools.cache
def _deepgemm_problem_on(index: int) -> str | None:
    """None when DeepGEMM's grouped kernels run and match the emulated ops on cuda:<index>; else why. The check runs
    in a child process: a crash there is a verdict, not the end of this process."""
    if importlib.util.find_spec("deep_gemm") is None:
        return "deep_gemm is not installed"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": _visible_device(index)}
    try:
        done = subprocess.run([sys.executable, "-m", DEEPGEMM_CHECK_MODULE], env=env, capture_output=True,
                              text=True, timeout=DEEPGEMM_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"DeepGEMM's self-check did not finish in {DEEPGEMM_CHECK_TIMEOUT_S} s"
    if done.returncode == 0:
        return None
    said = (done.stdout.strip() or done.stderr.strip()).splitlines()
    if done.returncode < 0:
        return f"DeepGEMM's self-check died of signal {-done.returncode}" + (f" ({said[-1]})" if said else "")
    return f"DeepGEMM's self-check failed: {said[-1] if said else f'exit code {done.returncode}'}"


def _visible_device(index: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry of this process's cuda:<index> (the child sees it alone, as cuda:0)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return visible.split(",")[index].strip()
    return str(index)


def deepgemm_problem(cuda: CudaDevice) -> str | None:
    problem = _deepgemm_problem_on(cuda.index)
    return f"DeepGEMM: {problem}" if problem else None


def kernel_problem(kernel: str, device: torch.device, grouped: bool) -> str | None:
    """None when `kernel` can run a GEMM (grouped or not) on `device`, else why not."""
    check_kernel_name(kernel)
    if kernel == "emulated":
        return None
    cuda = probe(device, "FP8", "no blockwise FP8 kernel")
    if isinstance(cuda, str):
        return cuda
    if kernel == "scaled_mm":
        return scaled_mm_problem(cuda)
    if not grouped:
        return f"kernel {kernel!r} serves the grouped expert GEMMs only (linears run on scaled_mm)"
    return triton_problem(cuda) if kernel == "triton" else deepgemm_problem(cuda)


def choose_blockwise_kernel(device: torch.device | str, grouped: bool) -> tuple[str | None, str]:
    """(kernel, reason a user can read) for a linear (grouped=False) or grouped GEMM on `device`; kernel None: no
    blockwise FP8 kernel runs here (the GEMM stays BF16). Grouped GEMMs: torch._scaled_mm per token group, else
    moepass's Triton kernels, which made the step slower than the loop (examples/results/blockwise_kernels_671B_h200/).
    DeepGEMM runs only on request (blockwise.kernel='deepgemm'): the build that passes its self-check here (35c4bc8)
    failed in that step (CUDA_ERROR_INVALID_VALUE at a grouped GEMM's launch) and its ops were mostly slower than
    BF16's (examples/results/blockwise_deepgemm_h200/), so picking it unasked would trade a working loop for a crash
    or a slowdown."""
    cuda = probe(torch.device(device), "FP8", "blockwise FP8 numerics emulated (dequantized operands, fp32 GEMM)")
    if isinstance(cuda, str):
        return "emulated", cuda
    no_scaled_mm = scaled_mm_problem(cuda)
    if no_scaled_mm is None:
        if grouped:
            return "scaled_mm", (f"{cuda}: torch._scaled_mm with blockwise scales, one per token group "
                                 f"({KERNEL_OPTION}='triton' runs them in one Triton launch, "
                                 f"{KERNEL_OPTION}='deepgemm' on DeepGEMM; both slower or failing as "
                                 "measured at DeepSeek-V3's dims)")
        return "scaled_mm", f"{cuda}: torch._scaled_mm with DeepSeek's 1x128 / 128x128 scales"
    no_triton = triton_problem(cuda) if grouped else None
    if grouped and no_triton is None:
        return "triton", f"{cuda}: moepass's Triton blockwise grouped GEMMs, self-check passed ({no_scaled_mm})"
    return None, "; ".join(p for p in (no_scaled_mm, no_triton) if p) + \
        f"; {KERNEL_OPTION}='emulated' runs its numerics ({EMULATED})"


def require_kernel(kernel: str, device: torch.device, grouped: bool) -> None:
    """Raise unless `kernel` names a known implementation that can run on `device` (checked on every op call)."""
    check_kernel_name(kernel)
    if kernel == "emulated":
        return
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    problem = kernel_problem(kernel, device, grouped)  # cached per device: a device's answer does not change
    if problem:
        raise RuntimeError(f"kernel={kernel!r} cannot run here: {problem}. Fallback: kernel='emulated' "
                           f"(option {KERNEL_OPTION}='emulated': {EMULATED}).")


def check_settings(device: torch.device, grouped: bool, kernel: str) -> None:
    """The blockwise ops' own arguments (their kernel alone), checked on every call (fake ones too)."""
    require_kernel(kernel, device, grouped=grouped)
