"""The loader's memory budget (``shards.loader.budget``): sizes as strings, the default from the memory left
(shared by a node's ranks), the prefetch depth fitted to it, a budget below one batch per worker refused in one
line naming the smallest, and no change to the batches, their order or a resume."""

from __future__ import annotations

import pytest

import shards
from shards.cache.memory_budget import MemoryView
from shards.errors import InputError
from shards.loader.budget import (DECODE_AHEAD_SHARE, READ_AHEAD_SHARE, MemoryBudget, MemoryBudgetError, batch_bytes,
                                  default_budget, fit_depth, read_ahead_within, resolve_budget, split_budget)
from shards.loader.in_process import InProcess
from shards.loader.threads import Threads
from shards.loader.worker_processes import WorkerProcesses
from tests.helpers import make_shard_dataset
from tests.shards.budget_helpers import label_decoder, write_small_dataset

MIB = 1 << 20
BATCH = 4 * (3 * 4 * 4 * 4 + 8 + 11)  # what batch_bytes measures: 4 x (float 3x4x4 image, label, 11-letter key)


def test_sizes_parse_and_nonsense_is_refused():
    assert resolve_budget("512MiB").limit == 512 * MIB and resolve_budget(1000).limit == 1000
    assert resolve_budget(MemoryBudget(5, "x")) == MemoryBudget(5, "x")
    for bad in ("lots", 0, -1):
        with pytest.raises(InputError, match="memory="):
            resolve_budget(bad)


def test_the_default_is_a_quarter_of_what_is_left_shared_by_the_node_ranks():
    view = MemoryView(limit=16 << 30, used=8 << 30, source="the cgroup v2 limit /x/memory.max")
    budget = default_budget(view, ranks=4)
    assert budget.limit == (2 << 30) // 4
    assert "cgroup v2" in budget.source and "4 rank(s)" in budget.source


def test_fit_depth_is_the_deepest_that_fits_and_refuses_below_one_per_worker():
    assert fit_depth(None, 100, 2, 4, 2, "m") == 4
    assert fit_depth(MemoryBudget(10_000), 100, 2, 4, 2, "m") == 4
    assert fit_depth(MemoryBudget(500), 100, 2, 4, 2, "m") == 1
    with pytest.raises(MemoryBudgetError, match=r"smallest that works is .* \(400 bytes\)") as refused:
        fit_depth(MemoryBudget(399), 100, 2, 4, 2, "m")
    assert "\n" not in str(refused.value) and isinstance(refused.value, InputError)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_small_dataset(tmp_path_factory.mktemp("budget"))


def _loader(folder, mode, memory, epoch=0):
    dataset = shards.open_dataset(folder, "train", seed=5, return_keys=True,
                                  decode=shards.Decode(decoder=label_decoder))
    dataset.set_epoch(epoch)
    return shards.make_loader(dataset, 4, mode=mode, memory=memory, drop_last=False)


def _keys(batches):
    return [list(batch[-1]) for batch in batches]


# The smallest budget each mode runs in: one batch per worker plus what the loop and the pinning hold.
SMALLEST = {"processes": (2 + 2) * BATCH, "threads": (2 + 3) * BATCH}
MODES = {"processes": WorkerProcesses(2, persistent=False), "threads": Threads(2)}


@pytest.mark.parametrize("name", ["threads", pytest.param("processes", marks=pytest.mark.slow)])
def test_a_small_budget_feeds_the_same_batches_and_refuses_less(folder, name):
    mode = MODES[name]
    expected = _keys(_loader(folder, mode, None))
    loader = _loader(folder, mode, SMALLEST[name])
    assert _keys(loader) == expected
    depth = loader.run.handoff.prefetch_factor if name == "processes" else loader.run.depth
    assert depth == 1
    with pytest.raises(MemoryBudgetError, match=f"smallest that works is .*{SMALLEST[name]} bytes"):
        list(_loader(folder, mode, SMALLEST[name] - 1))


@pytest.mark.parametrize("name", ["threads", pytest.param("processes", marks=pytest.mark.slow)])
def test_a_small_budget_resumes_exactly(folder, name):
    mode = MODES[name]
    full = _keys(_loader(folder, mode, None, epoch=1))
    first = _loader(folder, mode, SMALLEST[name], epoch=1)
    seen = []
    for batch in first:
        seen.append(list(batch[-1]))
        if len(seen) == 2:
            break
    state = first.state_dict()
    second = _loader(folder, mode, SMALLEST[name], epoch=1)
    second.load_state_dict(state)
    assert seen + _keys(second) == full


