"""The Echo Trap alarm judged on runs: its delay on recorded collapses, and its false alarms where nothing collapses.

Three sets of runs, replayed through ``ragen_pl.callbacks.EchoTrapAlarm`` step by step:

* tuning: the quickstart runs its defaults were chosen on (``tests/data/echo_trap/{grpo,ppo}_seed{0-4}.csv``,
  20 iterations, warm starts of seeds 0-4);
* held-out: runs it never saw (``tests/data/echo_trap/heldout/``: the quickstart over seeds 5-9 for 30
  iterations, GRPO and PPO, from ``benchmarks/learning_seeds.py --keep``; SmolLM2 Sokoban from
  ``benchmarks/real_llm.py``; the collapse grid's runs at seeds 9-11, ``tests/data/collapse_grid/``), plus any
  ``metrics.csv`` given with ``--runs``;
* simulated runs with no learning: success stationary at 0.05-0.8 (64 episodes a step in groups of 8, the
  quickstart's share of one env), answers drawn from a fixed distribution, entropy and gradient norm stationary
  noise, 100 steps; either one board for all (the quickstart's Bandit and corner FrozenLake) or a board per group
  whose success rate is drawn around the level (``--icc``: RAGEN's random boards, easy or hard for all of a group's
  trajectories), the latter also with the episodes counted as independent (the alarm before
  ``rollout/<tag>/effective_episodes``). Any alarm there is false.

An env *collapsed* at the first step from which its success stays below half its best so far for 3 steps (judged
with hindsight; the best is a trailing 3-step mean of at least 0.1). The delay is the alarm's step minus that step
(negative: the alarm came before the halving). Runs recorded before ``rollout/<tag>/episodes`` was logged get the
quickstart's 64 episodes per env and step.

Could a signal not tied to success warn first? For each of the alarm's co-signals (entropy, gradient spike, I(X;Z),
repetition; its own thresholds, success not consulted) a second table counts the collapses it held in within
``HORIZON`` steps up to the halving, with how many steps before the halving it first did, beside how often it held
in env runs where nothing halved and the share of 6-step windows it would hold in by chance at that rate.

The alarm's early warning (updates without reward variance under PPO's whitened GAE, ``no_signal_steps`` in a
row while some env succeeds at least 0.5) gets a third table on the PPO runs: where it came, and how many steps
before the first halving of any env; its thresholds were chosen on the held-out PPO runs at lr 3e-3 without the
filter (seeds 3-8, ``EARLY_TUNING``), so those are its tuning runs, and the rest are its held-out ones: seeds 9-11 of
the same setting, and of it with groups without reward variance dropped (``dropzero``) and with the advantages not
whitened (``notwhitened``, listed only: the live warning is off there), from ``benchmarks/findings.py --grid
collapse``. The simulated runs also print how often it would come there.

    python benchmarks/echo_trap.py [--runs PATH ...] [--simulated 200] [--steps 100] [--icc 0.3]
"""

from __future__ import annotations

import argparse
import csv
import math
import random
from pathlib import Path
from typing import NamedTuple

from ragen_pl.echo_trap import EchoTrapAlarm
from ragen_pl.metrics import effective_episodes

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "echo_trap"
GRID = DATA.parent / "collapse_grid"
"""The collapse grid's filter, KL and clipping runs (``benchmarks/findings.py --grid collapse``, seeds 9-11): held out."""
LEVELS = (0.05, 0.15, 0.3, 0.5, 0.8)
LASTING = 10
"""Steps a collapse must stay down, to the run's end, to count as lasting (``halving(..., to_end=True)``)."""


