"""DeepGEMM's one-time self-check, run as `python -m moepass.ops.lowp.blockwise.kernels.deepgemm_check` in a child
process (choice.py): the grouped forward, dgrad and wgrad on cuda:0 through DeepGEMM against the emulated ops on the
same inputs (uneven token groups, an empty one, tokens past the last group). Exit 0 when all match; else the last line
says what failed. A crash (DeepGEMM has segfaulted at its first grouped kernel) ends only this process.
"""

from __future__ import annotations

import sys

import torch

MAX_REL_ERROR = 5e-3  # the same blockwise quantization on both sides; fp32 accumulation order and bf16 rounding


def _inputs(device: str):
    gen = torch.Generator().manual_seed(0)
    sizes, k, n = [200, 0, 77, 300], 256, 384
    m = sum(sizes) + 5  # five tokens past offs[-1]
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    w_t = (torch.randn(len(sizes), n, k, generator=gen) / k**0.5).to(device, torch.bfloat16).transpose(-2, -1)
    grad_out = torch.randn(m, n, generator=gen).to(device, torch.bfloat16)
    return x, w_t, torch.tensor(sizes).cumsum(0).to(device, torch.int32), grad_out


def main() -> int:
    from .. import grouped_mm
    from . import deepgemm
    from .choice import first_line, relative_error

    if not torch.cuda.is_available():
        print("no CUDA device in the self-check's process")
        return 1
    x, w_t, offs, grad_out = _inputs("cuda")
    for name, got, want in (
        ("forward", lambda: deepgemm.forward(x, w_t, offs), lambda: grouped_mm.forward(x, w_t, offs, "emulated")),
        ("dgrad", lambda: deepgemm.dgrad(grad_out, w_t, offs),
         lambda: grouped_mm.dgrad(grad_out, w_t, offs, "emulated")),
        ("wgrad", lambda: deepgemm.wgrad(grad_out, x, offs), lambda: grouped_mm.wgrad(grad_out, x, offs, "emulated")),
    ):
        try:
            out = got()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (any failure is the verdict)
            print(f"{name} raised {type(e).__name__}: {first_line(e)}")
            return 1
        ref = want()
        if out.shape != ref.shape or not torch.isfinite(out).all():
            print(f"{name}: shape {tuple(out.shape)} (want {tuple(ref.shape)}) or non-finite values")
            return 1
        error = relative_error(out, ref)
        if not error <= MAX_REL_ERROR:
            print(f"{name} is off the emulated op by {error:.3g} (relative; allowed {MAX_REL_ERROR})")
            return 1
    print("DeepGEMM grouped forward, dgrad and wgrad match the emulated ops")
    return 0


if __name__ == "__main__":
    sys.exit(main())
