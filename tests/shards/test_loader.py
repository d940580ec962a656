"""make_loader: same samples with any number of workers, lengths right for the rank, epochs reach workers."""

import collections
import time

import pytest
import torch

import shards
from shards.loader.in_process import InProcess
from shards.loader.loader import pad_collate, workers_mode
from shards.loader.worker_processes import WorkerProcesses
from tests.helpers import make_shard_dataset

SIZES = {"train": [7, 5, 9, 3, 1], "val": [4]}


@pytest.fixture(scope="module")
def tar_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tar")
    make_shard_dataset(folder, shard_sizes=SIZES, size=(16, 16))
    return folder


def keys_of(loader):
    return [k for batch in loader for k in batch[2]]


# Four loaders, three of worker processes: the full suite runs it; the quick loop has tests/shards/test_order.py's
# run-mode tests, which check every mode's batches against the order function.
@pytest.mark.parametrize("storage", ["tar", "hdf5"])
@pytest.mark.slow
def test_any_worker_count_yields_the_same_multiset(tmp_path, storage):
    make_shard_dataset(tmp_path, shard_sizes=SIZES, storage=storage, size=(16, 16))
    results = {}
    for workers in (0, 1, 2, 3):
        dataset = shards.open_dataset(tmp_path, transform="eval", return_keys=True, seed=4,
                                      sampling=shards.Sampling(shuffle_buffer=8))
        loader = shards.make_loader(dataset, batch_size=4, mode=workers_mode(workers, persistent=False),
                                    drop_last=False)
        keys = keys_of(loader)
        assert len(keys) == len(dataset) == 25
        assert sum(1 for _ in loader) == len(loader)
        results[workers] = collections.Counter(keys)
    assert all(r == results[0] for r in results.values())
    assert set(results[0]) == {f"train_{i:05d}" for i in range(25)}


@pytest.mark.slow
def test_len_counts_partial_batches_per_worker(tar_folder):
    dataset = shards.open_dataset(tar_folder, return_keys=True, transform="eval")
    for workers, drop_last in ((0, False), (2, False), (3, True), (2, True)):
        loader = shards.make_loader(dataset, batch_size=4, mode=workers_mode(workers, persistent=False),
                                    drop_last=drop_last)
        assert len(list(loader)) == len(loader)


@pytest.mark.slow  # over half a second in the quick loop
def test_set_epoch_reaches_persistent_workers(tar_folder):
    dataset = shards.open_dataset(tar_folder, return_keys=True, transform="eval", seed=1)
    loader = shards.make_loader(dataset, batch_size=5, mode=WorkerProcesses(2), drop_last=False)
    epoch0 = keys_of(loader)
    loader.set_epoch(1)
    epoch1 = keys_of(loader)
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1)

    fresh = shards.open_dataset(tar_folder, return_keys=True, transform="eval", seed=1)
    fresh.set_epoch(1)
    fresh_loader = shards.make_loader(fresh, batch_size=5, mode=WorkerProcesses(2, persistent=False), drop_last=False)
    assert keys_of(fresh_loader) == epoch1


def test_no_shuffle_in_process_is_manifest_order(tar_folder):
    dataset = shards.open_dataset(tar_folder, split="val", return_keys=True, sampling=shards.Sampling(shuffle=False))
    assert [key for _, _, key in dataset] == [f"val_{i:05d}" for i in range(4)]


def test_defaults(tar_folder):
    train = shards.make_loader(shards.open_dataset(tar_folder, transform="eval"), batch_size=2)
    val_set = shards.open_dataset(tar_folder, split="val", sampling=shards.Sampling(shuffle=False))
    val = shards.make_loader(val_set, batch_size=2)
    assert train.drop_last and not val.drop_last
    assert isinstance(train.mode, WorkerProcesses) and train.num_workers == train.mode.workers >= 1
    assert train.run.dataloader.pin_memory == torch.cuda.is_available()


def test_pad_collate_pads_to_the_largest_and_keeps_sizes():
    batch = [(torch.ones(3, 4, 6), 1, "a"), (torch.ones(3, 5, 2), 0, "b")]
    out = pad_collate(batch)
    assert out["images"].shape == (2, 3, 5, 6)
    assert out["sizes"].tolist() == [[4, 6], [5, 2]]
    assert out["mask"][0].sum() == 24 and out["mask"][1].sum() == 10
    assert out["images"][1, :, :, 2:].abs().sum() == 0
    assert out["labels"].tolist() == [1, 0] and out["keys"] == ["a", "b"]


