"""Old import path of the fast pipeline, kept for one release: use ``shards.image.fast`` (or ``shards.Normalize``)."""

from shards.image.fast import *  # noqa: F401,F403
from shards.image.fast import __all__  # noqa: F401
