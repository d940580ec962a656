"""Where a decoder call stopped decoding and began transforming, per thread: the decoder marks it
(``mark_decoded``), the reader's stage timing (``shards.procs.stage_times``) reads it (``decode_mark``) to split the
call's seconds into decode and transform.

The mark is the calling thread's own, so a decoder shared by a loader's threads (``shards.loader.threads``, or the
decode threads of a worker process) never splits one thread's call at another's mark. No torch here: the image
decoders that mark are imported by packing too.
"""

from __future__ import annotations

import threading
import time

_MARK = threading.local()


def mark_decoded() -> None:
    """Called by a decoder where, inside one call, decoding ended and transforming began."""
    _MARK.at = time.perf_counter()


def decode_mark() -> float | None:
    """This thread's last ``mark_decoded`` time, or None."""
    return getattr(_MARK, "at", None)
