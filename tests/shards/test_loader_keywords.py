"""``make_loader`` speaks PyTorch (``shards.loader.torch_keywords``): DataLoader's keywords do what they do there or
are refused in one line naming our spelling, in every run mode and dataset kind; unknown keywords are refused by
name with a did-you-mean; nothing is passed on to a place that ignores it."""

from __future__ import annotations

import functools
import inspect
import multiprocessing
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import shards
from shards.errors import InputError
from shards.loader.auto import Auto
from shards.loader.in_process import InProcess
from shards.loader.loader import default_num_workers, make_loader, pad_collate
from shards.loader.threads import Threads
from shards.loader.torch_keywords import OUR_SPELLING
from shards.loader.worker_processes import WorkerProcesses
from tests.helpers import make_shard_dataset
from tests.shards.stream_helpers import write_feature_dataset


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("keywords_images")
    make_shard_dataset(root, shard_sizes={"train": [5, 4]}, size=(20, 16))
    return shards.open_dataset(root, "train", seed=1)  # PIL images: no torchvision to import


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    root = tmp_path_factory.mktemp("keywords_features")
    write_feature_dataset(root, [6, 5])
    return shards.open_dataset(root, "train", seed=1)


def refusal(dataset, **keywords) -> str:
    with pytest.raises(InputError) as raised:
        make_loader(dataset, **keywords)
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_every_dataloader_keyword_is_taken_or_refused_with_our_spelling(images):
    """A keyword a future torch adds fails here until it is mapped or given its refusal."""
    ours = set(inspect.signature(make_loader).parameters)
    for name in list(inspect.signature(DataLoader.__init__).parameters)[2:]:
        assert name in ours or name in OUR_SPELLING, name
    kinds = [p.kind for p in inspect.signature(make_loader).parameters.values()]
    assert kinds.count(inspect.Parameter.VAR_KEYWORD) == 1  # only to refuse by name: nothing passes through


@pytest.mark.parametrize("keyword, value, spelling", [
    ("shuffle", True, "sampling=Sampling(shuffle="),
    ("sampler", None, "sampling=Sampling("),
    ("batch_sampler", None, "sampling=Sampling("),
    ("workers", "auto", "mode= ('auto'"),
    ("in_order", False, "plan's order"),
    ("pin_memory_device", "cuda", "pin_memory=True"),
])
def test_dataloader_keywords_spelled_otherwise_are_refused_naming_ours(images, features, keyword, value, spelling):
    for dataset in (images, features):
        message = refusal(dataset, **{keyword: value})
        assert f"does not take {keyword}=" in message and spelling in message


def test_unknown_keywords_are_refused_by_name_with_a_did_you_mean(images):
    assert "unknown keyword prefetch=: did you mean prefetch_factor=?" in refusal(images, prefetch=2)
    assert "did you mean num_workers=?" in refusal(images, num_worker=2)
    message = refusal(images, zzz=1)
    assert "unknown keyword zzz=" in message and "batch_size" in message and "num_workers" in message


@pytest.mark.parametrize("batch_size", [None, 0, 2.5, True, "8"])
def test_a_batch_size_that_is_not_a_count_is_refused_in_one_line(images, batch_size):
    message = refusal(images, batch_size=batch_size)
    assert "batch_size" in message
    if batch_size is None:
        assert "iterate the dataset itself" in message


def test_num_workers_is_worker_processes_and_zero_in_process(images, features):
    for dataset in (images, features):  # on feature rows too: what was asked, not silently the default
        assert make_loader(dataset, num_workers=2).mode == WorkerProcesses(2)
        assert make_loader(dataset, num_workers=0).mode == InProcess()
    loader = make_loader(images, num_workers=2, prefetch_factor=1, persistent_workers=False)
    assert loader.mode == WorkerProcesses(2, prefetch=1, persistent=False)
    assert make_loader(images, prefetch_factor=2).mode == WorkerProcesses(default_num_workers(), prefetch=2)
    for bad in (-1, 1.5, "2"):
        assert "num_workers must be an integer" in refusal(images, num_workers=bad)


