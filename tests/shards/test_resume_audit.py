"""The resume audit: a saved state carries the keys of the last batches fed (as the batches held them) and of the
next ones the plan gives; a load recomputes both from the plan and refuses a state that disagrees, naming the batch
and key, and the first batches after the resume are checked too. No false alarm across any layout change the loader
allows; an off-by-one in the position arithmetic, a seed changed behind the loader's back and a shard replaced by
another of the same size are caught at the resume."""

from __future__ import annotations

import base64
import logging
import shutil
import zlib

import numpy as np
import pytest

import shards
from shards.errors import InputError
from shards.loader.loader import workers_mode
from shards.position import cursor as cursor_module
from shards.position import resume as resume_module
from shards.position.audit import AUDIT, AUDIT_BATCHES, ResumeAuditError
from shards.select.mixture import SourceSpec
from tests.helpers import make_shard_dataset
from tests.shards.label_columns import add_label_columns
from tests.shards.stream_helpers import write_feature_dataset

SIZES = {"train": [6, 5, 6, 3, 6, 4, 6]}  # 36 samples; shards 0, 2, 4 and 6 hold 6 each


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("audit")
    make_shard_dataset(out, shard_sizes=SIZES, size=(8, 8))
    add_label_columns(out)
    return out


def open_data(source, *, seed=5, rank=0, world=1, weights=None):
    return shards.open_dataset(source, "train", return_keys=True, seed=seed,
                               decode=shards.Decode(decoder=lambda sample, seed: 0),
                               sampling=shards.Sampling(shuffle_buffer=6, class_weights=weights),
                               distributed=shards.Distributed(rank=rank, world_size=world))


def build(source, workers=2, *, run="threads", batch=4, audit="refuse", **options):
    mode = workers_mode(workers, persistent=False, run=run) if workers else workers_mode(0)
    return shards.make_loader(open_data(source, **options), batch_size=batch, mode=mode, drop_last=False,
                              resume_audit=audit)


def fed_then_saved(loader, batches, epoch=0):
    loader.set_epoch(epoch)
    iterator = iter(loader)
    keys = [list(next(iterator)[2]) for _ in range(batches)]
    state = loader.state_dict()
    del iterator
    return keys, state


def hashes(keys):
    return base64.b64encode(np.asarray([zlib.crc32(k.encode()) for k in keys], dtype="<u4").tobytes()).decode()


@pytest.mark.parametrize("workers,run", [(0, "processes"), (1, "threads"), (3, "threads"),
                                         pytest.param(2, "processes", marks=pytest.mark.slow)])
def test_the_state_carries_the_keys_the_batches_held_and_the_plans_next(folder, workers, run):
    loader = build(folder, workers, run=run)
    fed, state = fed_then_saved(loader, 4)
    record = state[AUDIT]
    assert record["rank"] == 0 and record["through"] == 4
    assert [b["step"] for b in record["fed"]] == [2, 3]
    assert [b["keys"] for b in record["fed"]] == [hashes(keys) for keys in fed[-AUDIT_BATCHES:]]
    assert [b["step"] for b in record["next"]] == [4, 5]
    rest = [list(batch[2]) for batch in _resumed(folder, state, workers, run)]
    assert [b["keys"] for b in record["next"]] == [hashes(keys) for keys in rest[:AUDIT_BATCHES]]


def _resumed(folder, state, workers=2, run="threads", **options):
    loader = build(folder, workers, run=run, **options)
    loader.load_state_dict(state)
    return loader


