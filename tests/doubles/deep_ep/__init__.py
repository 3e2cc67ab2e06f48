"""A test double of DeepEP V1's `deep_ep` package (deepseek-ai/DeepEP@567632d), for CPU ranks over gloo.

Tests only: never installed with moepass; `tests/doubles/__init__.py`'s `deep_ep_double()` puts it on sys.path for
one block. It implements DeepEP's documented semantics, not moepass's, with each property cited where DeepEP states
it (deep_ep/buffer.py, README.md, csrc/): buffer.py (Buffer), layout.py (rows and handles), config.py (Config and the
buffer-size hints). examples/compare_deepep_double.py checks it against the real `deep_ep.Buffer`, output for output.

The API moepass uses, as deep_ep/__init__.py exports it: Buffer, Config, EventOverlap, topk_idx_t.
"""

from .buffer import TOPK_IDX_T as topk_idx_t  # noqa: F401  (deep_ep/__init__.py re-exports deep_ep_cpp's)
from .buffer import Buffer, DeepEPDeviceTrap, EventOverlap  # noqa: F401
from .config import Config, DeepEPHostAssert  # noqa: F401
__version__ = "double of 567632d"
