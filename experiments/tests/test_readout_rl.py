"""ragen_pl_experiments.research.readout_rl: the readout learner learns what it can represent, its hand-made features say what they
claim, and bad flags are refused in one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def readout_rl(monkeypatch):
    import ragen_pl_experiments.research.readout_rl as readout_rl

    return readout_rl


@pytest.fixture
def tiny_boards(readout_rl, tiny_model_path, monkeypatch):
    """The FrozenLake config and 3 of its boards, with the tiny model standing in for SmolLM2."""
    import ragen_pl.models.smollm2
    from ragen_pl.envs.frozen_lake import FrozenLake

    monkeypatch.setattr(ragen_pl.models.smollm2, "build_smollm2", lambda: tiny_model_path)
    boards = []
    for seed in range(3):
        boards.append(FrozenLake(size=4, cell_separator=" "))
        boards[-1].reset(seed)
    return readout_rl.load_config("frozenlake"), boards


@pytest.mark.parametrize("flags, lr", [([], 0.1), (["--ppo-epochs", "4", "--mini-batch", "8"], 0.03),
                                       (["--critic", "0.1", "--gae-lambda", "0.5", "--top-p", "1"], 0.1)])
def test_learns_a_fixed_map(readout_rl, flags, lr):
    """One map, always the same (3x3, no holes, corner start and goal, no slip): the player's cell one-hot is the whole
    state, so the linear policy is a table and GRPO must find the way. Uniform play wins 0.09 with 6 actions; after
    10 iterations the policy won 0.92-0.98 on seeds 0-4 (one step an iteration; with 4 passes of mini-batches of 8 at
    lr 0.03: 1.00 on each; with the linear critic's GAE instead of the group baseline: 0.94-1.00), so 0.6 leaves room
    for another float path."""
    cfg = {"data": {"env": {"class_path": "ragen_pl.envs.frozen_lake.FrozenLake",
                            "init_args": {"size": 3, "slippery": False, "layout": "corners", "frozen_prob": 1.0}},
                    "rollout": {"max_actions_per_episode": 6}, "val_episodes": 16, "val_seed": 1_000_000}}
    args = readout_rl.parse_args(["--iterations", "10", "--eval-every", "10", "--plays", "2", "--val-temperature",
                                  "1", *flags])
    torch.manual_seed(0)
    curve, train = readout_rl.run(cfg, readout_rl.OneHot(), lr, 0, args)
    assert len(curve) == 2 and len(train) == 10
    assert curve[0] < 0.3
    assert curve[-1] >= 0.6, curve


def test_local_features_frozen_lake(readout_rl):
    from ragen_pl.envs.frozen_lake import FrozenLake

    env = FrozenLake(size=4)
    env.reset(0)
    env.holes, env.pos, env.goal = frozenset({(1, 0)}), (0, 0), (3, 2)
    x = readout_rl.Local()([env])[0]
    # per direction (Left, Down, Right, Up): off the map, frozen, hole, goal
    assert x[:16].view(4, 4).argmax(1).tolist() == [0, 2, 1, 0]
    assert x[:16].sum() == 4
    # the goal lies down (+) and right (+): sign cell (+1, +1) of the 3x3 grid = index 8
    assert x[16:].tolist() == [0.0] * 8 + [1.0]
    env.pos = (3, 1)  # the goal just to the right, same row
    x = readout_rl.Local()([env])[0]
    assert x[:16].view(4, 4).argmax(1).tolist() == [1, 0, 3, 1]
    assert x[16:].argmax().item() == 3 * 1 + 2  # row offset 0, column offset +


def test_local_features_sokoban(readout_rl):
    from ragen_pl.envs.sokoban import Sokoban

    env = Sokoban()
    env.load("######\n#P X_#\n#__O_#\n#____#\n#____#\n######".replace(" ", "_"))
    x = readout_rl.Local()([env])[0]
    near = x[:40].view(4, 2, 5)  # (Up, Down, Left, Right) x (neighbour, beyond) x (wall, floor, target, box, on target)
    assert near[:, 0].argmax(1).tolist() == [0, 1, 0, 1]  # wall above, floor below, wall left, floor right
    assert near[:, 1].sum() == 0  # no box next to the player: nothing beyond counts
    box, target = x[40:49], x[49:58]
    assert box.argmax().item() == 3 * 1 + 2  # the box is on the player's row, to the right
    assert target.argmax().item() == 3 * 2 + 1  # the target is below the box, same column


def test_temperature_zero_plays_greedy(readout_rl):
    """Evaluation at temperature 0 takes the argmax, as the engines do (it used to divide by zero)."""
    from ragen_pl.envs.frozen_lake import FrozenLake

    envs = []
    for seed in range(8):
        envs.append(FrozenLake(size=4))
        envs[-1].reset(seed)
    w = torch.zeros(2, 4)
    w[0, 2] = 1.0  # every board prefers Right
    moves: list[int] = []
    _, turns, _ = readout_rl.play(envs, lambda es, turn: torch.ones(len(es), 2), w, 0.0, torch.Generator(), 3)
    for t in turns:
        moves += [a for _, a in t]
    assert moves and set(moves) == {2}


def test_pca_basis_whitens_the_leading_directions(readout_rl):
    """Three directions of variance 9, 4 and 1 in 5 dimensions (rotated): the basis keeps the first two, and the
    projected rows have the identity as covariance; the kept directions are the two largest."""
    g = torch.Generator().manual_seed(0)
    rotation, _ = torch.linalg.qr(torch.randn(5, 5, generator=g))
    scales = torch.tensor([3.0, 2.0, 1.0, 0.0, 0.0])
    z = (torch.randn(4000, 5, generator=g) * scales) @ rotation.T + 7.0
    basis = readout_rl.pca_basis(z, 2)
    y = (z - z.mean(0)) @ basis
    torch.testing.assert_close(torch.cov(y.T), torch.eye(2), atol=1e-4, rtol=0)
    # each kept direction lies along a column of the rotation, the variance-9 one first
    directions = basis / basis.norm(dim=0)
    assert abs(float(directions[:, 0] @ rotation[:, 0])) > 0.99
    assert abs(float(directions[:, 1] @ rotation[:, 1])) > 0.99


def test_critic_rows_are_gae_on_the_linear_value(readout_rl):
    """``--critic``: GAE with discount 1 on ``x @ v``, the episode's score as its last turn's reward, by hand: values
    0.2, 0.5, 0.1 and score 1 give deltas 0.3, -0.4, 0.9, so with lambda 0.5 the advantages are 0.325, 0.05, 0.9 and
    the targets (advantage + value) 0.525, 0.55, 1.0; a trajectory the filter dropped gives no row; the advantages
    are normalised over the rows."""
    v = torch.tensor([0.2, 0.5, 0.1, 0.0])
    xs = torch.eye(4)
    turns = [[(xs[0], 1), (xs[1], 2), (xs[2], 0)], [(xs[3], 3)]]
    rows, targets = readout_rl.critic_rows(turns, [1.0, 1.0], torch.tensor([True, False]), v, 0.5)
    torch.testing.assert_close(targets, torch.tensor([0.525, 0.55, 1.0]))
    adv = torch.tensor([0.325, 0.05, 0.9])
    torch.testing.assert_close(torch.tensor([r[2] for r in rows]), (adv - adv.mean()) / (adv.std() + 1e-6))
    assert [r[1] for r in rows] == [1, 2, 0] and all(torch.equal(r[0], x) for r, x in zip(rows, xs))


@pytest.mark.parametrize("flags, message", [
    (["--critic", "0"], "--critic must be a learning rate > 0"),
    (["--critic", "0.1", "--gae-lambda", "1.5"], r"--gae-lambda must be in \[0, 1\]"),
    (["--gae-lambda", "0.5"], "--gae-lambda is GAE's, which only --critic uses"),
    (["--critic", "0.1", "--agg", "seq"], "--agg seq is not supported with --critic"),
    (["--group-size", "1"], "--group-size must be >= 2"),
    (["--ppo-epochs", "0"], "--ppo-epochs must be >= 1"),
    (["--mini-batch", "0"], "--mini-batch must be >= 1"),
    (["--pca", "0"], "--pca must be >= 1"),
    (["--head", "runs", "--pca", "8"], "--head runs reads the states as the runs' head does; --pca is another"),
    (["--head", "action", "--center"], "--head action reads .*; --center is another"),
    (["--iterations", "0"], "--iterations must be >= 1"),
    (["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
    (["--features", "local", "--turn-text"], r"--turn-text applies to --features llm only; the features given are "
                                              r"\['local'\]"),
    (["--features", "onehot", "local", "--bf16"], r"--bf16 applies to --features llm only"),
])
def test_bad_flags_refused(readout_rl, capsys, flags, message):
    with pytest.raises(SystemExit):
        readout_rl.parse_args(flags)
    assert re.search(message, capsys.readouterr().err)


def test_feature_cache_is_reused_and_refused_for_another_source(readout_rl, tiny_boards, tmp_path):
    """``--feature-cache``: the states of one model and layer come back from the file instead of the model, and a
    file of another layer is refused in one line naming the flag (it used to be read whatever it held)."""
    cfg, boards = tiny_boards
    cache = tmp_path / "states.pt"
    first = readout_rl.Hidden(cfg, 1, boards, cache=str(cache))
    first.save()
    again = readout_rl.Hidden(cfg, 1, boards, cache=str(cache))
    assert again.known.keys() == first.known.keys() and len(again.known) == 3
    again.model = None  # every state comes from the file: a forward would fail
    torch.testing.assert_close(again(boards), first(boards))
    with pytest.raises(SystemExit, match=r"^error: --feature-cache .*states\.pt: holds states of .*'layer': 1.*"
                                         r"give another file$"):
        readout_rl.Hidden(cfg, 2, boards, cache=str(cache))


def test_bf16_states_are_computed_under_autocast(readout_rl, tiny_boards, tmp_path):
    """``--bf16``: the states come from a bf16 autocast forward (rounded, so not the float32 ones, yet near them),
    and a cache of float32 states is refused for them rather than read as if they were bf16."""
    cfg, boards = tiny_boards
    cache = tmp_path / "states.pt"
    exact = readout_rl.Hidden(cfg, 1, boards, cache=str(cache))
    exact.save()
    rounded = readout_rl.Hidden(cfg, 1, boards, bf16=True)
    a, b = torch.stack([exact.known[o] for o in sorted(exact.known)]), torch.stack(
        [rounded.known[o] for o in sorted(rounded.known)])
    assert not torch.equal(a, b)
    torch.testing.assert_close(b, a, atol=0.1, rtol=0.1)
    with pytest.raises(SystemExit, match=r"^error: --feature-cache .*'precision': 'bf16-mixed'.*give another file$"):
        readout_rl.Hidden(cfg, 1, boards, cache=str(cache), bf16=True)


def test_head_input_by_hand(readout_rl):
    """``--head``: what the runs' whitened head reads, on states of 2 boards x 2 scored positions, hand-derived.
    h = [10, x, y]: x is (2, 0) at the action position and (-1, -1) after it, y is (1, -1) and (2, -2). The second
    moment is diag(400) beside [[6, 2], [2, 10]] with no cross term to e1, so its leading direction is e1; less it,
    the rows are (0, x, y), whose root mean squares over all 4 are sqrt(6/4) and sqrt(10/4) (the first, 0, is floored
    to 0.01 of the mean). Fitted at the action: its rows less e1 have mean (0, 1, 0), so e2 goes too, and what is
    left is y = +-1: scale 1 there, the floor 0.01/3 elsewhere."""
    h = torch.tensor([[[10, 2, 1], [10, -1, 2]], [[10, 0, -1], [10, -1, -2]]], dtype=torch.float64)
    directions, scale = readout_rl.head_input(h, 1, at_action=False)
    torch.testing.assert_close(directions.abs(), torch.tensor([[1.0], [0.0], [0.0]], dtype=torch.float64))
    rms = [1.5 ** 0.5, 2.5 ** 0.5]
    torch.testing.assert_close(scale, torch.tensor([0.01 * sum(rms) / 3, *rms], dtype=torch.float64))
    directions, scale = readout_rl.head_input(h, 1, at_action=True)
    torch.testing.assert_close(directions.abs(), torch.eye(3, dtype=torch.float64)[:, :2])
    torch.testing.assert_close(scale, torch.tensor([0.01 / 3, 0.01 / 3, 1.0], dtype=torch.float64))


def test_head_reading_of_the_states_is_cached(readout_rl, tiny_boards, monkeypatch, tmp_path):
    """``--head runs``: the states come out as ``(h - U U^T h) / s`` of :func:`head_input` fitted on 128 boards' first
    turns, which the feature cache keeps (the second reading runs no model); a layer other than the last, which the
    head does not read, is refused in one line."""
    from ragen_pl_experiments.readout import project_out

    cfg, boards = tiny_boards
    cache = tmp_path / "states.pt"
    first = readout_rl.Hidden(cfg, 2, boards, cache=str(cache), head="runs")
    assert first.scored.shape[0] == 128 and first.scored.shape[1] >= 2  # the action, then the closing tag's tokens
    directions, scale = readout_rl.head_input(first.scored.double(), readout_rl.readout(cfg)["center"], False)
    raw = torch.stack([first.known[b.render()] for b in boards]).double()
    torch.testing.assert_close(first(boards), (project_out(raw, directions) / scale).float())
    first.save()
    import ragen_pl_experiments.research.head_geometry as head_geometry
    monkeypatch.setattr(head_geometry, "scored_hidden_states", lambda *a: pytest.fail("the cache held them"))
    again = readout_rl.Hidden(cfg, 2, boards, cache=str(cache), head="runs")
    torch.testing.assert_close(again(boards), first(boards))
    with pytest.raises(SystemExit, match=r"^error: --head runs reads the last hidden state, what the head reads: "
                                         r"--layer must be 2, got 1$"):
        readout_rl.Hidden(cfg, 1, boards, head="runs")


@pytest.mark.parametrize("header", [True, False])
def test_turn_prompt_is_what_the_rollout_feeds(readout_rl, tiny, monkeypatch, header):
    """``probe_reading.turn_prompt``: the token ids the collector feeds at each turn of the FrozenLake config's
    window-1 rollout (rules, ``Reward: 0``, ``Turn t``, the board, the actions left; or, with ``turn_header``
    false, the rules and the board), turn by turn."""
    import ragen_pl_experiments.research.probe_reading as probe_reading

    from ragen_pl.config import RolloutConfig
    from ragen_pl.envs.frozen_lake import FrozenLake
    from ragen_pl.rollout.collector import Collector, EpisodeSpec
    from tests.rollout.test_collector import Recording, Scripted

    _, tok = tiny
    cfg = readout_rl.load_config("frozenlake")
    cfg["data"]["rollout"]["turn_header"] = header
    engine = Recording(Scripted(tok, lambda turn, _: "Up</answer>"))
    Collector(engine, tok, RolloutConfig(**cfg["data"]["rollout"])).collect(
        [EpisodeSpec(FrozenLake(size=4, cell_separator=" "), seed=3, group_id=0)])
    env = FrozenLake(size=4, cell_separator=" ")
    obs, compared = env.reset(3), 0
    for turn, (prompts, _) in enumerate(engine.calls, start=1):
        assert prompts[0] == probe_reading.turn_prompt(cfg, tok, env, obs, turn), turn
        compared += 1
        obs, reward, done, _ = env.step("Up")
        if done or reward:
            break
    assert compared >= 3


def test_turn_text_offsets_by_hand(readout_rl, tiny_boards, tmp_path):
    """``--turn-text``: row t of the offsets is the mean over the boards of the state of turn t + 1's prompt less
    turn 1's (row 0 zero); a turn reads its board's first-turn state plus its row, standardised over every board at
    every turn; the offsets are cached with the states."""
    import ragen_pl_experiments.research.probe_reading as probe_reading

    cfg, boards = tiny_boards
    cache = tmp_path / "states.pt"
    hidden = readout_rl.Hidden(cfg, 1, boards, cache=str(cache), turn_text=True)
    turns = cfg["data"]["rollout"]["max_turns"]
    states = probe_reading.prompt_states(hidden.model, hidden.tok, [
        probe_reading.turn_prompt(cfg, hidden.tok, b, b.render(), t) for b in boards for t in range(1, turns + 1)],
        [1])[:, 0].reshape(len(boards), turns, -1)
    offsets = (states - states[:, :1]).mean(0)
    assert hidden.offsets.shape == (turns, states.shape[-1]) and not hidden.offsets[0].any()
    torch.testing.assert_close(hidden.offsets, offsets, atol=1e-5, rtol=1e-5)
    first = torch.stack([hidden.known[b.render()] for b in boards])
    every = (first.unsqueeze(1) + offsets).reshape(-1, first.shape[-1])
    mean, std = every.mean(0), every.std(0) + 1e-6
    torch.testing.assert_close(hidden(boards, 4), (first + offsets[4] - mean) / std, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(hidden(boards, 4), hidden(boards, 0))
    hidden.save()
    again = readout_rl.Hidden(cfg, 1, boards, cache=str(cache), turn_text=True)
    again.model = None  # the states and the offsets come from the file
    torch.testing.assert_close(again(boards, 4), hidden(boards, 4))
    plain = readout_rl.Hidden(cfg, 1, boards, cache=str(cache))
    torch.testing.assert_close(plain(boards, 4), plain(boards, 0))  # without the flag, every turn reads turn 1's
