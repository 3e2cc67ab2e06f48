"""Inductor's `post_grad_custom_post_pass` for moepass graphs: the segment sums, then the compiled-graph audit.

Inductor has one slot for a post-grad pass; moepass puts both there, in that order, so the audit records the graph
Inductor compiles (its moepass.segment_sum_rows count says how many scatter-adds became segment sums).
"""

from __future__ import annotations

import logging

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import segment_sums

log = logging.getLogger(__name__)


class PostGrad(CustomGraphPass):
    def __init__(self, segment_sum_devices: tuple[str, ...] | None, audit: CustomGraphPass):
        # device types whose scatter-adds become segment sums (segment_sums.rewrite): None any, () none
        self.segment_sum_devices = segment_sum_devices
        self.audit = audit

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.segment_sum_devices != ():
            try:
                done = segment_sums.rewrite(graph, self.segment_sum_devices)
            except Exception as e:  # a rewrite is never worth failing a compile over: Inductor's atomic adds remain
                log.warning("moepass: segment sums left out of this graph (%s: %s)", type(e).__name__, e)
            else:
                if done:
                    log.info("scatter-adds of rows as segment sums: %s", ", ".join(done))
        self.audit(graph)

    def uuid(self) -> str:
        devices = self.segment_sum_devices
        return f"{self.audit.uuid()}-segment-sums-{'any' if devices is None else '-'.join(devices) or 'none'}"
