"""Can SmolLM2-135M read the board? A linear probe on its hidden states where it starts to answer.

    python -m ragen_pl_experiments.research.probe_reading [--env frozenlake|sokoban] [--train 768] [--test 256] [--layers 10 20 30]
                                       [--play 4]

For each grid spelling (RAGEN's cells side by side, and ``cell_separator=" "``: every cell its own token), the
first-turn prompts of ``--train`` + ``--test`` boards (the exact rollout prompt of ``configs/smollm2-<env>.yaml``) run
through SmolLM2-135M-Instruct (``--model warm``: the config's format warm start, the RL runs' step 0, taught on
the config's spelling), and the hidden state at the last prompt token (where the answer
starts) of each ``--layers`` layer is kept. A logistic regression per layer, fit on the training boards, then predicts
the optimal first action of held-out boards (FrozenLake: the highest finite-horizon success probability by value
iteration; Sokoban: a first move of a shortest solution). Printed beside:

* chance: a uniformly random action's hit rate on the same boards (an optimal set can hold several actions);
* the majority action of the training boards;
* the ceiling of a linear reader: the same regression on a one-hot code of every cell's symbol (the board itself).

A layer whose probe beats chance clearly holds what the policy needs to act on the board; one at chance shows the
model's representation of that spelling does not carry it (the I(X;Z) ~ 0 of the RL runs).

``--precision bf16-mixed`` computes the states under CPU bf16 autocast, as the runs' bf16-mixed generation and
scoring do; ``both`` probes each and prints how far autocast moves the state against its across-board spread.

``--play N`` then plays the config's evaluation seeds (N plays each, its action budget) with the probe of the last
``--layers`` layer on the config's spelling as the policy (each board's hidden state, read from the first-turn
prompt of that board, gives the action), beside uniformly random actions and the optimal policy's first action
at every state: how far a policy that reads the board as the probe does gets, against the bar of the RL runs
(random + 0.10). A diagnostic, never a result: nothing here trains the policy.
"""

from __future__ import annotations

import argparse
import random
import time

from ragen_pl_experiments.research.common import load_config, optimal_first_actions
from ragen_pl_experiments.research.common import make_env as make_spec_env


def make_env(cfg: dict, separator: str):
    """The config's env, its grid spelled with ``separator``."""
    spec = cfg["data"]["env"]
    return make_spec_env({**spec, "init_args": {**(spec.get("init_args") or {}), "cell_separator": separator}})


def first_turn(cfg: dict, env, obs: str) -> str:
    """The first-turn user message the rollout writes for a board ``obs`` of ``env``."""
    from ragen_pl.config import RolloutConfig
    from ragen_pl.rollout.prompt import first_user_message, format_instruction

    rollout = RolloutConfig(**cfg["data"]["rollout"])
    fmt = format_instruction(rollout.think, rollout.max_actions_per_turn, rollout.max_new_tokens)
    return first_user_message(env.instructions, obs, rollout.max_actions_per_episode, fmt, rollout.turn_header)


def boards(cfg: dict, separator: str, seeds: range) -> tuple[list[str], list[set[str]], list[str]]:
    """First-turn prompt texts, optimal first-action sets and plain grids of ``seeds``."""
    users, optimal, grids = [], [], []
    for seed in seeds:
        env = make_env(cfg, separator)
        obs = env.reset(seed)
        users.append(first_turn(cfg, env, obs))
        optimal.append(optimal_first_actions(env))
        grids.append(obs.replace(separator, "") if separator else obs)
    return users, optimal, grids


def turn_prompt(cfg: dict, tok, env, obs: str, turn: int) -> list[int]:
    """The token ids the rollout feeds at turn ``turn`` (1 is the first) of a ``context_window: 1`` rollout whose
    board is ``obs`` then, after turns that all scored 0: the rules, ``Turn <turn>``, the board and the actions left."""
    from ragen_pl.config import RolloutConfig
    from ragen_pl.rollout.chat import WindowChat
    from ragen_pl.rollout.prompt import format_instruction, next_user_message

    rollout = RolloutConfig(**cfg["data"]["rollout"])
    if rollout.context_window != 1:
        raise SystemExit(f"error: turn prompts are those of a context_window of 1; the config's is "
                         f"{rollout.context_window}")
    fmt = format_instruction(rollout.think, rollout.max_actions_per_turn, rollout.max_new_tokens)
    chat = WindowChat(tok, rollout.system_prompt, first_turn(cfg, env, obs), rollout.think, env.instructions, 1)
    if turn > 1:  # the window keeps no earlier turn, so one answered turn stands for all of them
        chat.add_response(tok("Up</answer>", add_special_tokens=False)["input_ids"], turn - 2)
        chat.extend_user(next_user_message(turn, 0.0, obs, rollout.max_actions_per_episode - turn + 1, fmt,
                                           rollout.turn_header), True, max_prompt=10**9)
    return chat.prompt_ids()


