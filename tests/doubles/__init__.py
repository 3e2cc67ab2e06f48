"""Test doubles of optional native libraries. Nothing here is installed with moepass, and nothing is importable by
its own name until a test asks: `deep_ep_double()` puts tests/doubles on sys.path for one block."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

DOUBLES = os.path.dirname(os.path.abspath(__file__))


@contextlib.contextmanager
def deep_ep_double(nvshmem: bool = True, num_sms: int | None = None):
    """`import deep_ep` gives the double inside the block, and moepass's DeepEP code runs on CPU tensors through it.

    nvshmem=False stands for a DeepEP built without NVSHMEM; num_sms sets Buffer.num_sms (channels = num_sms / 2).
    On exit moepass's buffers are released (collective: every rank leaves the block together) and `deep_ep` and the
    device types are put back."""
    from moepass.ops.ep import deepep

    saved_modules = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "deep_ep"}
    saved_devices = deepep.DEVICE_TYPES
    sys.path.insert(0, DOUBLES)
    importlib.invalidate_caches()
    deepep._import_deep_ep.cache_clear()
    deepep.DEVICE_TYPES = (*saved_devices, "cpu")
    try:
        import deep_ep
        from deep_ep import config

        config.NVSHMEM = nvshmem
        if num_sms is not None:
            deep_ep.Buffer.set_num_sms(num_sms)
        yield deep_ep
    finally:
        try:
            deepep.release_deepep_buffers()
        finally:
            sys.path.remove(DOUBLES)
            for name in [n for n in sys.modules if n.split(".")[0] == "deep_ep"]:
                del sys.modules[name]
            sys.modules.update(saved_modules)
            deepep.DEVICE_TYPES = saved_devices
            deepep._import_deep_ep.cache_clear()


def with_deep_ep_double(rank, world_size, check, *args, nvshmem: bool = True, num_sms: int | None = None):
    """A rank check run inside deep_ep_double(): `rank_pool(w).run(with_deep_ep_double, check, *args)`."""
    with deep_ep_double(nvshmem=nvshmem, num_sms=num_sms):
        check(rank, world_size, *args)
