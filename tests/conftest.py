import sys
from pathlib import Path

import pytest

# Make ``tests.helpers`` importable however pytest is invoked.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.quick_limit import QuickLimit, add_option, is_quick_loop  # noqa: E402  (needs the path above)


def pytest_addoption(parser):
    add_option(parser)


def pytest_configure(config):
    # The quick loop's half-second rule (tests/quick_limit.py): -m "not slow" fails on a test over the limit.
    QuickLimit.configure(config)


# The quick loop (``scripts/test -m "not slow"``, under a minute on 2 cores) leaves out whatever trains, starts a
# server or runs the job scripts: those tests are marked here by what they use, not one by one, so a new test in
# these folders or on these fixtures is classed the same way without anyone remembering to.
SLOW_FOLDERS = {"train": "trains models", "integrations": "trains under Lightning, accelerate and DCP",
                "ops": "runs the job scripts and Slurm"}
SLOW_FIXTURES = {"s3_server": "starts an S3 server", "trained_root": "trains a run to report on"}


def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).resolve().parent
    for item in items:
        try:
            folder = Path(str(item.fspath)).resolve().relative_to(tests).parts[0]
        except ValueError:
            continue
        if folder in SLOW_FOLDERS or SLOW_FIXTURES.keys() & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# Imported once per process before the quick loop's first test, so that its cost lands in a session fixture's setup
# and not in the call phase of whichever test happens to import them first (tests/quick_limit.py times calls only).
QUICK_LOOP_IMPORTS = ("torchvision.transforms.functional", "torchvision.transforms.v2.functional",
                      "torchvision.models", "matplotlib.figure", "matplotlib.backends.backend_agg")


@pytest.fixture(autouse=True, scope="session")
def quick_loop_imports(request):
    import importlib

    if is_quick_loop(request.config.getoption("markexpr", None)):
        for name in QUICK_LOOP_IMPORTS:
            try:
                importlib.import_module(name)
            except ImportError:
                pass  # an extra that is not installed: the tests that need it skip


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """One intra-op thread: the tests' models are tiny, and on a shared 2-core machine spinning thread pools make
    them several times slower (and DataLoader workers compete with them)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
