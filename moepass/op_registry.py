"""What each of moepass's ops does, recorded where the op is defined: the GEMMs (their kind, and which of a layer's
three GEMMs they are) and the expert-parallel exchanges. The engine asks this, not the ops' names.

A leaf (it imports nothing from moepass), so graph predicates ask it without importing the ops: an op absent here
is not moepass's, or was never loaded, and then no graph holds it.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class GemmRole:
    kind: str  # "linear" (y = x @ W.T) or "grouped" (expert GEMMs over token groups)
    gemm: str  # "forward", "dgrad" or "wgrad"


_GEMMS: dict[object, GemmRole] = {}  # OpOverloadPacket -> its role
_EXCHANGES: dict[object, bool] = {}  # OpOverloadPackets that send tokens between ranks -> whether it is the dispatch


def _packet(op):
    """An OpOverload's packet (`moepass.x.default` -> `moepass.x`); a packet as it is."""
    return op.overloadpacket if isinstance(op, torch._ops.OpOverload) else op


def register_gemm(op, kind: str, gemm: str) -> None:
    _GEMMS[_packet(op)] = GemmRole(kind, gemm)


def gemm_role(op) -> GemmRole | None:
    """The role of a moepass GEMM op (OpOverload or packet), or None when `op` is not one."""
    return _GEMMS.get(_packet(op))


def register_exchange(op, dispatch: bool = False) -> None:
    """`dispatch`: the op is the forward dispatch, ep_dispatch(x[T, H], topk_ids[T, K], ...), which sends each token's
    rows to its K experts' ranks."""
    _EXCHANGES[_packet(op)] = dispatch


def is_exchange(op) -> bool:
    """A moepass op that exchanges tokens between ranks (EP dispatch / combine, forward or backward)."""
    return _packet(op) in _EXCHANGES


def is_dispatch(op) -> bool:
    """moepass::ep_dispatch, the exchange whose arguments hold the [T, K] expert ids."""
    return _EXCHANGES.get(_packet(op), False)


@dataclasses.dataclass(frozen=True)
class RowsForm:
    """A grouped forward op's form on rows quantized before their gather or dispatch (ops/lowp/grouped_mm_rows.py)."""

    quantize: object  # OpOverloadPacket: moepass::<recipe>_quantize_rows(x, *settings, kernel) -> (q, scale)
    grouped_mm: object  # OpOverloadPacket: moepass::<recipe>_grouped_mm_rows(x, x_q, x_scale, w_t, offs, ...)
    gemm: object  # OpOverloadPacket: moepass::<recipe>_grouped_mm_on_rows(x_q, x_scale, w_t, offs, ...), without x
    kernels: tuple[str, ...]  # the kernels (the ops' last argument) that have it
    fp8_wgrad_on_rows: bool  # an FP8 wgrad stays FP8 on saved FP8 rows (else it runs BF16 on them: RowGemms says why)
    # OpOverloadPacket: moepass::<recipe>_swiglu_rows(gate, up, *settings, kernel) -> (h, q, scale, saved...), which
    # makes the rows `quantize` makes of silu(gate) * up and keeps gate and up in FP8 (ops/lowp/swiglu_rows.py); None
    swiglu: object = None


_ROWS_FORMS: dict[object, RowsForm] = {}  # grouped forward OpOverloadPacket -> its rows form


def register_rows_form(forward_op, quantize, grouped_mm, gemm, kernels: tuple[str, ...],
                       fp8_wgrad_on_rows: bool, swiglu=None) -> None:
    _ROWS_FORMS[_packet(forward_op)] = RowsForm(_packet(quantize), _packet(grouped_mm), _packet(gemm), kernels,
                                                fp8_wgrad_on_rows, None if swiglu is None else _packet(swiglu))


def rows_form(op) -> RowsForm | None:
    """The rows form of a moepass grouped forward op, or None when its recipe has none."""
    return _ROWS_FORMS.get(_packet(op))


def is_rows_form(op) -> bool:
    """A moepass::<recipe>_grouped_mm_rows (or its GEMM without x): an op that already reads quantized rows."""
    packet = _packet(op)
    return any(packet is form.grouped_mm or packet is form.gemm for form in _ROWS_FORMS.values())


def quantize_rows_form(op) -> RowsForm | None:
    """The rows form whose quantization `op` is (a moepass::<recipe>_quantize_rows), or None."""
    packet = _packet(op)
    return next((form for form in _ROWS_FORMS.values() if packet is form.quantize), None)


def is_quantize_rows(op) -> bool:
    """A moepass::<recipe>_quantize_rows."""
    packet = _packet(op)
    return any(packet is form.quantize for form in _ROWS_FORMS.values())