def test_pad_collate_with_pil_images_through_a_loader(tmp_path):
    make_shard_dataset(tmp_path, shard_sizes={"train": [3, 3]}, size=(16, 12))
    dataset = shards.open_dataset(tmp_path, sampling=shards.Sampling(shuffle=False))
    loader = shards.make_loader(dataset, batch_size=3, mode=InProcess(), collate_fn=pad_collate)
    batch = next(iter(loader))
    assert batch["images"].dtype == torch.uint8 and batch["images"].shape == (3, 3, 12, 16)


def _guarded_worker(guard) -> None:
    guard(0)
    time.sleep(30)  # a worker waiting for work that will never come


@pytest.mark.slow
def test_a_worker_whose_loader_process_is_gone_exits_on_its_own():
    # torch's watchdog takes the parent a worker sees when its loop starts; a worker that starts after the loader's
    # process died sees pid 1 and would wait forever. The guard compares with the pid recorded before the fork.
    import multiprocessing

    from shards.loader.worker_processes import OrphanGuard

    gone = multiprocessing.get_context("fork").Process(target=int)
    gone.start()
    gone.join()
    guard = OrphanGuard()
    guard.owner = gone.pid  # as if the loader's process had gone: a pid that has exited
    child = multiprocessing.get_context("fork").Process(target=_guarded_worker, args=(guard,))
    child.start()
    child.join(timeout=10)
    assert child.exitcode == 1
    kept = OrphanGuard()  # the owner still there: the worker lives on
    child = multiprocessing.get_context("fork").Process(target=_guarded_worker, args=(kept,))
    child.start()
    child.join(timeout=2.5)
    assert child.is_alive()
    child.kill()
    child.join()


FORKSERVER_RUN = """
import multiprocessing, sys
sys.path.insert(0, sys.argv[2])
import shards
from shards.loader.worker_processes import WorkerProcesses

def no_decode(sample, seed):
    return 0

if __name__ == "__main__":
    multiprocessing.set_start_method("forkserver")  # what Python 3.14 makes the default on Linux
    dataset = shards.open_dataset(sys.argv[1], "train", return_keys=True, decode=shards.Decode(decoder=no_decode))
    loader = shards.make_loader(dataset, batch_size=4, mode=WorkerProcesses(2, persistent=False), drop_last=False)
    print(sorted(k for batch in loader for k in batch[2]))
"""


@pytest.mark.slow
def test_forkserver_workers_are_not_taken_for_orphans(tmp_path):
    # Under forkserver a worker's parent is the fork server, never the loader's process: the orphan guard must
    # ask whether that process lives, not whether it is the parent (else every worker exits at once).
    import subprocess
    import sys
    from pathlib import Path

    make_shard_dataset(tmp_path / "data", shard_sizes={"train": [6, 5]}, size=(8, 8))
    script = tmp_path / "run.py"
    script.write_text(FORKSERVER_RUN)
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "data"), str(root)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str([f"train_{i:05d}" for i in range(11)])


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.slow
def test_closing_a_loader_left_mid_epoch_stops_its_workers_at_once(tar_folder, persistent):
    import multiprocessing

    before = set(multiprocessing.active_children())  # other tests' processes still being reaped are not ours
    ds = shards.open_dataset(tar_folder, transform="eval", seed=0)
    # batch_size 1 with 1 batch prefetched: each worker has more batches than it may prepare ahead, so both are
    # still running (blocked on the queue) when the first batch arrives, however fast this machine decodes
    with shards.make_loader(ds, batch_size=1, mode=WorkerProcesses(2, prefetch=1,
                                                                   persistent=persistent)) as loader:
        batches = iter(loader)
        next(batches)  # left mid-epoch, the generator still held
        assert len(set(multiprocessing.active_children()) - before) == 2
    assert set(multiprocessing.active_children()) - before == set()
    assert sum(1 for _ in loader) == len(loader)  # iterating again starts afresh
    loader.close()
