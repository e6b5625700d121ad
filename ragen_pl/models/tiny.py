"""An embedded tiny policy: a small Qwen2-architecture model and its own byte-level BPE tokenizer, built offline.

Tests and the CPU quickstart need a model without a model hub. This module builds one and saves it with
``save_pretrained``, so it is loaded through exactly the code path of a hub model
(``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``).

The tokenizer is trained with the ``tokenizers`` library on text from the built-in envs, with Qwen2's own
normaliser, pre-tokeniser and decoder. That matters: transformers 5 loads any saved tokenizer as
``Qwen2Tokenizer`` when ``config.json`` says ``qwen2`` and rebuilds the pipeline from vocab and merges, so a
tokenizer with another pipeline would silently tokenise differently after the round trip. It is byte-level, so
every string is encodable, and vLLM accepts it. ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` are single
added tokens; action names and env symbols become single tokens through training.

Built models are cached under ``$RAGEN_PL_CACHE`` (default ``~/.cache/ragen-pl``), keyed by their config.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from ragen_pl.models.cache import build_threads, cache_dir, replace_dir

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 1024
    """Target BPE vocabulary size (special and tag tokens included)."""
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    """Head size 32: vLLM's CPU attention has no kernel for 16 ("Unsupported CPU attention configuration")."""
    num_key_value_heads: int = 1
    max_position_embeddings: int = 4096
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def _corpus(seed: int, episodes: int = 60) -> list[str]:
    """Chat-formatted text from every built-in env, played with random actions."""
    from ragen_pl.config import SYSTEM_PROMPT
    from ragen_pl.envs.bandit import Bandit
    from ragen_pl.envs.countdown import Countdown
    from ragen_pl.envs.frozen_lake import FrozenLake
    from ragen_pl.envs.sokoban import Sokoban
    from ragen_pl.rollout.prompt import first_user_message, format_instruction, next_user_message

    rng = random.Random(seed)
    envs = [Bandit(), Bandit(low_arm="Trader", high_arm="Librarian"), Sokoban(), Sokoban(dim_room=(8, 8), num_boxes=2),
            FrozenLake(), Countdown()]
    texts = []
    for env in envs:
        for ep in range(episodes):
            fmt = format_instruction(think=ep % 2 == 0, max_actions_per_turn=5, max_tokens=100)
            obs = env.reset(rng.randrange(10**6))
            parts = [SYSTEM_PROMPT, first_user_message(env.instructions, obs, 10, fmt)]
            for turn in range(2, 5):
                acts = [rng.choice(env.actions) if env.actions else env.expert_action() for _ in range(rng.randint(1, 3))]
                parts.append(f"<think>I will try {' then '.join(acts)}.</think><answer>{' || '.join(acts)}</answer>")
                reward = 0.0
                for a in acts:
                    obs, r, done, _ = env.step(a)
                    reward += r
                parts.append(next_user_message(turn, reward, obs, 10 - turn, fmt))
            texts.append("\n".join(parts))
    return texts


def build_tokenizer(vocab_size: int = 1024, seed: int = 0):
    """Train the tiny byte-level BPE tokenizer and wrap it as a transformers ``Qwen2Tokenizer``."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    raw = Tokenizer(BPE())
    # Qwen2Tokenizer's exact pipeline (see the module docstring for why).
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(TAG_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(_corpus(seed), trainer=trainer)
    model = json.loads(raw.to_str())["model"]
    vocab, merges = model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    for token in SPECIAL_TOKENS + TAG_TOKENS:
        vocab.setdefault(token, len(vocab))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         unk_token=None)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(TAG_TOKENS)
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = 4096
    return tok


#: The entry in a config's ``model:`` field that names the warm-started tiny model.
TINY_MODEL_ID = "ragen-pl/tiny"
#: Bump when the demonstrations or the SFT recipe change, so cached warm models are rebuilt.
WARM_START_VERSION = 4  # 3: RAGEN's env generators and wording (issue 11); 4: built with BUILD_THREADS always


def warm_start_rollout():
    """The rollout settings the tiny model is warm-started with; the quickstart configs use the same."""
    from ragen_pl.config import RolloutConfig

    return RolloutConfig(max_turns=4, max_actions_per_turn=3, max_actions_per_episode=10, max_new_tokens=32)


def build_warm_tiny_model(config: TinyConfig | None = None, steps: int = 400, episodes: int = 150,
                          overwrite: bool = False) -> Path:
    """The tiny model after a short SFT warm start on random legal play (format and action names, no skill)."""
    from ragen_pl.envs.bandit import Bandit
    from ragen_pl.envs.frozen_lake import FrozenLake
    from ragen_pl.envs.sokoban import Sokoban
    from ragen_pl.sft import demonstrations, sft

    config = config or TinyConfig()
    recipe = json.dumps([config.key(), steps, episodes, asdict(warm_start_rollout()), WARM_START_VERSION])
    out = cache_dir() / f"tiny-qwen2-warm-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    if (out / "config.json").exists() and not overwrite:
        return out
    base = build_tiny_model(config=config)
    # The Trader/Librarian bandit stays out: it is the held-out variant for generalisation tests.
    envs = [Bandit(), FrozenLake(), Sokoban()]
    records = demonstrations(envs, episodes, warm_start_rollout(), seed=config.seed)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    with build_threads():
        sft(base, records, tmp, steps=steps, lr=3e-3, batch_size=16, seed=config.seed, progress=False)
    replace_dir(tmp, out)
    return out


def build_tiny_model(path: str | os.PathLike | None = None, config: TinyConfig | None = None,
                     overwrite: bool = False) -> Path:
    """Build (once) and save the tiny policy; return its folder, loadable with ``from_pretrained``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = config or TinyConfig()
    out = Path(path) if path is not None else cache_dir() / f"tiny-qwen2-{config.key()}"
    if (out / "config.json").exists() and not overwrite:
        return out
    tok = build_tokenizer(config.vocab_size, config.seed)
    torch.manual_seed(config.seed)
    model_config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
    )
    model = Qwen2ForCausalLM(model_config)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    replace_dir(tmp, out)
    return out
