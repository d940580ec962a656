"""The names ``precompute-features`` offers for ``--dtype`` and ``--amp``, without importing torch.

``preprocess.features.config`` maps each to its torch dtype (``DTYPES``, ``AMP_MODES``); the command line
only needs the names, so ``precompute-features --help`` loads no torch (tests/test_cli_vocabulary.py checks the
two lists agree).
"""

from __future__ import annotations

DTYPE_NAMES = ("float16", "float32")
AMP_NAMES = ("bf16", "fp16", "off")
