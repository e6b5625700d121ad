"""Bad input on the command line gets at most three lines naming the flag and the value, never the whole usage
(issue 14): unknown and abbreviated flags, unknown component names, wrong types, missing and invalid config files."""

import re
from pathlib import Path

import pytest
import torch

from ragen_pl.cli import main
from ragen_pl.hooks import ModelHook

ROOT = Path(__file__).resolve().parents[1]


class ValueHeadHook(ModelHook):
    """A hook that builds the shared value head: refused where no shared value head is built."""

    def value_head(self, hidden_size):
        return torch.nn.Linear(hidden_size, 1)
QUICK = ["fit", "--config", str(ROOT / "configs" / "quickstart.yaml")]


def _error(capsys, argv) -> list[str]:
    with pytest.raises(SystemExit) as info:
        code = main(argv)
        raise SystemExit(code)
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert 1 <= len(lines) <= 3, lines
    return lines


@pytest.mark.parametrize("flag, expected", [
    ("--no_such_flag", r"^error: unrecognized argument '--no_such_flag'\.$"),
    ("--trainer.max_step=5", r"^error: unrecognized argument '--trainer.max_step=5'\. Did you mean '--trainer.max_steps'\?$"),
    ("--model.advantage=grpoo", r"^error: --model.advantage: 'grpoo' not found in ragen_pl.advantages\. Available: "
                                r"bilevel_gae, dr_grpo, gae, gigpo, grpo, reinforce_pp, rloo\. Did you mean 'grpo'\?$"),
    ("--data.filter=variance_topp", r"^error: --data.filter: 'variance_topp' not found .* Did you mean 'variance_top_p'\?$"),
    ("--model.ppo.clip_low=abc", r"^error: --model.ppo.clip_low: Expected a float\. Got value: abc$"),
    ("--data.n_groups=x", r"^error: --data.n_groups: Expected a int\. Got value: x$"),
])
def test_bad_flags_are_short_and_named(capsys, flag, expected):
    lines = _error(capsys, [*QUICK, flag, "--print_config"])
    assert re.match(expected, lines[0]), lines
    assert lines[-1] == "Full usage: ragen-pl fit --help"


def test_abbreviated_flags_are_refused(capsys):
    lines = _error(capsys, [*QUICK, "--trainer.max_st=5", "--print_config"])
    assert "unrecognized argument '--trainer.max_st=5'" in lines[0]


def test_missing_config_file(capsys, tmp_path):
    lines = _error(capsys, ["fit", "--config", str(tmp_path / "nope.yaml")])
    assert lines == [f"error: --config: no such file: {tmp_path / 'nope.yaml'}"]


def test_yaml_error_names_file_and_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  model: ragen-pl/tiny\n  ppo: {clip_low: 0.2\ndata: {}\n")
    lines = _error(capsys, ["fit", "--config", str(bad)])
    assert lines[0].startswith(f"error: --config {bad}: invalid YAML at line 4, column 5: "), lines


@pytest.mark.parametrize("flag, expected", [
    # Raised by the config objects, inside jsonargparse's Union wrapping: one line each (issue 21).
    ("--data.rollout.max_new_tokens=0", "error: `--data.rollout.max_new_tokens` must be an integer >= 1, got 0"),
    ("--data.rollout.top_k=0", "error: `--data.rollout.top_k` must be -1 (off) or an integer >= 1, got 0"),
    ("--model.optim.actor_lr=-1", "error: `--model.optim.actor_lr` must be > 0, got -1.0"),
    ("--model.ppo.kl_estimator=k9", "error: --model.ppo.kl_estimator: Expected a typing.Literal['k1', 'k2', 'k3']. "
                                    "Got value: k9"),
    ("--data.rollout.max_seq_len=100000", "error: `--data.rollout.max_seq_len` (100000) must be <= the model's context "
                                          "(4096 positions)"),
    ("--model.hooks=[tests.test_cli_errors.ValueHeadHook]",
     "error: `--model.hooks`: ValueHeadHook builds the value head on the policy's trunk, which needs "
     "`--model.critic=shared` and an advantage with a critic (such as GAE); this run builds a separate critic"),
    ("--model.updater=torch.nn.Linear", "error: --model.updater: Expected a path but torch.nn.Linear either not "
                                      "accessible or invalid"),
])
def test_config_object_errors_are_one_line(capsys, tiny_model_path, flag, expected):
    with pytest.raises(SystemExit) as info:
        raise SystemExit(main([*QUICK, f"--model.model={tiny_model_path}", "--trainer.max_steps=0", flag]))
    assert info.value.code == 2
    err = capsys.readouterr().err
    # (Lightning's logger may also complain here about a stream an earlier test's capture closed.)
    assert [line for line in err.splitlines() if line.startswith("error:")] == [expected]


@pytest.mark.parametrize("flag, expected", [
    ("--model.ppo.temperature=0.7", "error: --model.ppo.temperature: removed: the update scores log-probs at the "
                                    "temperature the batch was sampled with, --data.rollout.temperature."),
    ("--model.ppo.clip_hig=0.3", "error: --model.ppo.clip_hig: no such setting. Did you mean 'clip_high'?"),
])
def test_unknown_settings_of_a_config_object(capsys, flag, expected):
    lines = _error(capsys, [*QUICK, flag, "--print_config"])
    assert lines == [expected, "Full usage: ragen-pl fit --help"]


@pytest.mark.parametrize("native, warned", [(False, True), (True, False)])
def test_bf16_on_a_cpu_without_bf16_instructions_is_named(tiny_model_path, tmp_path, monkeypatch, native, warned):
    """bf16 autocast runs 5x slower than float32 on a CPU without bf16 instructions (an AVX2 EPYC): one warning."""
    import warnings

    from ragen_pl import hardware

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*QUICK, f"--model.model={tiny_model_path}", "--trainer.max_steps=0", "--trainer.logger=false",
                     "--trainer.precision=bf16-mixed", "--trainer.limit_val_batches=0"]) == 0
    named = [str(w.message) for w in caught if "without bf16 instructions" in str(w.message)]
    assert named == ([
        "`--trainer.precision=bf16-mixed` on a CPU without bf16 instructions (avx512_bf16, amx_bf16) runs several "
        "times slower than float32 here; drop it (32-true) on this machine"] if warned else [])


def test_torch_threads_holds_where_vllm_made_set_num_threads_a_no_op(tiny_model_path, monkeypatch):
    """vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op for the rest of the process; a later
    ``--torch_threads`` (a notebook, a test session that ran vLLM) was silently ignored. It is set before the run's
    objects are built, so a run refused at that point has already set it."""
    import torch

    from ragen_pl.hardware import set_torch_threads

    before = torch.get_num_threads()
    wanted = 2 if before == 1 else 1
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    try:
        with pytest.raises(SystemExit):
            raise SystemExit(main([*QUICK, f"--model.model={tiny_model_path}", "--trainer.max_steps=0",
                                   f"--torch_threads={wanted}", "--data.rollout.max_new_tokens=0"]))
        assert torch.get_num_threads() == wanted
    finally:
        set_torch_threads(before)