def hidden_states(model, tok, cfg: dict, users: list[str], layers: list[int], batch: int = 32):
    """(n, len(layers), H) hidden states at the last token of each first-turn prompt (user message ``users``)."""
    from ragen_pl.config import RolloutConfig
    from ragen_pl.rollout.chat import ChatTokens

    rollout = RolloutConfig(**cfg["data"]["rollout"])
    return prompt_states(model, tok, [ChatTokens(tok, rollout.system_prompt, u, rollout.think).ids for u in users],
                         layers, batch)


def prompt_states(model, tok, prompts: list[list[int]], layers: list[int], batch: int = 32):
    """(n, len(layers), H) hidden states at the last token of each prompt (token ids); the prompts' common prefix
    runs once."""
    import torch
    from transformers import DynamicCache

    from ragen_pl.rollout.prefix import common_length

    n = min(common_length(prompts), min(len(p) for p in prompts) - 1)  # each prompt keeps its last token
    out = []
    with torch.no_grad():
        prefix = DynamicCache()
        model(input_ids=torch.tensor([prompts[0][:n]]), past_key_values=prefix, use_cache=True)
        kv = [(layer.keys, layer.values) for layer in prefix.layers]
        for start in range(0, len(prompts), batch):
            rows = [p[n:] for p in prompts[start:start + batch]]
            width = max(len(r) for r in rows)
            ids = torch.tensor([r + [tok.pad_token_id or 0] * (width - len(r)) for r in rows])  # right-padded
            real = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
            cache = DynamicCache(ddp_cache_data=[(k.expand(len(rows), -1, -1, -1).contiguous(),
                                                  v.expand(len(rows), -1, -1, -1).contiguous()) for k, v in kv])
            res = model(input_ids=ids, attention_mask=torch.cat([real.new_ones(len(rows), n), real], 1),
                        position_ids=n + torch.arange(width).expand(len(rows), -1), past_key_values=cache,
                        output_hidden_states=True)
            last = real.sum(1) - 1
            out.append(torch.stack([res.hidden_states[layer][torch.arange(len(rows)), last] for layer in layers], 1))
    return torch.cat(out).float()


def fit_predict(x_train, y_train, x_test, steps: int = 300, weight_decay: float = 1e-3):
    """Multinomial logistic regression (standardised features, L-BFGS); predicted classes of ``x_test``."""
    return fit(x_train, y_train, steps, weight_decay)(x_test)


