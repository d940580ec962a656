"""The loader: one ``Loader`` type with its run modes (worker processes under a watchdog, threads, in-process, auto),
stage timing and faults.

The package imports every run mode, so ``RunMode.KINDS`` (which ``RunMode.parse`` reads) holds them all whichever
module of the loader a caller imports first.
"""

# In the order a refusal lists the kinds (``RunMode.KINDS`` keeps the order the classes are defined in).
from shards.loader import worker_processes  # noqa: F401, I001
from shards.loader import threads  # noqa: F401
from shards.loader import in_process  # noqa: F401
from shards.loader import auto  # noqa: F401