def test_num_workers_beside_a_mode_is_a_conflict(images):
    for mode in ("auto", Threads(2), WorkerProcesses(2)):
        assert "give num_workers or mode, not both" in refusal(images, num_workers=2, mode=mode)


def started(path, worker_id: int) -> None:
    with open(path, "a") as out:
        out.write(f"{worker_id}\n")


def test_num_workers_on_feature_rows_runs_worker_processes_with_their_init(features, tmp_path):
    gathered = make_loader(features, batch_size=4, drop_last=False)
    processes = make_loader(features, batch_size=4, drop_last=False, num_workers=1,
                            worker_init_fn=functools.partial(started, tmp_path / "started"))
    assert sorted(torch.cat([b[0][:, 0] for b in gathered]).tolist()) == \
        sorted(torch.cat([b[0][:, 0] for b in processes]).tolist()) == list(range(11))
    assert (tmp_path / "started").read_text() == "0\n"  # the caller's worker_init_fn ran in the worker


def test_worker_options_a_mode_cannot_honour_are_refused_with_the_reason(images, features):
    assert "(a feature dataset's default) has no workers" in refusal(features, prefetch_factor=2)
    assert "(a feature dataset's default) keeps no worker processes" in refusal(features, persistent_workers=True)
    assert "InProcess() has no workers" in refusal(images, num_workers=0, prefetch_factor=2)
    assert "keeps no worker processes" in refusal(images, mode=Threads(2), persistent_workers=True)
    assert "tries its candidates" in refusal(images, mode="auto", prefetch_factor=2)
    assert "tries its candidates" in refusal(images, mode="auto", persistent_workers=False)
    message = refusal(images, mode=WorkerProcesses(2), prefetch_factor=2)
    assert "carries its own worker options" in message and "WorkerProcesses(..., prefetch=2)" in message
    assert "carries its own" in refusal(images, mode=Threads(2), prefetch_factor=3)
    assert make_loader(features, persistent_workers=False).mode == InProcess()  # true there: nothing persists
    assert make_loader(images, num_workers=2, persistent_workers=True).mode.persistent


def test_worker_init_fn_and_multiprocessing_context_only_where_worker_processes_start(images, features):
    for dataset, extra in ((images, dict(mode=Threads(2))), (images, dict(num_workers=0)), (features, {}),
                           (images, dict(mode="auto"))):
        message = refusal(dataset, worker_init_fn=print, **extra)
        assert "worker_init_fn runs in each DataLoader worker process" in message and "num_workers=n" in message
    assert "may choose threads" in refusal(images, mode=Auto(2), worker_init_fn=print)
    for extra in (dict(mode=Threads(2)), dict(num_workers=0)):
        assert "starts no worker processes" in refusal(images, multiprocessing_context="spawn", **extra)
    loader = make_loader(images, num_workers=1, worker_init_fn=print,
                         multiprocessing_context=multiprocessing.get_context("fork"))
    assert loader.run.dataloader.worker_init_fn.then is print  # behind the orphan guard, which calls it
    assert loader.run.dataloader.multiprocessing_context.get_start_method() == "fork"
    assert make_loader(images, mode="auto", multiprocessing_context="fork").dataloader_options[
        "multiprocessing_context"] == "fork"
    for context in ("spawn", multiprocessing.get_context("forkserver")):  # the shared blocks' locks: fork only
        message = refusal(images, num_workers=1, multiprocessing_context=context)
        assert "start by fork only" in message and "\n" not in message


FORKSERVER_DEFAULT = """
import multiprocessing, sys
from multiprocessing import resource_tracker
multiprocessing.set_start_method("forkserver", force=True)  # Python 3.14's default on Linux
import shards
from shards.loader.loader import make_loader
from shards.procs.values import SharedValues

loader = make_loader(shards.open_dataset(sys.argv[1], "train", seed=1, transform="eval"), batch_size=4,
                     num_workers=2, drop_last=False)
labels = [label.tolist() for _ in range(2) for _, label in loader]
print(loader.run.dataloader.multiprocessing_context.get_start_method(), resource_tracker._resource_tracker._fd,
      SharedValues("q", 1)._array.get_lock()._semlock.name, sum(len(b) for b in labels))
"""


