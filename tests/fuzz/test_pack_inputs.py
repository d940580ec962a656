"""Fuzzing what ``pack-shards`` reads: CSV and JSONL image lists, Parquet files (and their Hugging Face schema
metadata), ``datasets.save_to_disk`` folders (Arrow IPC streams and their JSON records), and keys files."""

import pytest

from tests.fuzz.engine import fuzz

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]


@pytest.mark.parametrize("target", ["list_csv", "list_jsonl", "keys_file"])
def test_lists_scan_or_raise_a_shardcache_error(target, seeds):
    fuzz(target, seeds)


@pytest.mark.parametrize("target", ["parquet", "parquet_hf_metadata", "arrow_stream", "arrow_state_json",
                                    "arrow_info_json", "arrow_dict_json"])
def test_tables_pack_or_raise_a_shardcache_error(target, seeds):
    fuzz(target, seeds)