def fit(x_train, y_train, steps: int = 300, weight_decay: float = 1e-3):
    """The fitted regression of ``fit_predict``, as a function from features to predicted classes."""
    import torch

    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    a = (x_train - mean) / std
    w = torch.zeros(a.shape[1], int(y_train.max()) + 1, requires_grad=True)
    bias = torch.zeros(w.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([w, bias], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(a @ w + bias, y_train) + weight_decay * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    w, bias = w.detach(), bias.detach()
    return lambda x: (((x - mean) / std) @ w + bias).argmax(-1)


def play(cfg: dict, separator: str, policies: dict, plays: int) -> dict[str, float]:
    """Success of each policy (a function from a batch of envs to their actions) over the config's evaluation seeds,
    ``plays`` episodes each, with the config's per-episode action budget."""
    data = cfg["data"]
    budget = data["rollout"].get("max_actions_per_episode", 10)
    first = data.get("val_seed", 1_000_000)
    result = {}
    for name, policy in policies.items():
        envs = [make_env(cfg, separator) for _ in range(data["val_episodes"] * plays)]
        for i, env in enumerate(envs):
            env.reset(first + i // plays)
        live, wins = list(range(len(envs))), 0
        for _ in range(budget):
            if not live:
                break
            for i, action in zip(list(live), policy([envs[i] for i in live])):
                _, _, done, info = envs[i].step(action)
                wins += bool(info.get("success"))
                if done or info.get("success"):
                    live.remove(i)
        result[name] = wins / len(envs)
    return result


def probe_policy(model, tok, cfg: dict, layer: int, predict, actions: list[str]):
    """The probe as a policy: each board's first-turn hidden state at ``layer`` (computed once per board) gives
    its action."""
    known: dict[str, str] = {}

    def act(envs) -> list[str]:
        obs = [env.render() for env in envs]
        new = sorted({o for o in obs if o not in known})
        if new:
            h = hidden_states(model, tok, cfg, [first_turn(cfg, envs[0], o) for o in new], [layer])[:, 0]
            known.update(zip(new, (actions[int(a)] for a in predict(h))))
        return [known[o] for o in obs]

    return act


def one_hot_grids(grids: list[str]):
    import torch

    symbols = sorted({ch for g in grids for ch in g if ch != "\n"})
    cells = [g.replace("\n", "") for g in grids]
    x = torch.zeros(len(grids), len(cells[0]) * len(symbols))
    for i, c in enumerate(cells):
        for j, ch in enumerate(c):
            x[i, j * len(symbols) + symbols.index(ch)] = 1.0
    return x


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=("frozenlake", "sokoban"), default="frozenlake")
    parser.add_argument("--train", type=int, default=768)
    parser.add_argument("--test", type=int, default=256)
    parser.add_argument("--layers", type=int, nargs="+", default=[10, 20, 30])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", choices=("raw", "warm"), default="raw",
                        help="SmolLM2-135M-Instruct itself (the same for both spellings), or the config's warm start "
                             "(taught on the config's spelling)")
    parser.add_argument("--spellings", choices=("both", "config"), default="both",
                        help="both grid spellings, or only the config's")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed", "both"), default="32-true",
                        help="the hidden states in float32, under CPU bf16 autocast as the runs' bf16-mixed "
                             "generation and scoring compute them, or both (then also how far autocast moves them)")
    parser.add_argument("--play", type=int, default=0, metavar="N",
                        help="then play the evaluation seeds N times each with the last layer's probe as the policy")
    args = parser.parse_args()
    if args.play < 0:
        parser.error(f"--play must be 0 (off) or a number of plays per seed (got {args.play})")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl import registry
    from ragen_pl.models.smollm2 import build_smollm2, build_smollm2_warm

    torch.set_num_threads(args.threads)
    cfg = load_config(args.env)
    path = build_smollm2_warm(args.env, progress=False) if args.model == "warm" else build_smollm2()
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    actions = list(registry.resolve("envs", cfg["data"]["env"]["class_path"]).actions)
    train, test = range(args.train), range(1_000_000, 1_000_000 + args.test)
    print(f"{args.env}: optimal first action of {args.test} held-out boards from a linear probe fit on {args.train}, "
          f"hidden state at the last prompt token of {path.name}")
    spelling = (cfg["data"]["env"].get("init_args") or {}).get("cell_separator", "")
    for separator in ("", " ") if args.spellings == "both" else (spelling,):
        start = time.perf_counter()
        users_tr, opt_tr, grids_tr = boards(cfg, separator, train)
        users_te, opt_te, grids_te = boards(cfg, separator, test)
        y = torch.tensor([actions.index(sorted(o)[0]) for o in opt_tr])  # one label per board (sets rarely tie)

        def hits(pred, optimal=opt_te) -> float:
            return sum(actions[int(p)] in o for p, o in zip(pred, optimal)) / len(optimal)

        states = {}
        for precision in ("32-true", "bf16-mixed") if args.precision == "both" else (args.precision,):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                states[precision] = (hidden_states(model, tok, cfg, users_tr, args.layers),
                                     hidden_states(model, tok, cfg, users_te, args.layers))
        chance = sum(len(o) for o in opt_te) / (len(actions) * len(opt_te))
        majority = int(torch.bincount(y).argmax())
        ceiling = hits(fit_predict(one_hot_grids(grids_tr), y, one_hot_grids(grids_te)))
        layers = "; ".join(f"{precision}: " + ", ".join(
            f"layer {layer} {hits(fit_predict(h_tr[:, i], y, h_te[:, i])):.3f}" for i, layer in enumerate(args.layers))
            for precision, (h_tr, h_te) in states.items())
        if len(states) == 2:
            exact, rounded = states["32-true"][0], states["bf16-mixed"][0]
            # What autocast changes against the part of the state that differs across boards (RMS per dimension);
            # the shift every board shares is what a centred, biased reader ignores, so it is also left out.
            spread = exact.std(0).pow(2).mean(-1).sqrt()
            moved = rounded - exact
            whole, per_board = (d.pow(2).mean((0, 2)).sqrt() for d in (moved, moved - moved.mean(0)))
            print("  bf16 autocast moves the state by " + ", ".join(
                f"{float(a / sd):.2f} (layer {layer}; {float(b / sd):.2f} less the shift all boards share)"
                for a, b, sd, layer in zip(whole, per_board, spread, args.layers)) + " of its across-board spread")
        h_tr, h_te = next(iter(states.values()))
        name = "cells side by side (RAGEN)" if not separator else f"cells apart ({separator!r})"
        print(f"  {name}: {layers}; chance {chance:.3f}, majority action {hits([majority] * len(opt_te)):.3f}, "
              f"one-hot board {ceiling:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
        if args.play and separator == spelling:
            start, rng = time.perf_counter(), random.Random(0)
            policies = {
                "random": lambda envs, rng=rng: [rng.choice(actions) for _ in envs],
                f"probe (layer {args.layers[-1]})": probe_policy(model, tok, cfg, args.layers[-1],
                                                                 fit(h_tr[:, -1], y), actions),
                "optimal": lambda envs: [sorted(optimal_first_actions(env))[0] for env in envs],
            }
            played = play(cfg, separator, policies, args.play)
            print(f"  playing {cfg['data']['val_episodes']} evaluation seeds x {args.play} with this spelling: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in played.items())
                  + f" ({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
