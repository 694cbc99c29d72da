import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # the workers (`make test` runs two) share the cores: one OpenMP thread each, set before torch
    # loads (threads of two processes busy-waiting on the same cores slow both many times over);
    # the subprocesses the tests start inherit it
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# the native pool in two groups (virtual on a one-node machine), so the NUMA split + reduce path
# of the native operator runs in every test that uses it
os.environ.setdefault("KTFLOW_NUMA_GROUPS", "2")
# every executed step's values checked for NaN and infinity (the first node that made one is named)
os.environ.setdefault("KTFLOW_CHECK_FINITE", "1")
# temporary files (a failed pass's input dump, ...) and packed experts go to a folder of this
# session's own, removed at its end: the tests leave nothing in the system's temp dir or the user's cache
_SESSION = tempfile.mkdtemp(prefix="ktflow-tests-")
atexit.register(shutil.rmtree, _SESSION, True)
os.environ["TMPDIR"] = tempfile.tempdir = _SESSION
os.environ.setdefault("KTFLOW_CACHE_DIR", os.path.join(_SESSION, "packed"))

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The demo checkpoint (small DeepSeek-V3 shape, bf16), written once per test session."""
    from ktflow.tools.demo import ensure_demo_checkpoint

    d, _ = ensure_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt")
    return d


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Tiny HF checkpoints by case name, made on first use (needs transformers)."""
    pytest.importorskip("transformers")
    import hf_tiny

    made = {}

    def get(case: str):
        if case not in made:
            d = tmp_path_factory.mktemp(case)
            made[case] = (d, hf_tiny.make(case, d))
        return made[case]

    return get
