"""TrainConfig in groups, as open_dataset's options are: each group checks its own fields and names them by their
path; config.json holds the groups and reads back exactly, refusing what it does not know; a resume may change the
fields that steer the process, never the ones that change the numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shards.errors import InputError, ManifestError, OutputExistsError
from tests.train.configs import train_config
from train.config import GROUPS, RESUMABLE_CHANGES, TrainConfig
from train.options import CacheOptions, DataOptions, LoaderOptions, ModelOptions, OptimOptions, RunOptions
from train.run.run_dir import RunPlan, plan_run, read_run_config, start_run


@pytest.mark.parametrize("make, fragment", [
    (lambda: DataOptions("d", class_map="merge"), "data.class_map='merge' is not one of same, union"),
    (lambda: DataOptions("d", epoch_size=100), "data.epoch_size applies to weighted sources"),
    (lambda: DataOptions("d", train_split="val"), "data.train_split and data.val_split are both 'val'"),
    (lambda: ModelOptions(head="transformer"), "model.head='transformer' is not one of linear, mlp, logreg"),
    (lambda: ModelOptions(logreg_c=1.0), "model.logreg_c=1.0 is --head logreg's C"),
    (lambda: ModelOptions(dropout=1.0), "model.dropout=1.0 must be in [0, 1)"),
    (lambda: OptimOptions(lr=0.0), "optim.lr=0.0 must be a finite number > 0"),
    (lambda: OptimOptions(lr=float("inf")), "optim.lr=inf must be a finite number > 0"),
    (lambda: OptimOptions(weight_decay=float("inf")), "optim.weight_decay=inf must be a finite number >= 0"),
    (lambda: OptimOptions(batch_size=0), "optim.batch_size=0 must be a positive integer"),
    (lambda: OptimOptions(epochs=2, warmup_epochs=3), "optim.warmup_epochs=3 is longer than optim.epochs=2"),
    (lambda: OptimOptions(class_weighted_loss=True, balanced_sampler=True), "choose one"),
    (lambda: LoaderOptions(workers=-1), "loader.workers=-1 must be a finite number >= 0"),
    (lambda: LoaderOptions(decode="turbo"), "loader.decode='turbo' is not one of standard, fast"),
    (lambda: LoaderOptions(decode="fast", fast_decode=True), "loader.fast_decode applies to decode='standard'"),
    (lambda: CacheOptions(eviction="fifo"), "cache.eviction='fifo' is not one of next-use, lru"),
    (lambda: CacheOptions(limit=-1), "cache.limit=-1 must be a finite number >= 0"),
    (lambda: RunOptions("out", device="tpu"), "run.device='tpu' is not a device: use auto, cpu, cuda"),
    (lambda: RunOptions("out", resume=True, overwrite=True), "run.resume and run.overwrite contradict"),
    (lambda: RunOptions("s3://bucket/run"), "s3://bucket/run"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_each_group_checks_its_own_fields_in_one_line(make, fragment: str):
    with pytest.raises(InputError) as caught:
        make()
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


def test_rules_that_join_two_groups_are_the_configs():
    with pytest.raises(InputError, match=r"optim\.label_smoothing does not apply to model\.head='logreg'"):
        train_config("d", "o", head="logreg", label_smoothing=0.1)
    with pytest.raises(InputError, match=r"cache\.images needs loader\.decode='fast'"):
        train_config("d", "o", images=True, decode="standard")
    with pytest.raises(InputError, match="'optim.learning_rate' is not a TrainConfig field"):
        TrainConfig.of("d", "o", {"optim.learning_rate": 0.1})


def test_defaults_that_follow_another_field_of_the_group_do():
    assert train_config("d", "o", head="logreg").model.standardize is True
    assert train_config("d", "o").model.standardize is False
    assert train_config("d", "o", optimizer="adamw").optim.resolved_lr == 1e-3


def test_config_json_holds_the_groups_and_reads_back_as_the_run(tmp_path: Path):
    cfg = train_config(tmp_path / "data", tmp_path / "run", sources=[{"path": "/a", "weight": 1.0}],
                       subset={"classes": ["ant"]}, epoch_size=50, head="mlp", lr=0.3, workers=2, dir="/scratch",
                       limit=1 << 30, device="cpu", record_keys=True)
    start_run(RunPlan(tmp_path / "run", None), cfg, mixture={"class_map": "same", "sources": []})
    written = json.loads((tmp_path / "run" / "config.json").read_text())
    assert set(written) == {*GROUPS, "mixture"}
    assert written["optim"]["lr"] == 0.3 and written["loader"]["workers"] == 2 and written["cache"]["dir"] == "/scratch"
    recorded = read_run_config(tmp_path / "run" / "config.json")
    assert recorded == cfg and recorded.differences(cfg) == []
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("change, path", [
    (lambda c: c["loader"].update(workerz=2), "loader.workerz is not a field of loader"),
    (lambda c: c.update(optimiser={}), "optimiser is not a group of the run config"),
    (lambda c: c["optim"].update(lr="0.1"), "optim.lr is '0.1': expected a finite number"),
    (lambda c: c.pop("run"), "run is missing"),
], ids=["unknown field", "unknown group", "wrong type", "missing group"])
def test_config_json_refuses_what_it_does_not_know_naming_the_path(tmp_path: Path, change, path: str):
    cfg = train_config(tmp_path / "data", tmp_path / "run")
    start_run(RunPlan(tmp_path / "run", None), cfg)
    file = tmp_path / "run" / "config.json"
    recorded = json.loads(file.read_text())
    change(recorded)
    file.write_text(json.dumps(recorded))
    with pytest.raises(ManifestError) as caught:
        read_run_config(file)
    message = str(caught.value)
    assert str(file) in message and path in message and "\n" not in message


def test_a_resume_may_change_a_steering_field_but_not_a_numbers_field(tmp_path: Path):
    cfg = train_config(tmp_path / "data", tmp_path / "run", workers=2, lr=0.1)
    start_run(RunPlan(tmp_path / "run", None), cfg)
    steering = cfg.replace({"run.resume": True, "loader.workers": 4})
    assert plan_run(steering).folder == tmp_path / "run"  # loader.workers steers the process
    with pytest.raises(OutputExistsError, match=r"differs in optim\.lr\)"):
        plan_run(cfg.replace({"run.resume": True, "optim.lr": 0.2}))
    assert "loader.workers" in RESUMABLE_CHANGES and "optim.lr" not in RESUMABLE_CHANGES


def test_every_resumable_path_names_a_field():
    fields = {f"{group}.{name}" for group, fields in train_config("d", "o").to_dict().items() for name in fields}
    assert RESUMABLE_CHANGES <= fields and len(fields) == 60
