"""The embedded tiny model: built offline, saved and loaded through the hub code path, tokenizer round trip."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ragen_pl.envs.frozen_lake import FrozenLake
from ragen_pl.envs.sokoban import Sokoban
from ragen_pl.models.tiny import TAG_TOKENS, build_tokenizer, warm_start_rollout
from ragen_pl.sft import demonstrations, encode, read_jsonl, sft, write_jsonl

TEXTS = [
    "<|im_start|>user\nTurn 1:\nState:\n######\n#_√P_#\n#OX__#\n######\nYou have 5 actions left.<|im_end|>\n",
    "<think>I will go Up.</think><answer>Up || Left</answer>",
    "héllo ünïcode 日本語 🎉 \t tabs\r\nand CRLF",
    "Numbers: [18, 73, 98, 9]. Target: 189. ((18 + 73) + 98)",
    "",
    "P___\n__O_\n√XSG",
]


def test_auto_tokenizer_round_trip_matches_the_built_tokenizer(tiny_model_path):
    loaded = AutoTokenizer.from_pretrained(tiny_model_path)
    built = build_tokenizer()
    assert type(loaded).__name__ == "Qwen2Tokenizer"  # what transformers picks for a qwen2 config
    assert json.loads((tiny_model_path / "config.json").read_text())["model_type"] == "qwen2"
    for text in TEXTS:
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert ids == built(text, add_special_tokens=False)["input_ids"], text
        assert loaded.decode(ids) == text
    for tag in TAG_TOKENS + ["<|im_start|>", "<|im_end|>"]:
        assert len(loaded(tag, add_special_tokens=False)["input_ids"]) == 1, tag
    for word in ("Up", " Down", " Left", " Right"):
        assert len(loaded(word, add_special_tokens=False)["input_ids"]) == 1, word
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"
    chat = loaded.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_model_loads_through_from_pretrained(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.hidden_size // model.config.num_attention_heads == 32  # vLLM's CPU kernels need >= 32
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, model.config.vocab_size)


def test_demonstrations_are_random_legal_play_in_the_rollout_layout(tiny_model_path):
    config = warm_start_rollout()
    records = demonstrations([Sokoban(), FrozenLake()], 5, config, seed=0)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    for r in records:
        assert 1 <= len(r["turns"]) <= config.max_turns
        for turn in r["turns"]:
            answer = turn["assistant"].split("<answer>")[1].split("</answer>")[0]
            actions = [a.strip() for a in answer.split("||")]
            assert 1 <= len(actions) <= config.max_actions_per_turn
            assert all(a in Sokoban.actions for a in actions)  # legal names (both envs use these four)
        ids, mask = encode(r, tok)
        assistant = tok.decode([i for i, m in zip(ids, mask) if m])
        assert assistant == "".join(t["assistant"] for t in r["turns"])  # the loss covers exactly the answers


def test_effective_demonstrations_replay_as_moves_that_change_the_state():
    """Replaying each record's episode (same reset seed, same slips): every action was effective where it was taken,
    the turns end where the episode does, and an unknown play is refused."""
    import pytest

    config = warm_start_rollout()
    for env in (Sokoban(), FrozenLake()):
        seeds, reset = [], env.reset
        env.reset = lambda seed, reset=reset, seeds=seeds: seeds.append(seed) or reset(seed)  # (record the seeds)
        records = demonstrations([env], 6, config, seed=3, play="effective")
        noops = 0
        for seed, r in zip(seeds, records, strict=True):
            reset(seed)
            for turn in r["turns"]:
                for a in turn["assistant"].split("<answer>")[1].split("</answer>")[0].split(" || "):
                    assert a in env.effective_actions()
                    _, _, done, info = env.step(a)
                    noops += not info["action_is_effective"]
            used = sum(len(t["assistant"].split(" || ")) for t in r["turns"])
            assert done or used == config.max_actions_per_episode or len(r["turns"]) == config.max_turns
        if isinstance(env, Sokoban):
            assert noops == 0  # on FrozenLake the ice may slip into an edge
    with pytest.raises(ValueError, match="`play` must be one of random, effective, expert, got 'solver'"):
        demonstrations([Sokoban()], 1, config, play="solver")


def test_sft_command_path_lowers_the_loss(tiny_model_path, tmp_path):
    records = demonstrations([Sokoban()], 8, warm_start_rollout(), seed=1)
    write_jsonl(records, tmp_path / "d.jsonl")
    assert read_jsonl(tmp_path / "d.jsonl") == records
    first = sft(tiny_model_path, records, tmp_path / "a", steps=1, lr=3e-3, batch_size=8, progress=False)
    last = sft(tiny_model_path, records, tmp_path / "b", steps=30, lr=3e-3, batch_size=8, progress=False)
    assert last < first - 1.0
    assert (tmp_path / "b" / "config.json").exists() and (tmp_path / "b" / "tokenizer.json").exists()


def test_sft_loss_is_the_cross_entropy_of_the_assistant_tokens(tiny_model_path):
    """The trimmed LM head gives the plain full-logits loss over exactly the assistant tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl.sft import SFTModule, _collate

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    records = demonstrations([Sokoban()], 3, warm_start_rollout(), seed=2)
    batch = _collate(tok.pad_token_id)([encode(r, tok) for r in records])
    module = SFTModule(model)
    module.log = lambda *a, **k: None
    with torch.no_grad():
        loss = module.training_step(batch, 0)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    terms = [torch.nn.functional.cross_entropy(logits[b, t - 1], batch["input_ids"][b, t])
             for b in range(len(records)) for t in range(1, batch["input_ids"].shape[1]) if batch["loss_mask"][b, t]]
    torch.testing.assert_close(loss, torch.stack(terms).mean(), atol=1e-5, rtol=1e-5)


