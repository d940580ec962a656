"""Fuzzing saved state and shared folders: a loader's ``state_dict`` (``load_state_dict``, DCP's JSON string),
the node cache's plans, reservations, stamps and lock files as other jobs leave them, and ``where`` filters."""

import pytest

from tests.fuzz.engine import fuzz

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]


@pytest.mark.parametrize("target", ["loader_state", "dcp_state"])
def test_loader_states_load_or_raise_a_shardcache_error(target, seeds):
    fuzz(target, seeds)


@pytest.mark.parametrize("target", ["cache_plan", "cache_reservation", "cache_stamp", "cache_file_kinds"])
def test_node_cache_folders_are_used_or_raise_a_shardcache_error(target, seeds):
    fuzz(target, seeds)


def test_where_filters_compile_and_select_or_raise_a_shardcache_error(seeds):
    fuzz("where", seeds)
