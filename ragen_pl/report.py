"""``ragen-pl report RUN_DIR [RUN_DIR ...]``: the paper's training curves as PNGs, and a trajectory viewer as HTML.

A run folder is what the CSV logger writes (``metrics.csv``) plus the ``samples/`` JSONL files of
:class:`~ragen_pl.callbacks.TrajectorySamples`. Several runs are overlaid in every figure (PPO against GRPO, one
filter ratio against another). The HTML viewer is one self-contained file: no scripts or styles are fetched.
"""

from __future__ import annotations

import csv
import html
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from ragen_pl.runs import run_chain

#: figure file -> (title, y label, metric keys tried in order; a key ending in "/*/success" matches every env)
FIGURES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "success.png": ("Success rate", "success", ("rollout/success", "val/*/success")),
    "entropy.png": ("Token entropy", "entropy", ("loss/entropy",)),
    "reward_std.png": ("In-group reward std (before filtering)", "std", ("filter/reward_std_before",)),
    "response_length.png": ("Response length", "tokens per trajectory", ("rollout/response_tokens",)),
    "grad_norm.png": ("Actor gradient norm", "norm", ("actor/grad_norm",)),
    "reasoning.png": ("Thinking that names the answered actions", "share of turns",
                      ("rollout/think_answer_agreement", "rollout/*/think_answer_agreement")),
    "think_length.png": ("Thinking length", "words per turn", ("rollout/think_words", "rollout/*/think_words")),
    "collapse_mi.png": ("Input dependence of the reasoning, I(X;Z) (RAGEN-2)", "nats per token", ("collapse/mi",)),
    "collapse_entropy.png": ("Within-input entropy of the reasoning, H(Z|X)", "nats per token",
                             ("collapse/conditional_entropy",)),
    "mismatch.png": ("Sampler vs trainer log-probs (mean |difference|)", "nats", ("mismatch/logprob_abs_diff_mean",)),
}

#: figure file -> reference metrics drawn dashed beside its curves (the random and the optimal policy)
REFERENCES: dict[str, tuple[str, ...]] = {"success.png": ("val/*/random_success", "val/*/optimal_success")}