def test_workers_start_by_fork_whatever_the_interpreters_default(tmp_path):
    # Python 3.14 starts processes by forkserver unless told: the workers and the shared blocks would then need
    # named semaphores and the resource tracker, which a whole-job SIGUSR1 kills. The loader names fork itself.
    make_shard_dataset(tmp_path / "ds", shard_sizes={"train": [5, 4]}, size=(20, 16))
    script = tmp_path / "forkserver_default.py"
    script.write_text(FORKSERVER_DEFAULT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "ds")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    method, tracker, semaphore, samples = done.stdout.split()
    assert (method, tracker, semaphore, samples) == ("fork", "None", "None", "18")


def test_generator_seeds_the_dataloader_and_defaults_to_the_dataset_seed(images, features):
    mine = torch.Generator().manual_seed(5)
    assert make_loader(images, num_workers=1, generator=mine).run.dataloader.generator is mine
    default = make_loader(images, num_workers=1).run.dataloader.generator
    assert torch.equal(default.get_state(), torch.Generator().manual_seed(images.config.seed).get_state())
    for dataset, mode in ((images, Threads(1)), (features, None)):  # modes that draw nothing: nothing to refuse
        assert make_loader(dataset, mode=mode, generator=mine).dataloader_options["generator"] is mine


def test_timeout_is_stall_policy_here(images):
    message = refusal(images, timeout=30)
    assert "stall=StallPolicy(timeout_s=30)" in message
    assert make_loader(images, timeout=0).mode == WorkerProcesses(default_num_workers())  # DataLoader's default


def test_collate_fn_works_on_samples_and_is_refused_over_gathered_feature_rows(images, features):
    message = refusal(features, collate_fn=pad_collate)
    assert "gathers each batch of feature rows whole" in message and "num_workers=n" in message
    batch = next(iter(make_loader(images, 3, mode=Threads(1), collate_fn=lambda samples: [s[1] for s in samples])))
    assert isinstance(batch, list) and len(batch) == 3  # the list the collate made, not a default collate


def test_pin_memory_defaults_off_for_gathered_feature_rows_and_is_kept_when_asked(features):
    assert make_loader(features).pin_memory is False
    assert make_loader(features, pin_memory=True).pin_memory is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_gathered_feature_rows_are_pinned_when_asked(features):
    batch = next(iter(make_loader(features, 4, pin_memory=True)))
    assert batch[0].is_pinned() and batch[1].is_pinned()


def test_a_mode_is_read_by_the_one_parse_and_a_misspelt_one_refused(images):
    assert make_loader(images, mode="threads:2").mode == Threads(2)
    assert make_loader(images, mode={"kind": "processes", "workers": 2}).mode == WorkerProcesses(2)
    assert "is not one of processes, threads, in-process, auto" in refusal(images, mode="thread:2")
    assert "decoders= in every run mode" in refusal(images, mode="processes:2,threads=2")
    assert "mode must be a run mode, not a count" in refusal(images, mode=2)


@pytest.mark.parametrize("name", ["pin_memory", "drop_last", "stage_times"])
def test_switches_are_true_or_false_not_anything_truthy(images, name):
    for value in ("no", 0, 1, "False"):
        message = refusal(images, num_workers=0, **{name: value})
        assert message.endswith(f"{name}={value!r}: must be True or False")


@pytest.mark.parametrize("mode", ["in-process", "threads:2"])
def test_a_dataset_of_pil_images_is_refused_at_the_first_batch_with_the_fix(images, mode):
    """What a PyTorch user writes first: no transform. torch's default_collate stopped with a traceback from inside
    a worker; here one line says what to give. A collate_fn that takes PIL images runs."""
    loader = make_loader(images, batch_size=4, mode=None if mode == "in-process" else mode,
                         num_workers=0 if mode == "in-process" else None)
    with pytest.raises(InputError, match=r"the dataset yields PIL images .*transform='eval'.*"
                                         r"collate_fn=shards\.pad_collate") as caught:
        next(iter(loader))
    assert "\n" not in str(caught.value)
    padded = next(iter(make_loader(images, batch_size=4, num_workers=0, collate_fn=pad_collate)))
    assert padded["images"].dtype == torch.uint8 and len(padded["labels"]) == 4
