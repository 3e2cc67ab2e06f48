"""deep_ep.Config and the buffer-size hints, as DeepEP V1 (deepseek-ai/DeepEP@567632d) defines them.

Written from csrc/config.hpp (struct Config: constructor L30, get_nvl_buffer_size_hint L52,
get_rdma_buffer_size_hint L76) and csrc/kernels/configs.cuh (NUM_MAX_NVL_PEERS 8, NUM_MAX_RDMA_PEERS 20).
The numbers are DeepEP's; the code is this double's.
"""

from __future__ import annotations

NUM_MAX_NVL_PEERS = 8  # configs.cuh L3: ranks per NVLink domain; a larger group spans nodes of 8
NUM_MAX_RDMA_PEERS = 20  # configs.cuh L4
NUM_MAX_LOCAL_EXPERTS = 1024  # configs.cuh L6
NUM_BUFFER_ALIGNMENT_BYTES = 128  # configs.cuh L7
SOURCE_META_BYTES = 8  # internode.cu L17 SourceMeta {int src_rdma_rank, is_token_in_nvl_rank_bits}
TOPK_IDX_BYTES = 8  # topk_idx_t is int64 (deep_ep.topk_idx_t, "typically torch.int64": buffer.py get_dispatch_layout)
_MAX_TOPK = 128  # config.hpp L56 kNumMaxTopK
_MAX_SCALES = 128  # config.hpp L57 kNumMaxScales

# Set by the tests to stand for a build without NVSHMEM (setup.py: no NVSHMEM_DIR and no nvidia-nvshmem wheel
# -> -DDISABLE_NVSHMEM), where every RDMA hint and every internode buffer is refused (config.hpp L107,
# deep_ep.cpp L167-168).
NVSHMEM = True


class DeepEPHostAssert(RuntimeError):
    """What pybind11 raises for DeepEP's EP_HOST_ASSERT (an EPException, csrc/kernels/exception.cuh L12)."""


def host_assert(condition: bool, what: str) -> None:
    if not condition:
        raise DeepEPHostAssert(f"Failed: Assertion error {what}")


def _align_up(a: int, b: int) -> int:
    return (a + b - 1) // b * b


class Config:
    """deep_ep.Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv): config.hpp L30-49, pybind defaults
    (20, 6, 256, 6, 256) in deep_ep.cpp L1850-1855."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        host_assert(num_sms >= 0, "num_sms >= 0")
        host_assert(0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, "nvl chunk sizes")
        host_assert(num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0, "rdma chunks")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        # config.hpp L44: the RDMA receive queue is rounded up to whole send chunks
        self.num_max_rdma_chunked_recv_tokens = _align_up(num_max_rdma_chunked_recv_tokens,
                                                          num_max_rdma_chunked_send_tokens)
        host_assert(num_max_rdma_chunked_send_tokens < self.num_max_rdma_chunked_recv_tokens, "rdma chunk sizes")
        host_assert(num_max_rdma_chunked_send_tokens <= self.num_max_rdma_chunked_recv_tokens // 2, "lazy head")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """config.hpp L52-74: per channel and NVLink peer, queues of num_max_nvl_chunked_recv_tokens rows with their
        source meta, up to 128 top-k ids and weights and 128 scales; rounded up to 128 bytes."""
        host_assert(num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0, "num_ranks % 8")
        host_assert(num_ranks <= NUM_MAX_NVL_PEERS or self.num_sms % 2 == 0, "even num_sms")
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = (self.num_sms // 2) * nvl_ranks
        rows = slots * self.num_max_nvl_chunked_recv_tokens
        num_bytes = slots * (2 * rdma_ranks + 3) * 4 + rows * hidden_bytes
        if NVSHMEM:
            num_bytes += rows * SOURCE_META_BYTES  # config.hpp L65-67 (#ifndef DISABLE_NVSHMEM)
        num_bytes += rows * _MAX_TOPK * TOPK_IDX_BYTES + rows * _MAX_TOPK * 4 + rows * _MAX_SCALES * 4
        return _align_up(num_bytes, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """config.hpp L76-107: 0 within a node ("legacy mode"); across nodes, per channel and node, two queues of
        num_max_rdma_chunked_recv_tokens rows with the same extras. Without NVSHMEM it always asserts (L107)."""
        host_assert(NVSHMEM, 'false and "NVSHMEM is disable during compilation"')
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        host_assert(num_ranks % NUM_MAX_NVL_PEERS == 0, "num_ranks % NUM_MAX_NVL_PEERS == 0")
        host_assert(self.num_sms % 2 == 0, "num_sms % 2 == 0")
        slots = (self.num_sms // 2) * (num_ranks // NUM_MAX_NVL_PEERS)
        rows = slots * self.num_max_rdma_chunked_recv_tokens
        num_bytes = slots * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        per_row = (hidden_bytes + SOURCE_META_BYTES + _MAX_TOPK * TOPK_IDX_BYTES + _MAX_TOPK * 4
                   + _MAX_SCALES * 4 + 16)
        num_bytes += rows * per_row * 2
        return _align_up(num_bytes, 128)


# buffer.py get_dispatch_config L233-260 / get_combine_config L263-290: (nvl send, nvl recv, rdma send, rdma recv)
# chunk sizes per group size; any other group size is refused there with an assertion.
DISPATCH_CHUNKS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                   24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                   96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128),
                   160: (28, 720, 12, 128)}
COMBINE_CHUNKS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                  24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                  96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}