def test_the_budget_splits_into_parts_and_the_batches_take_the_rest():
    budget = MemoryBudget(8 * MIB)
    parts = split_budget(budget, sample=MIB // 8, streams=2, ahead=8, read_ahead=MIB, windows=MIB // 2)
    # decode-ahead within its share: 8 samples asked per stream, 1 MiB (1/8 of 8 MiB) allows 4 per stream
    assert DECODE_AHEAD_SHARE == 0.125 and parts.ahead == 4 and parts.decode_ahead == MIB
    assert (parts.read_ahead, parts.windows) == (MIB, MIB // 2)
    assert parts.batches == 8 * MIB - MIB - MIB - MIB // 2 == budget.limit - parts.reserved
    assert split_budget(MemoryBudget(100), sample=1000, streams=4, ahead=6).ahead == 1  # decode threads still overlap
    assert split_budget(budget).batches == budget.limit and split_budget(budget).ahead == 0


def test_what_the_other_parts_hold_is_counted_in_the_smallest_budget():
    assert fit_depth(MemoryBudget(600), 100, 2, 4, 2, "m", reserved=150) == 1
    with pytest.raises(MemoryBudgetError, match=r"beside 100 B read, decoded .*\(500 bytes\)"):
        fit_depth(MemoryBudget(499), 100, 2, 4, 2, "m", reserved=100)


def test_read_ahead_is_the_asked_one_within_its_share_per_process():
    budget = MemoryBudget(64 * MIB)
    assert READ_AHEAD_SHARE == 0.25
    assert read_ahead_within(budget, 4, 64 * MIB) == 4 * MIB  # 16 MiB shared by 4 worker processes
    assert read_ahead_within(budget, 1, MIB) == MIB  # a smaller ask stays


def test_the_default_names_its_source_and_the_ranks_in_the_record():
    view = MemoryView(limit=8 << 30, used=0, source="the cgroup v1 limit /x/memory.limit_in_bytes")
    record = default_budget(view, ranks=2).record(read_ahead_bytes_per_process=5)
    assert record["bytes"] == (2 << 30) // 2 and record["share"] == 0.25 and record["ranks_on_node"] == 2
    assert "cgroup v1" in record["source"] and record["read_ahead_bytes_per_process"] == 5
    assert MemoryBudget(7).record() == {"bytes": 7, "source": "given", "share": None, "ranks_on_node": 1}


def test_a_fixed_size_transform_needs_no_probe_decode(tmp_path, monkeypatch):
    make_shard_dataset(tmp_path, shard_sizes={"train": [3]}, size=(8, 8))
    spec = shards.TransformSpec(preset="eval", size=16)
    standard = shards.open_dataset(tmp_path, "train", transform=spec)
    fast = shards.open_dataset(tmp_path, "train", transform=spec, decode=shards.Decode("fast"), return_keys=True)
    custom = shards.open_dataset(tmp_path, "train", decode=shards.Decode(decoder=label_decoder))
    for dataset in (standard, fast):
        monkeypatch.setattr(dataset, "worker_stream", None)  # a decode here would fail
    assert batch_bytes(standard, 4, 2) == 4 * (3 * 16 * 16 * 4 + 8)  # float32 pixels and the label
    assert batch_bytes(fast, 4, 2) > 4 * (3 * 16 * 16 + 8)  # uint8 pixels, the label and the key
    assert batch_bytes(custom, 4, 2) == 4 * (3 * 4 * 4 * 4 + 8)  # no spec: one sample decoded


def test_decode_ahead_of_the_thread_pool_is_fitted_to_its_part(folder):
    loader = _loader(folder, Threads(2, decoders=4), 4 * MIB)
    assert _keys(loader) == _keys(_loader(folder, Threads(2), None))
    sample = BATCH // 4
    assert loader.run.parts.ahead == 8 and loader.run.parts.decode_ahead == 2 * 8 * sample  # room for all asked
    tight = _loader(folder, Threads(2, decoders=4), 20 * BATCH)
    list(tight)
    assert tight.run.parts.ahead == max(1, int(20 * BATCH * DECODE_AHEAD_SHARE) // (2 * sample)) < 8


def test_feature_windows_and_a_prefetch_thread_are_within_the_budget(tmp_path):
    from tests.train.conftest import write_feature_folder

    data = write_feature_folder(tmp_path, shard_sizes={"train": [40, 30]}, classes=("a", "b"), dim=16)
    row = 16 * 2 + 8  # float16 features and the label
    windowed = shards.open_dataset(data, "train", sampling=shards.Sampling(feature_window=20))
    windows = 2 * 20 * row
    loader = shards.make_loader(windowed, 8, mode=InProcess(), memory=windows + 4 * 8 * row)
    assert loader.prefetch_within_budget(8) == 2  # 4 batches fit beside the windows: 2 queued, 1 trained, 1 held
    assert loader.prefetch_within_budget(1) == 1
    with pytest.raises(MemoryBudgetError, match=f"smallest that works is .*{windows + 3 * 8 * row} bytes"):
        shards.make_loader(windowed, 8, mode=InProcess(), memory=windows + 3 * 8 * row - 1)


def test_the_smallest_budget_named_is_one_that_works_with_decode_threads(folder):
    mode = Threads(2, decoders=4)
    with pytest.raises(MemoryBudgetError, match=r"\((\d+) bytes\)") as refused:
        list(_loader(folder, mode, 1))
    smallest = int(str(refused.value).rsplit("(", 1)[1].split()[0])
    loader = _loader(folder, mode, smallest)
    assert _keys(loader) == _keys(_loader(folder, Threads(2), None)) and loader.run.parts.ahead == 1


def test_the_smallest_budget_changes_no_feature_batch_or_resume_in_process(tmp_path):
    from tests.shards.budget_helpers import smallest_budget
    from tests.train.conftest import write_feature_folder

    data = write_feature_folder(tmp_path, shard_sizes={"train": [40, 30]}, classes=("a", "b"), dim=16)

    def make(memory):
        dataset = shards.open_dataset(data, "train", seed=3, return_keys=True,
                                      sampling=shards.Sampling(feature_window=20))
        return shards.make_loader(dataset, 8, mode=InProcess(), memory=memory)

    smallest = smallest_budget(make)
    full = _keys(make(None))
    assert smallest > 1 and _keys(make(smallest)) == full
    first = make(smallest)
    batches = iter(first)
    head = [list(next(batches)[-1]) for _ in range(3)]
    second = make(smallest)
    second.load_state_dict(first.state_dict())
    assert head + _keys(second) == full
