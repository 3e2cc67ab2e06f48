"""Importing torchao without the lines its import prints that tell a moepass user nothing.

torchao 0.18 logs each of its CUDA extensions that cannot load ("Failed to load .../torchao/_C_mxfp8...so", whose
wheel builds it for CPython 3.10 only, and "_C_cutlass_90a"; moepass's report says which kernels run instead), and on
torch >= 2.12 its config enums' `register_constant` draws a deprecation warning from torch's pytree logger. Every torchao import in moepass sits inside `torchao_import()`, which drops exactly those records while the
import runs, takes its filter off afterwards, and puts back the warning filters torchao's import changes (it adds one
for NumPy): the user's logging levels, handlers and warning filters stay as they were.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings

# the modules whose import prints one of those lines; once all are loaded, torchao_import() has nothing to drop
PRINTS_ON_IMPORT = ("torchao", "torchao.quantization.quantize_.common.kernel_preference",
                    "torchao.prototype.mx_formats.config", "torchao.prototype.moe_training.config")
LOGGERS = ("torchao", "torch.utils._pytree")  # who logs them


class KnownImportLines(logging.Filter):
    """Drops torchao's extension-load failures and the Enum `register_constant` deprecation; passes the rest."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        extension_not_loaded = message.startswith("Failed to load ") and "torchao" in message and "_C" in message
        enum_deprecation = "register_constant() on Enum subclasses is deprecated" in message
        return not (extension_not_loaded or enum_deprecation)


_FILTER = KnownImportLines()
_inside = False  # a torchao_import() block is running: a nested one leaves the work to it


@contextlib.contextmanager
def torchao_import():
    """Around `from torchao... import ...`: torchao's known import-time lines are dropped inside, nothing after."""
    global _inside
    if _inside or all(name in sys.modules for name in PRINTS_ON_IMPORT):
        yield
        return
    loggers = [logging.getLogger(name) for name in LOGGERS]
    for logger in loggers:
        logger.addFilter(_FILTER)
    _inside = True
    try:
        with warnings.catch_warnings():  # torchao's import adds a warning filter of its own: taken off again
            yield
    finally:
        _inside = False
        for logger in loggers:
            logger.removeFilter(_FILTER)
