"""How many trajectories does RL need on FrozenLake or Sokoban when all it has to learn is a linear readout of the board?

    python -m ragen_pl_experiments.research.readout_rl [--env frozenlake|sokoban] [--features onehot local llm] [--lrs 0.03 0.1 0.3]
                                    [--seeds 0 1 2] [--iterations 60] [--common 0.067 [--center]]

A diagnostic of issue 20's sample budget, never a result: nothing here trains SmolLM2. The policy is a softmax over
the four actions of a linear function of fixed features of the current board, starting at zero (uniform: the
board-blind play of the random-play warm start), and it learns as the SmolLM2 runs do: the env of
``configs/smollm2-<env>.yaml`` (RAGEN's FrozenLake 4x4, slippery, random start and goal; Sokoban 6x6, one box) with
one action a turn and its 10-action budget, ``--n-groups`` fresh boards a step x ``--group-size`` trajectories on
each (a group shares its seed, so its slips), the episode's summed reward as the score (FrozenLake: 0/1 success;
Sokoban: -0.1 a step, +1 a box on target, +10 solved), GRPO advantages (:func:`ragen_pl.advantages.grpo`), the
variance filter keeping the top half of the groups (:func:`ragen_pl.filters.select_groups`), one Adam step on the token-mean policy gradient. Evaluation:
the config's evaluation seeds (``--plays`` each) at its evaluation temperature, every ``--eval-every`` iterations.

Features:

* ``onehot``: each cell's symbol, one-hot (the board itself; what any reader of the grid can use);
* ``local``: hand-made facts about the player's surroundings and the goal's direction (:class:`Local`), an
  optimistic reader;
* ``llm``: SmolLM2-135M-Instruct's hidden state (``--layer``) at the last token of the rollout's prompt for that
  board (:func:`probe_reading.hidden_states`; a linear probe on it names an optimal first action on held-out boards
  2.3x as often as chance), standardised: the policy RL could reach by learning a readout of the model's own state.

Geometry: SmolLM2's last hidden state is mostly what every prompt shares (each dimension varies across boards by
0.064 of its size, as ``--features llm`` prints). ``--common EPS`` gives any feature set that shape (a fixed vector common to every board plus EPS
times the features), to see what it does to learning; ``--center`` then reads the features less their component
along their mean direction, fixed at the first update (the centred head, ``ReadoutHead(center=k)``: the learner
reads one kind of position, so one direction is its shared part).
``--kl-coeff`` adds a KL term to the starting policy; ``--optimizer sgd``, ``--entropy-coeff``, ``--agg seq`` and
``--val-temperature`` vary the rest of the rule. ``--ppo-epochs N --mini-batch M`` replace the one plain step an
iteration with N passes of PPO's clipped steps over mini-batches of M kept turns (``--model.ppo.ppo_epochs`` and
``--model.ppo.mini_batch_size`` of the SmolLM2 runs). ``--critic LR`` replaces the group's baseline with GAE
(``--gae-lambda``, discount 1) on a linear value of the same features, trained on its lambda-returns in the same
mini-batches (a turn-level critic; use it with ``--top-p 1``: groups whose trajectories all scored alike still teach
it). For ``llm`` features, ``--model warm`` reads the config's format
warm start (the runs' step 0) instead of SmolLM2 itself, ``--pca K`` keeps the K leading principal directions of
the standardised states, each scaled to unit variance, and ``--feature-cache FILE`` keeps the states for later runs;
``--bf16`` computes them under CPU bf16 autocast, as the runs' bf16-mixed generation and scoring do.
``--turn-text`` gives each turn the state the runs' prompt of that turn gives it: the runs' window-1 prompt says
``Turn t`` and the actions left (and, after turn 1, the last turn's reward), which moves the state at the last prompt
token about as much as the board does; by default every turn reads its board's first-turn prompt. The shift is
taken as additive (the board's first-turn state plus the mean shift of turn t's text over 32 first boards,
:func:`probe_reading.turn_prompt`), so the states are still computed once per board.
``--head runs`` reads the states as the runs' whitened head does instead of standardised (``center`` and
``whiten`` of the config's ReadoutHead: less the k leading directions of the second moment of the hidden states at the four
positions a first turn's answer scores, each dimension divided by its root mean square over all four), fitted on the
first turns of 128 boards (:func:`head_geometry.scored_hidden_states`) where the runs fit it on their first
micro-batch; ``--head action`` also leaves out the action position's mean and divides by the root mean square there
only (what the head would read if fitted where an action token is sampled). With no bias of their own the runs' head
moves every board's answer through what is left of that mean: the simulation's bias row stays in all three.

Printed per feature set and learning rate: evaluation success every ``--eval-every`` iterations (mean over
``--seeds``), and the first iteration (and trajectories) at which the mean reaches the random policy's success
+ ``--goal`` on the same seeds (issue 20: FrozenLake +0.10; Sokoban a gain of two standard errors). The SmolLM2
runs afford 1,000-2,000 trajectories in 90 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ragen_pl_experiments.research.common import load_config, make_env, random_success, readout
from ragen_pl_experiments.research.head_geometry import head_input

if TYPE_CHECKING:
    import torch


class OneHot:
    """Each cell's symbol one-hot, from the board as rendered without separators."""

    def __init__(self) -> None:
        self.symbols: list[str] = []

    def __call__(self, envs) -> torch.Tensor:
        import torch

        grids = [env.render().replace(env.cell_separator, "").replace("\n", "") for env in envs]
        for g in grids:
            self.symbols += sorted({ch for ch in g if ch not in self.symbols})
        x = torch.zeros(len(grids), len(grids[0]) * 8)
        for i, g in enumerate(grids):
            for j, ch in enumerate(g):
                x[i, j * 8 + self.symbols.index(ch)] = 1.0
        return x