def load(path: Path, episodes: float = 64.0) -> list[dict[str, float]]:
    """One run's metrics, a dict per step (rows of the same step merged), with ``episodes`` filled in if absent."""
    steps: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            if row.get("step", "") == "":
                continue
            merged = steps.setdefault(int(float(row["step"])), {})
            merged.update({k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"})
    out = []
    for step in sorted(steps):
        m = steps[step]
        if not any(k.startswith("rollout/") and k.endswith("/success") for k in m):
            continue  # an evaluation-only row
        for key in [k for k in m if k.startswith("rollout/") and k.endswith("/success")]:
            m.setdefault(key[: -len("success")] + "episodes", episodes)
        out.append(m)
    return out


def env_tags(run: list[dict[str, float]]) -> list[str]:
    tags = sorted({k.split("/")[1] for m in run for k in m if k.startswith("rollout/") and k.count("/") == 2
                   and k.endswith("/success")})
    return tags or [""]


def env_successes(run: list[dict[str, float]]) -> list[tuple[str, list[float]]]:
    """(env tag, its training success per step) for each env of the run."""
    keys = {tag: f"rollout/{tag}/success" if tag else "rollout/success" for tag in env_tags(run)}
    return [(tag, [m[key] for m in run if key in m]) for tag, key in keys.items()]


def halving(successes: list[float], min_peak: float = 0.1, to_end: bool = False) -> int | None:
    """The first step from which an env's success stays below half its best so far for 3 steps (the mean of that
    step and the next two below half the best trailing 3-step mean before it, itself at least ``min_peak``); None
    if it never does. Judged with hindsight: a run may recover later and still have collapsed here. ``to_end``:
    every 3-step window from that step to the run's end stays below half that best, for at least ``LASTING`` steps
    (a collapse the run never recovers from, rather than a dip: at 32 episodes a step on random boards, 3-step dips
    come by chance)."""
    best = 0.0
    for t in range(1, len(successes) - (LASTING - 1 if to_end else 2)):
        window = successes[max(0, t - 3):t]
        best = max(best, sum(window) / len(window))
        ends = range(t, len(successes) - 2) if to_end else (t,)
        if best >= min_peak and all(sum(successes[u:u + 3]) / 3 < 0.5 * best for u in ends):
            return t
    return None


class Replay(NamedTuple):
    fired: dict[str, int]  # env tag -> the step at which the alarm fired (each env once)
    seen: dict[str, set[str]]  # env tag -> signals other than the success drop that held up to then (or the end)
    held: dict[str, dict[str, list[int]]]  # env tag -> co-signal -> every step it held at, whatever success did
    no_signal: list[int]  # the step of the early warning (no reward variance in the updates), if it came


def replay(run: list[dict[str, float]], alarm: EchoTrapAlarm) -> Replay:
    """Feed a run's steps to ``alarm`` as training would, and record what it did and what held when."""
    out = Replay({}, {}, {}, [])
    for step, metrics in enumerate(run):
        alarm.observe(metrics)
        if alarm.no_signal and not out.no_signal:
            out.no_signal.append(step)
        for tag, held in alarm.held.items():
            signals = [k for k in held if k != "success_drop"]
            for signal in signals:
                out.held.setdefault(tag, {}).setdefault(signal, []).append(step)
            if tag not in out.fired:
                out.seen.setdefault(tag, set()).update(signals)
        if alarm.firing:
            out.fired[alarm.last_tag or ""] = step
            alarm.fired_tags.add(alarm.last_tag or "")
    return out


Row = tuple[str, str, "int | None", "int | None", "int | None", str]


def judge(name: str, run: list[dict[str, float]], make=EchoTrapAlarm, replayed: Replay | None = None) -> list[Row]:
    """(run, env, halving step, halving step of a collapse that lasts to the end, alarm step, other signals seen by
    then) per env of the run (``replayed``: its replay, if already made)."""
    fired, seen, _, _ = replayed if replayed is not None else replay(run, make())
    rows = []
    for tag, successes in env_successes(run):
        rows.append((name, tag, halving(successes), halving(successes, to_end=True), fired.get(tag),
                     ", ".join(sorted(seen.get(tag, ()))) or "-"))
    return rows


CATCH_WINDOW = (-5, 10)
"""An alarm catches a collapse only if it fires from 5 steps before the collapse's onset (the halving step) to 10 after
it. One that fired earlier fired on something else (an earlier dip): the collapse it missed is not counted caught."""


def caught(alarm: int | None, onset: int) -> bool:
    """Whether an alarm at ``alarm`` catches a collapse that began at ``onset`` (:data:`CATCH_WINDOW`)."""
    return alarm is not None and CATCH_WINDOW[0] <= alarm - onset <= CATCH_WINDOW[1]


def _tally(rows: list[Row], truth: int) -> str:
    collapsed = [r for r in rows if r[truth] is not None]
    hits = [r for r in collapsed if caught(r[4], r[truth])]
    outside = [r for r in collapsed if r[4] is not None and not caught(r[4], r[truth])]
    false = [r for r in rows if r[truth] is None and r[4] is not None]
    delays = sorted(r[4] - r[truth] for r in hits)
    delay = f"delay {delays[0]:+d} to {delays[-1]:+d} steps" if delays else "no delay measured"
    elsewhere = f", {len(outside)} more fired outside the window" if outside else ""
    return (f"caught {len(hits)}/{len(collapsed)} within {CATCH_WINDOW[0]:+d}..{CATCH_WINDOW[1]:+d} steps of the onset "
            f"({delay}{elsewhere}); false alarms {len(false)}/{len(rows) - len(collapsed)}")


def summary(rows: list[Row]) -> str:
    return (f"collapses (3-step halvings) {_tally(rows, 2)} env runs without one; lasting collapses (down to the "
            f"end) {_tally(rows, 3)}")


def print_table(title: str, rows: list[Row]) -> None:
    width = max([28] + [len(r[0]) + 2 for r in rows])
    print(f"\n{title}")
    print(f"{'run':<{width}}{'env':<18}{'halved at':>10}{'to the end':>11}{'alarm at':>10}  {'verdict':<20}  "
          f"other signals by the alarm")
    dash = lambda step: "-" if step is None else step  # noqa: E731
    for name, tag, halved, lasting, alarm, seen in rows:
        if halved is None:
            verdict = "false alarm" if alarm is not None else "quiet, no collapse"
        elif alarm is None:
            verdict = "missed"
        else:
            verdict = f"{'caught' if caught(alarm, halved) else 'outside window'}, delay {alarm - halved:+d}"
        print(f"{name:<{width}}{tag or '-':<18}{dash(halved):>10}{dash(lasting):>11}{dash(alarm):>10}  {verdict:<20}  "
              f"{seen}")
    print(summary(rows))


HORIZON = 5
"""Steps before a halving within which a signal that held counts as a warning of it."""
CO_SIGNALS = ("entropy", "grad_spike", "mi", "repetition")


class EnvRun(NamedTuple):
    halved: int | None  # the 3-step halving
    lasting: int | None  # the halving of a collapse that lasts to the end
    steps: int
    held: dict[str, list[int]]  # co-signal -> the steps it held at


def lead_table(title: str, runs: list[list[dict[str, float]]], replays: list[Replay] | None = None) -> None:
    """Could a signal not tied to success warn first? Per co-signal: the collapses it held within ``HORIZON`` steps
    up to the halving (and how many steps before it first did), and how often it held where nothing collapsed
    (``replays``: the runs' replays, if already made)."""
    replays = replays if replays is not None else [replay(run, EchoTrapAlarm()) for run in runs]
    envs = [EnvRun(halving(successes), halving(successes, to_end=True), len(run), done.held.get(tag, {}))
            for run, done in zip(runs, replays) for tag, successes in env_successes(run)]

    def warned(truth: str, signal: str) -> str:
        halvings = [(h, [t for t in env.held.get(signal, []) if h - HORIZON <= t <= h])
                    for env in envs if (h := getattr(env, truth)) is not None]
        leads = sorted(h - steps[0] for h, steps in halvings if steps)
        return f"{len(leads)}/{len(halvings)}" + (f" (lead {leads[0]}-{leads[-1]})" if leads else "")

    print(f"\n{title}: a co-signal held within {HORIZON} steps up to the halving (lead: steps before it first did), "
          f"and where nothing halved (by chance: the share of {HORIZON + 1}-step windows it would hold in at that "
          f"rate)")
    print(f"  {'signal':<12}{'3-step halvings':>22}{'lasting collapses':>22}{'env runs without a halving':>30}"
          f"{'their steps':>13}{'by chance':>11}")
    quiet = [env for env in envs if env.halved is None]
    for signal in CO_SIGNALS:
        ever = sum(bool(env.held.get(signal)) for env in quiet)
        share = sum(len(env.held.get(signal, [])) for env in quiet) / max(1, sum(env.steps for env in quiet))
        chance = 1 - (1 - share) ** (HORIZON + 1)
        print(f"  {signal:<12}{warned('halved', signal):>22}{warned('lasting', signal):>22}"
              f"{f'held in {ever}/{len(quiet)}':>30}{share:>13.1%}{chance:>11.0%}")


def critic_runs(runs: dict[str, list[dict[str, float]]]) -> dict[str, list[dict[str, float]]]:
    """The runs whose advantage is the critic's (PPO's GAE): those that log a value loss, or are named PPO (the
    recorded traces keep a few columns)."""
    return {name: run for name, run in runs.items() if name.startswith("ppo") or any("loss/value" in m for m in run)}


EARLY_TUNING = tuple(f"ppo_lr3e-3_nofilter_seed{seed}" for seed in range(3, 9))
"""The runs the early warning's thresholds were chosen on; every other PPO run is held out from it."""


def no_signal_table(title: str, runs: dict[str, list[dict[str, float]]], replays: dict[str, Replay]) -> None:
    """The early warning (no reward variance in the updates, ``no_signal_steps`` in a row) on the runs that whiten
    the critic's advantages: per run, where it came, and how far ahead of the first halving of any env; tallied
    apart for the runs its thresholds were chosen on (``EARLY_TUNING``) and the rest. Runs named ``notwhitened``
    trained on unwhitened advantages, where the live warning is off: listed, not tallied."""
    runs = critic_runs(runs)
    if not runs:
        return
    print(f"\n{title}, PPO (GAE) runs: the early warning (updates without reward variance for "
          f"{EchoTrapAlarm().no_signal_steps} steps) against the first halving of any env")
    print(f"  {'run':<40}{'warned at':>10}{'halved at':>10}{'to the end':>11}  verdict")
    tallies: dict[str, dict[str, list]] = {}
    for name, run in runs.items():
        if not any("rollout/group_reward_std" in m or "filter/reward_std_after" in m for m in run):
            print(f"  {name[:39]:<40}{'':>31}  not judged: no reward std logged")
            continue
        warned = replays[name].no_signal[0] if replays[name].no_signal else None
        halved, lasting = (min((h for h in hs if h is not None), default=None) for hs in zip(*[
            (halving(s), halving(s, to_end=True)) for _, s in env_successes(run)]))
        verdict = ("quiet" if warned is None else "warned, nothing fell") if halved is None else (
            f"ahead by {halved - warned}" if warned is not None and warned <= halved else "not ahead")
        warning_off = "notwhitened" in name
        if warning_off:
            verdict += " (not whitened: the live warning is off)"
        dash = lambda step: "-" if step is None else step  # noqa: E731
        print(f"  {name[:39]:<40}{dash(warned):>10}{dash(halved):>10}{dash(lasting):>11}  {verdict}")
        if warning_off:
            continue
        tally = tallies.setdefault("tuning" if name in EARLY_TUNING else "held out", {
            "halved": [0, 0, []], "lasting": [0, 0, []], "no halving": [0, 0], "no lasting collapse": [0, 0]})
        for key, truth in (("halved", halved), ("lasting", lasting)):
            if truth is not None:
                tally[key][1] += 1
                if warned is not None and warned <= truth:
                    tally[key][0] += 1
                    tally[key][2].append(truth - warned)
        for key, truth in (("no halving", halved), ("no lasting collapse", lasting)):
            if truth is None:
                tally[key][0] += warned is not None
                tally[key][1] += 1
    for group, tally in sorted(tallies.items(), key=lambda item: item[0] != "tuning"):
        counts = []
        for key, label in (("halved", "3-step halvings"), ("lasting", "lasting collapses")):
            hit, total, leads = tally[key]
            counts.append(f"{label} warned ahead of {hit}/{total}" + (f" (by {min(leads)}-{max(leads)})" if leads else ""))
        counts += [f"warned in {tally[key][0]}/{tally[key][1]} runs with {key}"
                   for key in ("no halving", "no lasting collapse")]
        print(f"  {group}: " + "; ".join(counts))


def simulated_run(level: float, steps: int, rng: random.Random, episodes: int = 64, group: int = 8,
                  icc: float = 0.0, effective: bool = True) -> list[dict[str, float]]:
    """A run that learns nothing: success, answers, entropy and gradient norm all stationary. With ``icc`` > 0 each
    group plays its own board, whose success rate is drawn from a Beta of mean ``level`` and that intra-class
    correlation (easy and hard boards); ``effective``: log ``effective_episodes`` as the rollout does."""
    answers = [rng.random() ** 2 for _ in range(6)]  # a fixed, uneven answer distribution for the run
    entropy, grad = rng.uniform(0.2, 1.0), rng.uniform(0.2, 1.0)
    run = []
    for _ in range(steps):
        rates = [rng.betavariate(level * (1 - icc) / icc, (1 - level) * (1 - icc) / icc) if icc > 0 else level
                 for _ in range(episodes // group)]
        outcomes = [[float(rng.random() < rate) for _ in range(group)] for rate in rates]
        wins = sum(map(sum, outcomes))
        stds = [math.sqrt(sum(x * x for x in o) / len(o) - (sum(o) / len(o)) ** 2) for o in outcomes]
        repetition = []
        for _ in range(episodes // group):
            picked = rng.choices(range(len(answers)), weights=answers, k=group)
            repetition.append(1 - (len(set(picked)) - 1) / (group - 1))
        run.append({"rollout/Env/success": wins / episodes, "rollout/Env/episodes": float(episodes),
                    "rollout/Env/repetition": sum(repetition) / len(repetition),
                    "loss/entropy": entropy * (1 + 0.05 * rng.gauss(0, 1)),
                    "actor/grad_norm": grad * math.exp(0.5 * rng.gauss(0, 1)),
                    "rollout/group_reward_std": sum(stds) / len(stds)})
        if effective:
            run[-1]["rollout/Env/effective_episodes"] = effective_episodes(outcomes)
    return run


def false_alarm_rates(runs: int, steps: int, seed: int = 0, make=EchoTrapAlarm, icc: float = 0.0,
                      effective: bool = True, early: bool = False) -> dict[float, float]:
    """Success level -> share of simulated no-learning runs on which the alarm fired (``early``: on which the early
    warning came, as it would in a PPO run whose groups had those rewards)."""
    rng = random.Random(seed)

    def fired(done: Replay) -> bool:
        return bool(done.no_signal if early else done.fired)

    return {level: sum(fired(replay(simulated_run(level, steps, rng, icc=icc, effective=effective), make()))
                       for _ in range(runs)) / runs for level in LEVELS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, nargs="*", default=[], help="more metrics.csv files (held out)")
    parser.add_argument("--simulated", type=int, default=200, help="simulated no-learning runs per success level "
                        "(0: none)")
    parser.add_argument("--steps", type=int, default=100, help="steps per simulated run")
    parser.add_argument("--icc", type=float, default=0.3, help="intra-class correlation of a group's successes in the "
                        "simulated runs with a board per group (0 < icc < 1)")
    args = parser.parse_args()
    if not 0 < args.icc < 1:
        parser.error(f"--icc must be between 0 and 1 (exclusive), got {args.icc}")
    if args.simulated < 0 or args.steps < 1:
        parser.error(f"--simulated must be >= 0 and --steps >= 1, got {args.simulated} and {args.steps}")
    missing = [str(p) for p in args.runs if not p.is_file()]
    if missing:
        parser.error(f"--runs: no such file {', '.join(missing)} (a run's metrics.csv, e.g. "
                     f"runs/<name>/version_0/metrics.csv)")

    tuning_runs = {p.stem: load(p) for p in sorted(DATA.glob("*_seed*.csv"))}
    held = sorted((DATA / "heldout").glob("*.csv")) + sorted(GRID.glob("*.csv")) + list(args.runs)
    held_runs = {p.stem if p.name != "metrics.csv" else str(p.parent): load(p) for p in held}
    for title, runs in (("Tuning runs (the defaults were chosen on these)", tuning_runs), ("Held-out runs", held_runs)):
        replays = [replay(run, EchoTrapAlarm()) for run in runs.values()]
        print_table(title, [r for (name, run), done in zip(runs.items(), replays) for r in judge(name, run, replayed=done)])
        lead_table(title.split(" (")[0], list(runs.values()), replays)
        no_signal_table(title.split(" (")[0], runs, dict(zip(runs, replays)))

    if not args.simulated:
        return
    print(f"\nSimulated runs with no learning ({args.simulated} per level, {args.steps} steps, 64 episodes a step in "
          f"groups of 8), false alarms:")
    print(f"  {'success level':<54}" + "  ".join(f"{level:>5.2f}" for level in LEVELS))
    for icc, effective, label in ((0.0, True, "one board for all groups"),
                                  (args.icc, True, f"a board per group, icc {args.icc}"),
                                  (args.icc, False, f"a board per group, icc {args.icc}, episodes as independent")):
        rates = false_alarm_rates(args.simulated, args.steps, icc=icc, effective=effective)
        print(f"  {label:<54}" + "  ".join(f"{rate:>5.1%}" for rate in rates.values()), flush=True)
    for icc, label in ((0.0, "early warning, one board for all groups"),
                       (args.icc, f"early warning, a board per group, icc {args.icc}")):
        rates = false_alarm_rates(args.simulated, args.steps, icc=icc, early=True)
        print(f"  {label:<54}" + "  ".join(f"{rate:>5.1%}" for rate in rates.values()), flush=True)


if __name__ == "__main__":
    main()
