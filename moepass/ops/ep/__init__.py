"""moepass's expert-parallel ops: importing this registers them.

dispatch_combine.py: moepass::ep_dispatch / ep_combine (and their backward ops), schemas and autograd, one schema
over two implementations of backend.py's EPBackend, looked up by the name the op carries: deepep.py (DeepEP's Buffer,
CUDA) and reference.py (torch.distributed, any backend);
permute.py: moepass::ep_expert_major_pairs, the received rows in expert-major order.
"""

from . import dispatch_combine, permute  # noqa: F401  (each registers its ops)