def test_a_cached_warm_start_is_built_with_the_same_threads_whoever_builds_it(tmp_path, monkeypatch):
    """The warm start's weights depend on how many threads split its float sums: a test (1 thread) and the CLI (2)
    built different weights under one cache key. The build runs with BUILD_THREADS and hands the caller its own count
    back, also when it fails, and also where vLLM's CPU worker has made ``torch.set_num_threads`` a no-op."""
    import pytest

    import ragen_pl.sft
    from ragen_pl.hardware import set_torch_threads
    from ragen_pl.models.cache import BUILD_THREADS, build_threads
    from ragen_pl.models.tiny import build_warm_tiny_model

    monkeypatch.setenv("RAGEN_PL_CACHE", str(tmp_path))
    seen = []

    def fake_sft(base, records, out, **kwargs):
        seen.append(torch.get_num_threads())
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(ragen_pl.sft, "sft", fake_sft)
    before = torch.get_num_threads()
    caller = 1 if BUILD_THREADS != 1 else 2
    try:
        set_torch_threads(caller)
        build_warm_tiny_model(steps=1, episodes=2, overwrite=True)
        assert torch.get_num_threads() == caller
        monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vLLM's CPU worker leaves behind
        build_warm_tiny_model(steps=1, episodes=2, overwrite=True)
        assert torch.get_num_threads() == caller
    finally:
        set_torch_threads(before)
    assert seen == [BUILD_THREADS, BUILD_THREADS]
    with pytest.raises(RuntimeError), build_threads():
        raise RuntimeError("a failed build")
    assert torch.get_num_threads() == before


def test_demos_of_a_config_are_taught_in_its_rollout_layout(tmp_path, capsys):
    """`ragen-pl demos --config C` plays C's envs in C's rollout layout: the prompts a run of C feeds (here the SmolLM2
    Bandit config: answer-only, one action); --play effective plays effective moves; a missing config is one line."""
    import yaml

    from ragen_pl.cli import main
    from ragen_pl.config import RolloutConfig
    from ragen_pl.rollout.prompt import format_instruction

    config = Path(__file__).resolve().parents[1] / "configs" / "smollm2-bandit.yaml"
    out = tmp_path / "demos.jsonl"
    assert main(["demos", "--config", str(config), "--episodes", "4", "--out", str(out)]) == 0
    assert "wrote 4 trajectories of random play" in capsys.readouterr().out
    rollout = RolloutConfig(**yaml.safe_load(config.read_text())["data"]["rollout"])
    records = read_jsonl(out)
    assert all(r["think"] is False and len(r["turns"]) == 1 for r in records)
    fmt = format_instruction(rollout.think, rollout.max_actions_per_turn, rollout.max_new_tokens)
    assert all(fmt in r["turns"][0]["user"] for r in records)
    assert {r["turns"][0]["assistant"] for r in records} <= {"Phoenix</answer>", "Dragon</answer>"}
    with pytest.raises(SystemExit, match=r"^error: --config .*nothing\.yaml: \[Errno 2\]"):
        main(["demos", "--config", str(tmp_path / "nothing.yaml"), "--out", str(out)])