def find_metrics(run: Path) -> Path:
    """The run's metrics.csv: the folder's own, or the newest one below it."""
    if (run / "metrics.csv").is_file():
        return run / "metrics.csv"
    found = sorted(run.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no metrics.csv in {run} (point `ragen-pl report` at a CSV logger's run folder)")
    return found[-1]


def read_series(path: Path) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(step, value)] from a Lightning CSV log (rows hold the metrics logged at that step)."""
    series: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if step in (None, ""):
                continue
            for key, value in row.items():
                if key in ("step", "epoch") or value in (None, ""):
                    continue
                try:
                    v = float(value)
                except ValueError:
                    continue
                if math.isfinite(v):
                    series.setdefault(key, []).append((int(float(step)), v))
    return series


def _matching(series: dict[str, list], pattern: str) -> list[str]:
    if "*" not in pattern:
        return [pattern] if pattern in series else []
    head, tail = pattern.split("*", 1)
    return sorted(k for k in series if k.startswith(head) and k.endswith(tail) and k.count("/") == pattern.count("/"))


def plot_runs(runs: dict[str, dict[str, list[tuple[int, float]]]], out: Path) -> dict[str, dict[str, list]]:
    """Write one PNG per figure with every run overlaid; return what was plotted: {figure: {label: points}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    plotted: dict[str, dict[str, list]] = {}
    for filename, (title, ylabel, patterns) in FIGURES.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        lines: dict[str, list] = {}
        for run, series in runs.items():
            for pattern in patterns:
                for key in _matching(series, pattern):
                    points = sorted(series[key])
                    label = f"{run}: {key}" if len(runs) > 1 or len(patterns) > 1 else run
                    ax.plot([s for s, _ in points], [v for _, v in points], marker="o" if len(points) < 30 else None,
                            markersize=3, label=label)
                    lines[label] = points
            for pattern, style in zip(REFERENCES.get(filename, ()), ("--", ":")):
                for key in _matching(series, pattern):
                    points = sorted(series[key])
                    label = f"{run}: {key}" if len(runs) > 1 else key
                    ax.plot([s for s, _ in points], [v for _, v in points], linestyle=style, linewidth=1.2,
                            label=label)
                    lines[label] = points
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(lines) > 8:  # many runs: the legend beside the plot, not over it
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        elif lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110, bbox_inches="tight")
        plt.close(fig)
        plotted[filename] = lines
    return plotted


def read_samples(run: Path) -> list[dict]:
    """Every sample row of a run. A cut-off last line (a run killed while writing) is skipped with a warning;
    a bad line elsewhere is an error naming the file and line."""
    rows = []
    for path in sorted(run.rglob("samples/step_*.jsonl")):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                if number == len(lines):
                    print(f"warning: skipping the truncated last line {number} of {path}", file=sys.stderr)
                    continue
                raise ValueError(f"{path}:{number}: not a JSON sample row ({err.msg})") from err
    return rows


def read_run(run: Path) -> tuple[dict[str, list[tuple[int, float]]], list[dict]]:
    """Metrics and samples of a run; a resumed run includes the runs it continues (their steps before its own)."""
    series: dict[str, list[tuple[int, float]]] = {}
    samples: list[dict] = []
    chain = run_chain(run)
    parts = [read_series(find_metrics(folder)) for folder in chain]
    firsts = [min((step for points in part.values() for step, _ in points), default=math.inf) for part in parts]
    for i, (folder, part) in enumerate(zip(chain, parts)):
        cutoff = min(firsts[i + 1:], default=math.inf)  # a later part of the run takes over from its first step
        for key, points in part.items():
            series.setdefault(key, []).extend(p for p in points if p[0] < cutoff)
        samples.extend(s for s in read_samples(folder) if s.get("step", 0) < cutoff)
    return series, samples


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;background:#fafafa;color:#222}
h1{font-size:1.4em} h2{font-size:1.1em;margin-top:2em}
.traj{background:#fff;border:1px solid #ddd;border-radius:6px;padding:.8em 1em;margin:1em 0}
.ok{border-left:6px solid #2a9d3f} .fail{border-left:6px solid #c0392b}
pre.grid{font-family:ui-monospace,monospace;font-size:15px;line-height:1.15;background:#f0f3f7;padding:.4em .6em;
 display:inline-block;margin:.3em 0}
.turn{margin:.4em 0 .4em 1em} .think{color:#555;font-style:italic} .answer{font-weight:600}
.meta{color:#666;font-size:.9em} .reward{font-family:ui-monospace,monospace}
"""


def render_html(samples: list[dict], title: str) -> str:
    """A self-contained page: per sampled trajectory, each state grid, the model's think and answer, rewards."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    if not samples:
        parts.append("<p>No sampled trajectories in these runs (they are written at each validation).</p>")
    last_header = None
    for s in samples:
        header = (s.get("run", ""), s.get("step"), s.get("env"))
        if header != last_header:
            parts.append(f"<h2>{html.escape(str(header[0]))} step {header[1]}: {html.escape(str(header[2]))}</h2>")
            last_header = header
        cls = "ok" if s.get("success") else "fail"
        parts.append(f"<div class='traj {cls}'><div class='meta'>seed {s.get('seed')} · return "
                     f"{s.get('return', 0):+.2f} · {'success' if s.get('success') else 'no success'}"
                     f"{' · failed: ' + html.escape(str(s['failed'])) if s.get('failed') else ''}</div>")
        for t in s.get("transcript", []):
            if t.get("role") == "env":
                parts.append(f"<pre class='grid'>{html.escape(str(t.get('observation', '')))}</pre>")
            else:
                text = str(t.get("text", ""))
                think, _, answer = text.partition("</think>")
                parts.append(
                    "<div class='turn'>"
                    f"<div class='think'>{html.escape(think.replace('<think>', ''))}</div>"
                    f"<div class='answer'>{html.escape(answer or '')}</div>"
                    f"<div class='meta'>actions: {html.escape(', '.join(t.get('actions', [])) or '(none)')} · "
                    f"<span class='reward'>reward {t.get('reward', 0):+.2f}</span>"
                    f"{'' if t.get('format_ok', True) else ' · format penalty'}</div></div>"
                )
        parts.append("</div>")
    parts.append("</body></html>")
    return "".join(parts)


def run_names(run_dirs: Sequence[str | Path]) -> list[str]:
    """Short labels that tell the runs apart: the parts of their paths left once the parts all share at the start
    and at the end are dropped (``runs/credit/gigpo/seed0/version_0`` beside ``.../grpo/seed0/version_0`` is
    ``gigpo/seed0``); one run is its folder's name."""
    parts = [Path(r).resolve().parts for r in run_dirs]
    if len(parts) == 1:
        return [parts[0][-1] if parts[0] else str(run_dirs[0])]
    shortest = min(len(p) for p in parts)
    lead = next((i for i in range(shortest) if len({p[i] for p in parts}) > 1), shortest)
    trail = next((i for i in range(shortest - lead) if len({p[-1 - i] for p in parts}) > 1), shortest - lead)
    names = ["/".join(p[lead:len(p) - trail]) or p[-1] for p in parts]
    return names if len(set(names)) == len(names) else [str(r) for r in run_dirs]


def report(run_dirs: list[str | Path], out: str | Path) -> dict[str, dict[str, list]]:
    """Write the figures and ``trajectories.html`` for the runs into ``out``; return what was plotted."""
    out = Path(out)
    runs, samples = {}, []
    names = run_names(run_dirs)
    for name, run in zip(names, run_dirs):
        run = Path(run)
        if not run.is_dir():
            raise FileNotFoundError(f"RUN_DIR {run} is not a folder")
        runs[name], run_samples = read_run(run)
        samples.extend({"run": name, **s} for s in run_samples)
    plotted = plot_runs(runs, out)
    (out / "trajectories.html").write_text(render_html(samples, f"ragen-pl trajectories: {', '.join(names)}"))
    return plotted
