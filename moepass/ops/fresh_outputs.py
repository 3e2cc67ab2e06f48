"""What every moepass op body returns through: outputs the code after the op may view and modify in place.

A custom op's autograd (torch.library's generated autograd.Function) marks an output that is a view as "created
inside a custom Function", and autograd then refuses an in-place change of it ("Output 0 of
GeneratedBackwardFor_moepass_mxfp8_linear_default is a view and is being modified inplace"), as HF Llama4's
`out.add_(...)` after a shared-expert linear does. A GEMM body often returns `y.reshape(...)` or `y[:m]` of its own
result: detached, that is a plain tensor on the same memory, with no copy. The op contract (torch.library's aliasing
rule) also wants no output on an input's memory or another output's: there, rarely (an identity exchange on one rank,
zero tokens), the output is cloned.
"""

from __future__ import annotations

from torch import Tensor


def _tensors(values) -> list[Tensor]:
    """The tensors among an op's arguments or outputs, Tensor[] flattened."""
    found = []
    for v in values:
        if isinstance(v, Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(t for t in v if isinstance(t, Tensor))
    return found


def _storage(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def fresh_outputs(result, inputs: tuple):
    """`result` (a Tensor, or a tuple of Tensors and Tensor lists) with every tensor made an owner of its memory:
    views of the body's own intermediates detached, tensors on an input's or an earlier output's memory cloned."""
    taken = {_storage(t) for t in _tensors(inputs)}

    def fresh(t):
        if not isinstance(t, Tensor):
            return t
        if _storage(t) in taken:
            t = t.clone()
        elif t._is_view():
            t = t.detach()
        taken.add(_storage(t))
        return t

    if isinstance(result, Tensor):
        return fresh(result)
    return tuple([fresh(t) for t in r] if isinstance(r, list) else fresh(r) for r in result)
