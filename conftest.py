"""Test setup (tests/ and experiments/tests/): offline, one torch thread per process (2 cores are shared), deterministic."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """The untrained tiny Qwen2 model, built once per test session through save_pretrained."""
    from ragen_pl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tiny(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    return model, tok


def pytest_collection_modifyitems(config, items):
    """GPU tests run with `pytest -m gpu` (tox -e gpu) on a machine with CUDA; elsewhere they say why they skip."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `tox -e gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _tree_state() -> set[str]:
    """``git status`` lines of the checkout (empty outside a git checkout)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=root, capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return set(out.stdout.splitlines()) if out.returncode == 0 else set()


def pytest_sessionstart(session):
    session.config._ragen_tree = _tree_state()


def pytest_sessionfinish(session, exitstatus):
    """Tests and the runs they start never write into the repository (only under tmp folders or `runs/`)."""
    before = getattr(session.config, "_ragen_tree", None)
    if before is None or getattr(session.config, "workerinput", None) is not None:
        return
    new = sorted(_tree_state() - before)
    if new:
        print("\nThe test session wrote into the repository (tests must write under a tmp folder):\n  "
              + "\n  ".join(new))
        session.exitstatus = 1
