"""The command line's parser: errors in at most three lines naming the flag (with a did-you-mean), no abbreviated
flags, a ``--help`` that opens with the options users set, and the check of ``--config`` files before they are read.
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser

__all__ = ["GUIDE", "REMOVED", "RagenArgumentParser", "check_config_files", "did_you_mean", "own_reason"]

GUIDE = """ragen-pl {command}: StarPO / RAGEN training and evaluation (LightningCLI). The options set most, and how to see
each group's own settings:
  -c, --config FILE          a YAML config (configs/*.yaml); several compose, later ones win; --print_config shows all
  --model.model NAME         hub id, local folder, ragen-pl/tiny, ragen-pl/smollm2-135m[-warm-<env>]
  --model.advantage NAME     gae, grpo, rloo, ... (ragen-pl plugins lists every component of every group)
  --model.ppo.*              the update (clip, epochs, mini-batches, entropy, KL):  --model.ppo.help
  --model.optim.*            learning rates, schedule:                               --model.optim.help
  --model.lora.*             LoRA adapters:                                          --model.lora.help
  --data.env NAME            bandit, sokoban, frozen_lake, countdown or a plugin; its settings: --data.env.help NAME
  --data.rollout.*           turns, actions, tokens per turn, sampling, prompts:     --data.rollout.help
  --data.filter NAME         variance_top_p, snr, ...; its settings:                 --data.filter.help NAME
  --data.engine NAME         hf (default) or vllm; its settings:                     --data.engine.help NAME
  --data.n_groups, --data.group_size, --data.val_episodes, --data.val_temperature
  --trainer.*                Lightning's Trainer: max_steps, val_check_interval, devices, strategy, precision
Every option follows.

"""


def did_you_mean(word: str, choices) -> str:
    """`` Did you mean '--x'?`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


class RagenArgumentParser(LightningArgumentParser):
    """LightningCLI's parser with short errors and no abbreviated flags.

    jsonargparse prints the whole usage (60-80 lines) before an error. Here an error is at most three lines: what
    is wrong (naming the flag and the value), a did-you-mean where a close name exists, and where the full usage is.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # `--trainer.max_step=5` must not silently mean max_steps
        kwargs.setdefault("prog", "ragen-pl")  # also under `python -m ragen_pl.cli` and in tests
        super().__init__(*args, **kwargs)

    def format_help(self) -> str:
        """``ragen-pl fit --help`` opens with the options users set and how to see each group's own (the full usage,
        600 lines of every Trainer option, follows)."""
        text = super().format_help()
        command = self.prog.split()[-1] if self.prog else ""
        return GUIDE.format(command=command) + text if command in ("fit", "validate", "test") else text

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        from jsonargparse._common import debug_mode_active

        if not self.exit_on_error or debug_mode_active():
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"error: {_short_message(message, parser)}\nFull usage: {prog} --help\n")
        self.exit(2)


def _short_message(message: str, parser) -> str:
    """One line from jsonargparse's message, with a did-you-mean for unknown flags."""
    unknown = re.match(r"unrecognized arguments: (.*)", message.strip())
    if unknown:
        flags = unknown.group(1).split()
        first = flags[0].split("=")[0]
        options = [o for o in parser._option_string_actions if o.startswith("--")] + nested_flags()
        return f"unrecognized argument {unknown.group(1)!r}.{did_you_mean(first, options)}"
    ours = own_reason(message)
    if ours is not None:  # a config object's own sentence names the full flag already
        return ours
    lines = [ln.strip(" -") for ln in message.splitlines() if ln.strip(" -")]
    keys = [(i, m.group(1)) for i, ln in enumerate(lines) for m in [re.search(r'Parser key "([^"]+)"', ln)] if m]
    # The flag: nested keys join up (`model.ppo` then `clip_low` -> `--model.ppo.clip_low`).
    flag = ".".join(k for _, k in keys[:1]) if keys else ""
    for _, k in keys[1:]:
        flag = k if k.startswith(flag + ".") else f"{flag}.{k}"
    nested = re.search(r"NestedArg\(key='([^']+)'", message)
    fields = _union_fields(message)
    if nested and fields is not None and nested.group(1) not in fields:  # `--model.ppo.nope=1`
        flag = f"{flag}.{nested.group(1)}"
        return f"--{flag}: {REMOVED.get(flag, 'no such setting')}.{did_you_mean(nested.group(1), fields)}"
    # The most specific reason: ours ("'grpoo' not found ... Available: ..."), else the line under the innermost key.
    reason = next((ln for ln in lines if "not found" in ln or "Available" in ln), None)
    if reason is None:
        after = keys[-1][0] + 1 if keys else 0
        reason = re.sub(r'^Parser key "[^"]+":\s*', "", lines[after] if after < len(lines) else lines[-1])
    reason = re.sub(r"<class '([\w.]+)'>", r"\1", reason)
    not_finite = re.match(r"Expected a float\. Got value: ([+-]?(?:nan|inf|infinity))$", reason, re.IGNORECASE)
    if not_finite:  # YAML reads `nan` / `inf` as strings; a rate or a coefficient must be a finite number anyway
        reason = f"must be a finite number, got {not_finite.group(1)}"
    return f"--{flag}: {reason}" if flag else reason


#: Settings earlier versions had, and what replaced them.
REMOVED = {"model.ppo.temperature": "removed: the update scores log-probs at the temperature the batch was sampled "
                                    "with, --data.rollout.temperature"}


def nested_flags() -> list[str]:
    """The full paths of the settings' fields (``--data.rollout.temperature``, ...): jsonargparse lists an optional
    settings object as one option, so a misspelt field would otherwise be matched against unrelated top-level flags."""
    import dataclasses

    from ragen_pl.collapse import CollapseConfig
    from ragen_pl.config import LoraSettings, OptimConfig, PPOConfig, RolloutConfig
    from ragen_pl.rewards import RewardNorm

    groups = {"--data.rollout": RolloutConfig, "--model.ppo": PPOConfig, "--model.optim": OptimConfig,
              "--model.lora": LoraSettings, "--model.collapse": CollapseConfig, "--model.reward_norm": RewardNorm}
    return [f"{prefix}.{f.name}" for prefix, cls in groups.items() if dataclasses.is_dataclass(cls)
            for f in dataclasses.fields(cls)]


def own_reason(message: str) -> str | None:
    """The sentence a ragen-pl config object raised (it starts with a backticked full flag), found inside whatever
    jsonargparse wrapped it in (a Union's "Does not validate against any of the Union subtypes ..." lists each
    subtype's error, ours among them)."""
    for line in message.splitlines():
        line = line.strip(" -")
        if line.startswith("`--"):
            return line
    return None


def _union_fields(message: str) -> list[str] | None:
    """The fields of the dataclass a jsonargparse Union message names first (``PPOConfig | None``), or None."""
    import dataclasses
    import importlib

    found = re.search(r"Subtypes: \[<class '([\w.]+)\.(\w+)'>", message)
    if not found:
        return None
    try:
        cls = getattr(importlib.import_module(found.group(1)), found.group(2))
    except (ImportError, AttributeError):
        return None
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else None


def check_config_files(argv: list[str]) -> str | None:
    """Check each ``--config`` file before LightningCLI reads it: exists, and is valid YAML (file and line)."""
    import yaml

    paths = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    for path in paths:
        if path.lstrip().startswith(("{", "[")) or "\n" in path:
            continue  # an inline config string, not a file
        file = Path(path)
        if not file.is_file():
            return f"--config: no such file: {path}"
        try:
            yaml.safe_load(file.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            return f"--config {path}: invalid YAML at {where}: {problem}"
    return None