LAYOUTS = {  # (saved: workers, batch, world), (resumed: workers, batch, world)
    "same": ((2, 4, 1), (2, 4, 1)),
    "more workers": ((1, 4, 1), (3, 4, 1)),
    "fewer workers": ((3, 4, 1), (2, 4, 1)),
    "other batch size": ((2, 4, 1), (2, 3, 1)),
    "more ranks": ((2, 4, 1), (2, 4, 2)),
    "fewer ranks": ((1, 4, 2), (2, 4, 1)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", ["plain", "class weights", "quarantine"])
def test_no_mismatch_across_every_layout_change(folder, layout, variant):
    (workers, batch, world), (new_workers, new_batch, new_world) = LAYOUTS[layout]
    options = {"weights": (1.0, 3.0, 0.5)} if variant == "class weights" else {}
    saver = build(folder, workers, batch=batch, world=world, **options)
    if variant == "quarantine":
        saver.keep_out({int(saver.batch_keys(1, 3)[1]["row"]): "quarantined"})
    _, state = fed_then_saved(saver, 3, epoch=1)
    for rank in range(new_world):
        resumed = build(folder, new_workers, batch=new_batch, world=new_world, rank=rank, **options)
        resumed.load_state_dict(state)
        assert resumed.resume_audit_result() == {"result": "ok", "batches": 2 * AUDIT_BATCHES}
        rest = [list(batch[2]) for batch in resumed]  # the first batches after the resume are checked as fed
        assert rest and resumed.resume_audit_result()["result"] == "ok"
        again = resumed.state_dict()  # at the epoch's end: the last batches fed, nothing next
        assert again[AUDIT]["next"] == [] and len(again[AUDIT]["fed"]) == AUDIT_BATCHES


def test_no_mismatch_with_excluded_rows_added_at_the_resume_and_a_chain_of_layouts(folder):
    _, state = fed_then_saved(build(folder, 2), 3)
    second = build(folder, 3, batch=3)
    second.dataset.exclude_rows(np.array([1, 17, 30]))
    second.load_state_dict(state)
    iterator = iter(second)
    for _ in range(2):
        next(iterator)
    state2 = second.state_dict()
    del iterator
    third = build(folder, 1, batch=5)
    third.dataset.exclude_rows(np.array([1, 17, 30]))
    third.load_state_dict(state2)  # the epoch's earlier layouts are replayed to check what was fed
    assert third.resume_audit_result()["result"] == "ok"
    assert list(third)


def test_no_mismatch_over_a_mixture(folder, tmp_path):
    other = tmp_path / "other"
    make_shard_dataset(other, shard_sizes={"train": [5, 4]}, size=(8, 8))
    sources = [SourceSpec(str(folder), weight=2), SourceSpec(str(other), weight=1)]
    _, state = fed_then_saved(build(sources, 2), 3)
    resumed = build(sources, 3)
    resumed.load_state_dict(state)
    assert resumed.resume_audit_result()["result"] == "ok" and list(resumed)


def test_feature_batches_gathered_in_process_are_audited(tmp_path):
    features = tmp_path / "features"
    write_feature_dataset(features, [20, 13, 7])
    loader = shards.make_loader(shards.open_dataset(features, "train", seed=1, return_keys=True), batch_size=8)
    fed, state = fed_then_saved(loader, 3)
    assert [b["keys"] for b in state[AUDIT]["fed"]] == [hashes(keys) for keys in fed[-AUDIT_BATCHES:]]
    resumed = shards.make_loader(shards.open_dataset(features, "train", seed=1, return_keys=True), batch_size=5)
    resumed.load_state_dict(state)
    assert resumed.resume_audit_result()["result"] == "ok" and list(resumed)
    state["batches"] -= 1  # the position one batch short of what was fed
    with pytest.raises(ResumeAuditError, match=r"epoch 1, batch 3 of the epoch.*handed out 3"):
        shards.make_loader(shards.open_dataset(features, "train", seed=1), batch_size=8).load_state_dict(state)


# -- what the audit catches ------------------------------------------------------------------------------------------
def test_an_off_by_one_in_the_saved_position_is_refused_at_the_load(folder, monkeypatch):
    loader = build(folder, 2)
    iterator = iter(loader)
    for _ in range(4):
        next(iterator)
    real = resume_module.consumed_batches
    monkeypatch.setattr(cursor_module, "consumed_batches", lambda given, handed: real(given, handed) - 1)
    state = loader.state_dict()
    monkeypatch.undo()
    with pytest.raises(ResumeAuditError) as refused:
        build(folder, 2).load_state_dict(state)
    line = str(refused.value)
    assert "\n" not in line and "epoch 1, batch 4 of the epoch" in line and "'train_" in line


def test_an_off_by_one_in_a_workers_skip_is_caught_at_the_first_batch_after_the_resume(folder, monkeypatch):
    _, state = fed_then_saved(build(folder, 2), 3)
    real = resume_module.worker_consumed

    def one_sample_off(samples, position):
        counts, next_worker = real(samples, position)
        return [counts[0] + 1, *counts[1:]], next_worker

    monkeypatch.setattr(resume_module, "worker_consumed", one_sample_off)
    resumed = build(folder, 2)
    resumed.load_state_dict(state)  # the state itself agrees with the plan
    assert resumed.resume_audit_result()["result"] == "ok"
    with pytest.raises(ResumeAuditError, match=r"batch [45] of the epoch, sample \d+: the batch fed after the resume"):
        list(resumed)


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """The same data packed before the column index existed: the plan's keys are read from the shards."""
    out = tmp_path_factory.mktemp("bare")
    make_shard_dataset(out, shard_sizes=SIZES, size=(8, 8))
    return out


@pytest.mark.parametrize("data", ["folder", "bare"])
def test_a_seed_changed_behind_the_loaders_back_is_refused(data, request):
    source = request.getfixturevalue(data)
    _, state = fed_then_saved(build(source, 2), 3)
    same = build(source, 3)
    same.load_state_dict(state)
    assert same.resume_audit_result()["result"] == "ok" and list(same)
    state["seed"] = 6  # so the settings check passes: only the order itself tells
    with pytest.raises(ResumeAuditError, match=r"^resume audit: epoch 1, batch 2 of the epoch, sample \d+: the batch "
                                               r"fed differs from the plan, whose key there is 'train_\d+'$"):
        build(source, 2, seed=6).load_state_dict(state)


def test_a_shard_replaced_by_another_of_the_same_size_is_refused(folder, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(folder, copy)
    loader = build(copy, 2)
    _, state = fed_then_saved(loader, 3)
    touched = loader.batch_keys(0, 3)[0]["shard"]  # a shard the next batch reads
    same_size = next(s.path for s in loader.dataset.split_info.shards if s.samples == 6 and s.path != touched)
    for suffix in ("", ".idx"):
        if (copy / (touched + suffix)).exists():
            shutil.copyfile(copy / (same_size + suffix), copy / (touched + suffix))
    resumed = build(copy, 2)
    resumed.load_state_dict(state)  # the plan's keys come from the column index: as packed
    with pytest.raises(ResumeAuditError, match=r"batch 4 of the epoch, sample \d+: the batch fed after the resume "
                                               r"differs from the plan, whose key there is 'train_\d+'"):
        next(iter(resumed))  # the first batch read from the replaced shard is refused


def test_warn_logs_one_line_and_loads_off_neither_records_nor_checks(folder, caplog):
    _, state = fed_then_saved(build(folder, 2), 3)
    state["seed"] = 6
    warned = build(folder, 2, seed=6, audit="warn")
    with caplog.at_level(logging.WARNING, logger="shards.loader.resume_audit"):
        warned.load_state_dict(state)
    assert [r.getMessage().startswith("resume audit: epoch 1") for r in caplog.records] == [True]
    assert warned.resume_audit_result()["result"] == "mismatch"
    off = build(folder, 2, seed=6, audit="off")
    off.load_state_dict(state)
    assert off.resume_audit_result() == {"result": "off"} and AUDIT not in off.state_dict()
    with pytest.raises(InputError, match="resume_audit='sometimes'"):
        build(folder, 2, audit="sometimes")


def test_a_state_without_a_record_loads_as_not_audited(folder):
    _, state = fed_then_saved(build(folder, 2), 3)
    del state[AUDIT]
    resumed = _resumed(folder, state)
    assert resumed.resume_audit_result()["result"] == "not audited"
    assert list(resumed)  # nothing recorded to check the first batches against but the plan: they are


@pytest.mark.parametrize("change,field", [
    (lambda r: r.update(rank="0"), "audit.rank"),
    (lambda r: r.update(rank=7), "audit.rank is 7"),
    (lambda r: r.update(extra=1), "'extra'"),
    (lambda r: r.pop("through"), "lacks through"),
    (lambda r: r.update(fed=[r["fed"][0]] * 9), "audit.fed"),
    (lambda r: r["fed"][0].update(keys="not base64!"), r"audit.fed\[0\].keys is not base64"),
    (lambda r: r["fed"][0].update(keys=base64.b64encode(b"abcd").decode()), r"audit.fed\[0\].keys holds 1"),
    (lambda r: r["next"][1].update(step=2.5), r"audit.next\[1\].step"),
    (lambda r: r["next"][0].update(size=0), r"audit.next\[0\].size"),
    (lambda r: r["fed"][0].update(keys="A" * 10_000), r"audit.fed\[0\].keys"),
])
def test_a_malformed_record_is_one_error_naming_the_field(folder, change, field):
    _, state = fed_then_saved(build(folder, 2), 3)
    change(state[AUDIT])
    with pytest.raises(InputError, match=field):
        build(folder, 2).load_state_dict(state)
