"""What an EP backend is: the exchanges behind moepass::ep_dispatch / ep_combine, one object per implementation.

The ops' schemas carry the backend by name (it travels in the graph); each op body looks the object up by that name
(dispatch_combine.ep_backend) and calls it. Semantics are DeepEP V1 normal mode (dispatch_combine's docstring).
Shapes: N tokens sent, H hidden, K top-k, R rows received, E experts, W ranks; S scales a row. `group` is the
resolved ProcessGroup, `group_name` its name (the key of per-group state, such as DeepEP's buffers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import Tensor


class EPBackend(ABC):
    name: str  # what the ops' `backend` argument says

    @abstractmethod
    def size_carriers(self, group_size: int) -> tuple[int, int]:
        """Where its handle keeps a tensor of N rows (tokens sent) and one of R rows (rows received): the fakes read
        N and R there."""

    @abstractmethod
    def fake_handle(self, x_NH: Tensor, num_recv, group_size: int) -> list[Tensor]:
        """The handle's tensors, sized for tracing: N from x, R = num_recv."""

    def check_rows(self, x_NH: Tensor, group_size: int, num_topk: int) -> None:
        """Raise for BF16 rows it cannot send (called by the fake: fail at compile time, not in a kernel)."""

    def check_fp8_scales(self, x_q_NH: Tensor, x_scale_NS: Tensor) -> None:
        """Raise for FP8 rows' scales it cannot send (ep_dispatch_quantized and its fake)."""

    def check_fp8_rows(self, x_q_NH: Tensor, x_scale_NS: Tensor, group_size: int, num_topk: int) -> None:
        """Raise for FP8 rows it cannot send (ep_dispatch_quantized's fake: fail at compile time)."""

    @abstractmethod
    def dispatch(self, x_NH: Tensor, topk_idx_NK: Tensor, topk_weights_NK: Tensor, num_experts: int,
                 group_name: str, group) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
        """(recv_x [R, H], recv_topk_idx [R, K] local id or -1, recv_topk_weights [R, K], tokens per local expert
        [E/W], handle): each token once to every rank owning one of its experts, in source rank then token order."""

    @abstractmethod
    def dispatch_fp8(self, x_q_NH: Tensor, x_scale_NS: Tensor, topk_idx_NK: Tensor, topk_weights_NK: Tensor,
                     num_experts: int, group_name: str, group
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
        """dispatch of 1-byte rows and their fp32 scales: (recv_x_q [R, H], recv_x_scale [R, S], recv_topk_idx,
        recv_topk_weights, tokens per local expert, handle)."""

    @abstractmethod
    def combine(self, y_RH: Tensor, handle: list[Tensor], group_name: str, group) -> Tensor:
        """[N, H]: each token's received rows sent back and summed in fp32 in rank order, without weights."""

    @abstractmethod
    def dispatch_cached(self, x_NH: Tensor, handle: list[Tensor], group_name: str, group) -> Tensor:
        """[R, H]: rows of x sent with an earlier dispatch's layout (combine's backward)."""

    @abstractmethod
    def dispatch_backward(self, grad_recv_x_RH: Tensor, grad_recv_topk_weights_RK: Tensor, handle: list[Tensor],
                          group_name: str, group) -> tuple[Tensor, Tensor]:
        """(grad_x [N, H], grad_topk_weights [N, K]): both received gradients combined back to their tokens."""

    def __repr__(self) -> str:
        return f"<EP backend {self.name}>"
