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
_EXCHANGES: set[object] = set()  # OpOverloadPackets that send tokens between ranks


def _packet(op):
    """An OpOverload's packet (`moepass.x.default` -> `moepass.x`); a packet as it is."""
    return op.overloadpacket if isinstance(op, torch._ops.OpOverload) else op


def register_gemm(op, kind: str, gemm: str) -> None:
    _GEMMS[_packet(op)] = GemmRole(kind, gemm)


def gemm_role(op) -> GemmRole | None:
    """The role of a moepass GEMM op (OpOverload or packet), or None when `op` is not one."""
    return _GEMMS.get(_packet(op))


def register_exchange(op) -> None:
    _EXCHANGES.add(_packet(op))


def is_exchange(op) -> bool:
    """A moepass op that exchanges tokens between ranks (EP dispatch / combine, forward or backward)."""
    return _packet(op) in _EXCHANGES
