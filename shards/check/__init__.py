"""Checks of finished folders: ``shards verify`` (images and features) and ``shards inspect``."""
