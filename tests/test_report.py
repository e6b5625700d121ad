import json
import os
import shutil
import subprocess
import sys

import pytest

from ragen_pl.report import FIGURES, render_html, report


def fake_run(root, name, success, steps=5):
    run = root / name
    (run / "samples").mkdir(parents=True)
    keys = ["epoch", "step", "rollout/success", "loss/entropy", "filter/reward_std_before", "rollout/response_tokens",
            "actor/grad_norm", "val/Sokoban/success"]
    lines = [",".join(keys)]
    for s in range(steps):
        lines.append(",".join(str(x) for x in [0, s, success(s), 1.0 - 0.1 * s, 0.5, 30 + s, 0.2, ""]))
    lines.append(",".join(str(x) for x in [0, steps - 1, "", "", "", "", "", 0.75]))
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")
    sample = {"step": steps - 1, "env": "Sokoban", "seed": 3, "success": True, "return": 10.6, "failed": None,
              "transcript": [{"role": "env", "observation": "#####\n#P_X#\n#####"},
                             {"role": "model", "text": "<think>push <right></think><answer>Right</answer>",
                              "actions": ["Right"], "reward": 10.9, "format_ok": True},
                             {"role": "env", "observation": "#####\n#_P√#\n#####"}]}
    (run / "samples" / f"step_{steps - 1:06d}.jsonl").write_text(json.dumps(sample) + "\n")
    return run


def test_report_writes_figures_with_each_runs_data(tmp_path):
    ppo = fake_run(tmp_path, "ppo", lambda s: 0.1 * s)
    grpo = fake_run(tmp_path, "grpo", lambda s: 0.05)
    plotted = report([ppo, grpo], tmp_path / "out")
    for name in FIGURES:
        assert (tmp_path / "out" / name).stat().st_size > 5000
    success = plotted["success.png"]
    assert success["ppo: rollout/success"] == [(s, pytest.approx(0.1 * s)) for s in range(5)]
    assert success["grpo: rollout/success"] == [(s, 0.05) for s in range(5)]
    assert success["ppo: val/Sokoban/success"] == [(4, 0.75)]
    assert plotted["response_length.png"]["grpo: rollout/response_tokens"][-1] == (4, 34.0)
    page = (tmp_path / "out" / "trajectories.html").read_text()
    assert "#P_X#" in page and "push &lt;right&gt;" in page and "reward +10.90" in page  # escaped, per turn
    assert "<script" not in page and "http" not in page  # self-contained


def test_report_errors_name_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no metrics.csv in"):
        report([tmp_path], tmp_path / "out")
    out = subprocess.run([sys.executable, "-m", "ragen_pl.cli", "report", str(tmp_path / "missing")],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "is not a folder" in out.stderr


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


# CI (.ci/run) installs Chromium, so there it must run, never skip.
@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="Debian's chromium package is not installed")
def test_viewer_renders_in_headless_chromium(tmp_path):
    run = fake_run(tmp_path, "ppo", lambda s: 0.1 * s)
    report([run], tmp_path / "out")
    shot = tmp_path / "shot.png"
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=900,700",
         (tmp_path / "out" / "trajectories.html").as_uri()],
        check=True, capture_output=True, timeout=120,
    )
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    assert image.size == (900, 700)
    colours = image.getcolors(maxcolors=1_000_000)
    assert colours is not None and len(colours) > 50  # text and boxes were drawn, not a blank page


def test_render_html_without_samples():
    assert "No sampled trajectories" in render_html([], "t")


def test_run_labels_keep_only_the_parts_that_tell_runs_apart(tmp_path):
    from ragen_pl.report import run_names

    runs = [tmp_path / "credit" / r / f"seed{s}" / "version_0" for r in ("gigpo", "grpo") for s in (0, 1)]
    assert run_names(runs) == ["gigpo/seed0", "gigpo/seed1", "grpo/seed0", "grpo/seed1"]
    assert run_names([tmp_path / "a" / "version_0", tmp_path / "a" / "version_1"]) == ["version_0", "version_1"]
    assert run_names([tmp_path / "x" / "version_3"]) == ["version_3"]


def test_the_success_figure_draws_the_random_and_optimal_policy_dashed(tmp_path):
    run = tmp_path / "lake"
    run.mkdir()
    (run / "metrics.csv").write_text("epoch,step,val/FrozenLake/success,val/FrozenLake/random_success,"
                                     "val/FrozenLake/optimal_success\n0,0,0.1,0.2,0.5\n0,10,0.3,0.2,0.5\n")
    success = report([run], tmp_path / "out")["success.png"]
    assert success["val/FrozenLake/random_success"] == [(0, 0.2), (10, 0.2)]
    assert success["val/FrozenLake/optimal_success"] == [(0, 0.5), (10, 0.5)]
    assert success["lake: val/FrozenLake/success"] == [(0, 0.1), (10, 0.3)]