class Local:
    """Hand-made features that put what the optimal move depends on within a linear reader's reach: per direction,
    what lies on the neighbouring cell (and, in Sokoban, the one beyond it, where a pushed box would go), and where
    the goal (FrozenLake) or the box and its target (Sokoban) lie from the player, as signs of their row and column
    offsets. An optimistic reader: SmolLM2 has to find these facts in the text."""

    def __call__(self, envs) -> torch.Tensor:
        import torch

        return torch.stack([self.frozen_lake(env) if hasattr(env, "holes") else self.sokoban(env) for env in envs])

    @staticmethod
    def _signs(dr: int, dc: int) -> list[float]:
        x = [0.0] * 9
        x[3 * ((dr > 0) - (dr < 0) + 1) + (dc > 0) - (dc < 0) + 1] = 1.0
        return x

    def frozen_lake(self, env) -> torch.Tensor:
        import torch

        (r, c), n, x = env.pos, env.size, []
        for dr, dc in ((0, -1), (1, 0), (0, 1), (-1, 0)):  # the env's action order
            cell = (r + dr, c + dc)
            kind = 0 if not (0 <= cell[0] < n and 0 <= cell[1] < n) else 2 if cell in env.holes else \
                3 if cell == env.goal else 1
            x += [float(kind == k) for k in range(4)]
        return torch.tensor(x + self._signs(env.goal[0] - r, env.goal[1] - c))

    def sokoban(self, env) -> torch.Tensor:
        import torch

        def kind(i: int) -> int:  # wall, floor, target, box, box on target
            return 0 if env.fixed[i] == 0 else (3 if env.fixed[i] == 1 else 4) if i in env.boxes else env.fixed[i]

        p, cols, x = env.player, env.cols, []
        for d in env._deltas:
            near = kind(p + d)
            beyond = kind(p + 2 * d) if near in (3, 4) else None  # where a push would send the box
            x += [float(near == k) for k in range(5)] + [float(beyond == k) for k in range(5)]
        box = next(iter(env.boxes))
        target = next(i for i, f in enumerate(env.fixed) if f == 2)
        x += self._signs(box // cols - p // cols, box % cols - p % cols)
        x += self._signs(target // cols - box // cols, target % cols - box % cols)
        return torch.tensor(x)


def pca_basis(z: torch.Tensor, k: int) -> torch.Tensor:
    """(H, K): the K leading principal directions of ``z`` (N, H), centred, each divided by its standard deviation,
    so that ``z @ basis`` has K uncorrelated columns of variance 1 over ``z``'s rows."""
    import torch

    _, sv, vh = torch.linalg.svd(z - z.mean(0), full_matrices=False)
    return vh[:k].T / (sv[:k] / (len(z) - 1) ** 0.5)


class Hidden:
    """SmolLM2's hidden state at the last prompt token of each board's rollout prompt, computed once per board."""

    def __init__(self, cfg: dict, layer: int, standardise_on: list, pca: int | None = None, model: str = "raw",
                 env: str = "frozenlake", cache: str | None = None, head: str = "standardised",
                 bf16: bool = False, turn_text: bool = False) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ragen_pl.models.smollm2 import build_smollm2, build_smollm2_warm

        path = build_smollm2_warm(env, progress=False) if model == "warm" else build_smollm2()
        self.model = AutoModelForCausalLM.from_pretrained(path).eval()
        self.tok = AutoTokenizer.from_pretrained(path)
        if head != "standardised" and layer != self.model.config.num_hidden_layers:
            raise SystemExit(f"error: --head {head} reads the last hidden state, what the head reads: --layer must be "
                             f"{self.model.config.num_hidden_layers}, got {layer}")
        self.cfg, self.layer, self.known, self.scored, self.bf16 = cfg, layer, {}, None, bf16
        self.turn_offsets = self.offsets = None  # --turn-text: (turns, H), kept in the cache either way
        self.cache, self.source = (Path(cache) if cache else None), {"model": Path(path).name, "layer": layer, "env": env}
        if bf16:
            self.source["precision"] = "bf16-mixed"
        if self.cache is not None and self.cache.exists():
            saved = torch.load(self.cache)
            if saved.get("source") != self.source:
                raise SystemExit(f"error: --feature-cache {self.cache}: holds states of {saved.get('source')}, not of "
                                 f"{self.source}; give another file")
            self.known, self.scored = saved["states"], saved.get("scored")
            self.turn_offsets = saved.get("turn_offsets")
        self.mean = self.std = self.basis = self.head = None
        x = self(standardise_on)
        if turn_text:
            if self.turn_offsets is None:
                self.turn_offsets = self._turn_offsets(standardise_on[:32])
            self.offsets = self.turn_offsets
            x = (x.unsqueeze(1) + self.offsets).reshape(-1, x.shape[-1])  # every board at every turn
        self.mean, self.std = x.mean(0), x.std(0) + 1e-6
        if head != "standardised":
            if self.scored is None:
                from ragen_pl_experiments.research.head_geometry import scored_hidden_states

                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    self.scored, _ = scored_hidden_states(self.model, self.tok, cfg, range(128),
                                                          torch.Generator().manual_seed(0))
            scored = self.scored.double()
            if self.offsets is not None:  # the action position of every turn's prompt; the format positions as fitted
                scored = torch.cat([torch.cat([scored[:, :1] + d.double(), scored[:, 1:]], 1) for d in self.offsets])
            self.head = head_input(scored, readout(cfg)["center"], head == "action")
        if pca is not None:
            self.basis = pca_basis((x - self.mean) / self.std, pca)
        self.size, self.spread = float(x.abs().mean()), float(x.std(0).mean())
        """Mean size of a dimension, and its mean standard deviation across the boards: how much of the state
        depends on the board (the geometry ``--common`` imitates)."""

    def save(self) -> None:
        """Write the states computed so far to ``--feature-cache``."""
        import torch

        if self.cache is not None:
            self.cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"source": self.source, "states": self.known,
                        **({"scored": self.scored} if self.scored is not None else {}),
                        **({"turn_offsets": self.turn_offsets} if self.turn_offsets is not None else {})},
                       self.cache)

    def _turn_offsets(self, envs) -> torch.Tensor:
        """(turns, H): how much the state at the last prompt token moves, on average over ``envs``' first boards,
        when the same board is the prompt of turn t instead of turn 1 (``Turn t``, t - 1 fewer actions left, and the
        ``Reward: 0`` line of a later turn's message); row 0 is zeros."""
        import torch

        from ragen_pl_experiments.research.probe_reading import prompt_states, turn_prompt

        turns = self.cfg["data"]["rollout"].get("max_turns", 10)
        prompts = [turn_prompt(self.cfg, self.tok, env, env.render(), t) for env in envs for t in range(1, turns + 1)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            h = prompt_states(self.model, self.tok, prompts, [self.layer])[:, 0].reshape(len(envs), turns, -1)
        return (h - h[:, :1]).mean(0)

    def __call__(self, envs, turn: int = 0) -> torch.Tensor:
        import torch

        from ragen_pl_experiments.research.probe_reading import first_turn, hidden_states

        obs = [env.render() for env in envs]
        new = sorted({o for o in obs if o not in self.known})
        if new:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                h = hidden_states(self.model, self.tok, self.cfg, [first_turn(self.cfg, envs[0], o) for o in new],
                                  [self.layer])[:, 0]
            self.known.update(zip(new, h))
        x = torch.stack([self.known[o] for o in obs])
        if self.offsets is not None and self.mean is not None:
            x = x + self.offsets[turn]
        if self.mean is None:
            return x
        if self.head is not None:
            from ragen_pl_experiments.readout import project_out

            directions, scale = self.head
            return project_out(x.double(), directions).float() / scale.float()
        x = (x - self.mean) / self.std
        return x if self.basis is None else x @ self.basis


def play(envs, features, w, temperature: float, gen, budget: int):
    """Play ``envs`` (already reset) to the end with softmax(features(envs, turn) @ w / temperature), the turn
    counted from 0; return per env its success, the (feature, action) pairs of each turn and the summed reward."""
    import torch

    n = len(envs)
    live, success, score = list(range(n)), [0.0] * n, [0.0] * n
    turns: list[list[tuple]] = [[] for _ in range(n)]
    for turn in range(budget):
        if not live:
            break
        x = features([envs[i] for i in live], turn)
        if temperature > 0:
            acts = torch.multinomial(torch.softmax((x @ w) / temperature, -1), 1, generator=gen)[:, 0]
        else:  # greedy, as the engines sample at temperature 0
            acts = (x @ w).argmax(-1)
        still = []
        for k, i in enumerate(live):
            _, reward, done, info = envs[i].step(envs[i].actions[int(acts[k])])
            turns[i].append((x[k], int(acts[k])))
            score[i] += reward
            if info.get("success"):
                success[i] = 1.0
            if not (done or info.get("success")):
                still.append(i)
        live = still
    return success, turns, score


def run(cfg: dict, features, lr: float, seed: int, args) -> tuple[list[float], list[float]]:
    """Evaluation success at iterations 0, eval_every, 2 eval_every, ... of one learning run, and the training
    success (temperature 1) of each iteration."""
    import torch

    from ragen_pl.advantages import grpo
    from ragen_pl.filters import select_groups
    from ragen_pl.losses import ppo_clip
    from ragen_pl_experiments.readout import project_out

    data = cfg["data"]
    budget = data["rollout"].get("max_actions_per_episode", 10)
    probe = make_env(data["env"])
    probe.reset(0)
    dim = features([probe]).shape[1]
    w = torch.zeros(dim + 1, 4, requires_grad=True)  # the last row is the bias
    opt = torch.optim.Adam([w], lr=lr) if args.optimizer == "adam" else torch.optim.SGD([w], lr=lr)
    v = torch.zeros(dim + 1, requires_grad=True) if args.critic else None  # --critic: a linear value, with a bias
    value_opt = torch.optim.Adam([v], lr=args.critic) if v is not None else None
    gen = torch.Generator().manual_seed(seed)
    shuffle = torch.Generator().manual_seed(seed)  # the mini-batch order
    val_first = data.get("val_seed", 1_000_000)

    offset = None
    if args.common is not None:  # SmolLM2's geometry: a large part common to every board, a small part that is not
        offset = torch.randn(dim, generator=torch.Generator().manual_seed(1234))

    mean_direction = None  # --center: ragen_pl_experiments.readout's centred head, the direction fixed at the first update

    def feats(envs, turn: int = 0):
        x = features(envs, turn) if isinstance(features, Hidden) else features(envs)
        if offset is not None:
            x = offset + args.common * x
        if mean_direction is not None:
            x = project_out(x, mean_direction)
        return torch.cat([x, x.new_ones(len(envs), 1)], 1)

    def evaluate() -> float:
        envs = []
        for s in range(val_first, val_first + data["val_episodes"]):
            for _ in range(args.plays):
                envs.append(make_env(data["env"]))
                envs[-1].reset(s)
        with torch.no_grad():
            success, _, _ = play(envs, feats, w, args.val_temperature, torch.Generator().manual_seed(7), budget)
        return sum(success) / len(success)

    curve, train, next_seed = [evaluate()], [], 10_000 * (seed + 1)
    for it in range(1, args.iterations + 1):
        envs, group_ids = [], []
        for g in range(args.n_groups):
            for _ in range(args.group_size):
                envs.append(make_env(data["env"]))
                envs[-1].reset(next_seed + g)
                group_ids.append(g)
        next_seed += args.n_groups
        with torch.no_grad():
            success, turns, score = play(envs, feats, w, 1.0, gen, budget)
        train.append(sum(success) / len(success))
        scores, gid = torch.tensor(score), torch.tensor(group_ids)
        adv = grpo(scores, gid, scale="group")
        std = torch.stack([scores[gid == g].std() for g in range(args.n_groups)])
        kept = select_groups(std, "top_p", args.top_p)[gid]
        # token-mean: every turn weighs the same (the SmolLM2 runs' loss_agg); seq-mean: every trajectory does
        targets = None
        if v is not None:  # --critic: GAE on a linear value of the same features instead of the group's baseline
            rows, targets = critic_rows(turns, score, kept, v, args.gae_lambda)
        else:
            rows = [(x, a, float(adv[i]) * (len(turns[i]) if args.agg == "token" else 1) / len(turns[i]))
                    for i in range(len(envs)) if kept[i] for x, a in turns[i]]
        if args.center and mean_direction is None:
            raw = torch.stack([x[:-1] for t in turns for x, _ in t])
            mean_direction = (raw.mean(0) / raw.mean(0).norm()).unsqueeze(-1)
            rows = [(torch.cat([project_out(x[:-1], mean_direction), x[-1:]]), a, adv) for x, a, adv in rows]
        if rows:
            x_all = torch.stack([r[0] for r in rows])
            a_all = torch.tensor([r[1] for r in rows])
            adv_all = torch.tensor([r[2] for r in rows])
            with torch.no_grad():
                old_all = torch.log_softmax(x_all @ w, -1)[torch.arange(len(rows)), a_all]
            # --ppo-epochs passes of --mini-batch rows each: the runs' PPO loss (clip-higher 0.2 / 0.28), which with
            # one pass of one mini-batch is the plain policy gradient of the sampling policy
            size = args.mini_batch or len(rows)
            for _ in range(args.ppo_epochs):
                perm = torch.randperm(len(rows), generator=shuffle) if size < len(rows) else torch.arange(len(rows))
                for start in range(0, len(rows), size):
                    idx = perm[start:start + size]
                    x, a, advantage, old = x_all[idx], a_all[idx], adv_all[idx], old_all[idx]
                    logps = torch.log_softmax(x @ w, -1)
                    logp = logps[torch.arange(len(idx)), a]
                    clipped, _ = ppo_clip(logp, old, advantage, torch.ones_like(logp, dtype=torch.bool))
                    entropy = -(logps.exp() * logps).sum(-1)
                    norm = len(idx) if args.agg == "token" else int(kept.sum()) * len(idx) / len(rows)
                    # KL(policy || start), the start uniform: k3 on the sampled action, 1/r - 1 + log r with
                    # r = 4 p (ragen_pl.losses.kl_penalty's estimator, without its clamp)
                    log_r = logp + math.log(4)
                    kl = (-log_r).exp() - 1 + log_r
                    loss = (clipped.sum() / norm - args.entropy_coeff * entropy.mean()
                            + args.kl_coeff * kl.mean())
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    if v is not None:
                        value_opt.zero_grad()
                        (x @ v - targets[idx]).pow(2).mean().backward()
                        value_opt.step()
        if it % args.eval_every == 0:
            curve.append(evaluate())
    return curve, train


def critic_rows(turns, score, kept, v, lam: float):
    """Turn rows ``(x, action, advantage)`` of the kept trajectories with GAE (discount 1, ``lam``) on the linear value
    ``x @ v`` (the episode's score as the reward of its last turn: FrozenLake's only reward), advantages normalised
    over the rows; and the value targets (the lambda-returns)."""
    import torch

    from ragen_pl.advantages import gae

    rows, targets, advantages = [], [], []
    for i, trajectory in enumerate(turns):
        if not kept[i] or not trajectory:
            continue
        xs = torch.stack([x for x, _ in trajectory])
        with torch.no_grad():
            values = xs @ v
        rewards = torch.zeros(1, len(xs))
        rewards[0, -1] = score[i]
        adv, returns = gae(rewards, values[None], torch.ones(1, len(xs), dtype=torch.bool), lam=lam)
        advantages.append(adv[0])
        targets.append(returns[0])
        rows += [(x, a) for x, a in trajectory]
    if not rows:
        return [], None
    adv = torch.cat(advantages)
    adv = (adv - adv.mean()) / (adv.std() + 1e-6) if len(adv) > 1 else adv
    return [(x, a, float(g)) for (x, a), g in zip(rows, adv)], torch.cat(targets)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=("frozenlake", "sokoban"), default="frozenlake")
    parser.add_argument("--goal", type=float, default=0.10, help="the gain over the random policy to reach")
    parser.add_argument("--features", nargs="+", choices=("onehot", "local", "llm"),
                        default=["onehot", "local", "llm"])
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.03, 0.1, 0.3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--n-groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--top-p", type=float, default=0.5, help="the variance filter's kept share of groups")
    parser.add_argument("--plays", type=int, default=4, help="plays per evaluation seed")
    parser.add_argument("--layer", type=int, default=30)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--entropy-coeff", type=float, default=0.0)
    parser.add_argument("--kl-coeff", type=float, default=0.0, help="KL to the starting (uniform) policy, k3")
    parser.add_argument("--common", type=float, default=None, metavar="EPS",
                        help="give the features SmolLM2's geometry: a fixed vector common to every board plus EPS "
                        "times the features (SmolLM2's last hidden state varies across boards by 0.064 of its "
                        "per-dimension size over 256 boards, 0.067 over 16: the README's runs used 0.067)")
    parser.add_argument("--center", action="store_true",
                        help="read the features less their component along their mean direction, fixed at the first "
                        "update (ReadoutHead's center with one kind of position)")
    parser.add_argument("--val-temperature", type=float, default=None,
                        help="evaluation temperature (default: the config's val_temperature)")
    parser.add_argument("--agg", choices=("token", "seq"), default="token",
                        help="token-mean (every turn weighs the same) or seq-mean (every trajectory does)")
    parser.add_argument("--model", choices=("raw", "warm"), default="raw",
                        help="llm features from SmolLM2-135M-Instruct itself, or from the config's format warm start "
                        "(the RL runs' step 0)")
    parser.add_argument("--feature-cache", default=None, metavar="FILE",
                        help="llm features: keep each board's hidden state in FILE and reuse it in later runs (a "
                        "file of another model, --layer or --env is refused; a state is computed once per board either way)")
    parser.add_argument("--pca", type=int, default=None, metavar="K",
                        help="llm features: keep the K leading principal directions of the standardised states (over "
                        "the same 256 first boards), each scaled to unit variance, instead of all of them")
    parser.add_argument("--head", choices=("standardised", "runs", "action"), default="standardised",
                        help="llm features: standardised, or as the runs' whitened head reads them (runs), or as it "
                        "would if fitted where the action is sampled (action); see the module's docstring")
    parser.add_argument("--bf16", action="store_true",
                        help="llm features: computed under CPU bf16 autocast, as the runs' bf16-mixed generation and "
                        "scoring compute them (default: float32)")
    parser.add_argument("--turn-text", action="store_true",
                        help="llm features: each turn's state as the runs' prompt of that turn gives it (Turn t, the "
                        "actions left), as the first-turn state of the board plus the mean shift of turn t's text "
                        "(measured on 32 boards); default: every turn reads its board's first-turn prompt")
    parser.add_argument("--critic", type=float, default=None, metavar="LR",
                        help="advantages from GAE on a linear value of the same features (Adam at LR, trained on the "
                        "lambda-returns in the same mini-batches) instead of the group's mean")
    parser.add_argument("--gae-lambda", type=float, default=None, help="--critic: GAE's lambda (discount 1; default 1)")
    parser.add_argument("--ppo-epochs", type=int, default=1, help="passes over each iteration's kept turns")
    parser.add_argument("--mini-batch", type=int, default=None,
                        help="turns per optimiser step (default: all kept turns of the iteration, one step a pass)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    optional = [name for name in ("mini_batch", "pca") if getattr(args, name) is not None]
    if args.critic is None:
        if args.gae_lambda is not None:
            parser.error("--gae-lambda is GAE's, which only --critic uses; give --critic LR too")
    else:
        if not args.critic > 0:
            parser.error(f"--critic must be a learning rate > 0, got {args.critic}")
        if args.gae_lambda is None:
            args.gae_lambda = 1.0
        if not 0 <= args.gae_lambda <= 1:
            parser.error(f"--gae-lambda must be in [0, 1], got {args.gae_lambda}")
        for flag, used in (("--agg seq", args.agg == "seq"), ("--center", args.center)):
            if used:
                parser.error(f"{flag} is not supported with --critic (each turn has its own advantage there)")
    if "llm" not in args.features:
        for flag, used in (("--turn-text", args.turn_text), ("--bf16", args.bf16), ("--pca", args.pca is not None),
                           ("--feature-cache", args.feature_cache is not None), ("--model", args.model != "raw"),
                           ("--head", args.head != "standardised")):
            if used:
                parser.error(f"{flag} applies to --features llm only; the features given are {args.features}")
    if args.head != "standardised":
        for flag, used in (("--pca", args.pca is not None), ("--common", args.common is not None),
                           ("--center", args.center)):
            if used:
                parser.error(f"--head {args.head} reads the states as the runs' head does; {flag} is another reading "
                             f"of them: give one")
    for name in ("iterations", "eval_every", "n_groups", "plays", "ppo_epochs", *optional):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.group_size < 2:
        parser.error(f"--group-size must be >= 2 (GRPO compares within a group), got {args.group_size}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    cfg = load_config(args.env)
    if args.val_temperature is None:
        args.val_temperature = cfg["data"].get("val_temperature", 1.0)
    baseline = random_success(cfg, 20)
    per_it = args.n_groups * args.group_size
    print(f"{args.env} ({cfg['data']['val_episodes']} evaluation seeds x {args.plays}, temperature "
          f"{args.val_temperature:g}): random policy {baseline:.3f}, goal {baseline + args.goal:.3f}; "
          f"{per_it} trajectories an iteration ({args.n_groups} groups x {args.group_size}), filter top "
          f"{args.top_p:g}", flush=True)
    for name in args.features:
        start = time.perf_counter()
        if name in ("onehot", "local"):
            features = OneHot() if name == "onehot" else Local()
        else:
            envs = [make_env(cfg["data"]["env"]) for _ in range(256)]
            for i, env in enumerate(envs):
                env.reset(random.Random(i).randrange(10**6))
            features = Hidden(cfg, args.layer, envs, args.pca, args.model, args.env, args.feature_cache, args.head,
                              args.bf16, args.turn_text)
            print(f"  SmolLM2 layer {args.layer} over {len(envs)} first boards: a dimension's mean size "
                  f"{features.size:.3f}, its standard deviation across boards {features.spread:.3f} "
                  f"({features.spread / features.size:.3f} of it)", flush=True)
        for lr in args.lrs:
            runs = [run(cfg, features, lr, seed, args) for seed in args.seeds]
            if isinstance(features, Hidden):
                features.save()
            curves = [c for c, _ in runs]
            k = min(10, args.iterations)
            first, last = (sum(sum(t[s]) / k for _, t in runs) / len(runs) for s in (slice(0, k), slice(-k, None)))
            mean = [sum(c[k] for c in curves) / len(curves) for k in range(len(curves[0]))]
            hit = next((k * args.eval_every for k, m in enumerate(mean) if m >= baseline + args.goal), None)
            points = ", ".join(f"{k * args.eval_every}: {m:.3f}" for k, m in enumerate(mean))
            reached = (f"goal at iteration {hit} ({hit * per_it} trajectories)" if hit is not None
                       else f"goal not reached in {args.iterations} ({args.iterations * per_it} trajectories)")
            print(f"  {name:6} lr {lr:<6g} {points}; {reached}; per seed final "
                  + " ".join(f"{c[-1]:.3f}" for c in curves) + f"; training success {first:.3f} -> {last:.3f}"
                  + f" ({time.perf_counter() - start:.0f} s so far)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
