import pytest

from ragen_pl.envs.frozen_lake import FrozenLake, shortest_path, value_iteration


def test_same_seed_same_map():
    assert FrozenLake().reset(5) == FrozenLake().reset(5)
    assert len({FrozenLake().reset(s) for s in range(100)}) > 50


def test_every_map_has_a_path_and_render_symbols():
    env = FrozenLake(size=6)
    for seed in range(300):
        obs = env.reset(seed)
        rows = obs.splitlines()
        (sr, sc), (gr, gc) = env.start, env.goal
        assert rows[sr][sc] == "P" and rows[gr][gc] == "G" and len(rows) == 6
        assert set(obs) <= set("P_OG\n")
        assert shortest_path(env) is not None


def test_not_slippery_follows_shortest_path_to_goal():
    env = FrozenLake(slippery=False)
    for seed in range(50):
        env.reset(seed)
        plan = shortest_path(env)
        for i, action in enumerate(plan):
            obs, reward, done, info = env.step(action)
            assert done == (i == len(plan) - 1)
        assert reward == 1.0 and info["success"] and obs.splitlines()[env.goal[0]][env.goal[1]] == "√"


def test_hole_ends_episode_with_x():
    env = FrozenLake(slippery=False, layout="corners")
    for seed in range(200):
        env.reset(seed)
        if (0, 1) in env.holes:
            obs, reward, done, info = env.step("Right")
            assert done and reward == 0.0 and not info["success"] and obs[1] == "X"
            return
    pytest.fail("no map with a hole at (0, 1) in 200 seeds")


def test_slip_frequencies():
    """Intended move 1/3, each perpendicular move 1/3, never backwards (binomial 5-sigma bounds)."""
    env = FrozenLake(size=5, frozen_prob=1.0, layout="corners")
    counts = {"Down": 0, "Left": 0, "Right": 0, "Up": 0}
    n = 6000
    for i in range(n):
        env.reset(i)
        env.pos = (2, 2)  # centre of an all-frozen map: every move is effective
        env.step("Down")
        moved = {(3, 2): "Down", (2, 1): "Left", (2, 3): "Right", (1, 2): "Up"}[env.pos]
        counts[moved] += 1
    sigma = (n * (1 / 3) * (2 / 3)) ** 0.5
    for name in ("Down", "Left", "Right"):
        assert abs(counts[name] - n / 3) < 5 * sigma, counts
    assert counts["Up"] == 0


def test_value_iteration_success_probabilities():
    env = FrozenLake(slippery=False)
    env.reset(0)
    values, policy = value_iteration(env)
    assert values[env.start] == pytest.approx(1.0)  # deterministic moves: a path exists, so success is certain
    slippery = FrozenLake(slippery=True, frozen_prob=1.0)
    slippery.reset(0)
    values, _ = value_iteration(slippery)
    assert values[slippery.start] == pytest.approx(1.0, abs=1e-6)  # no holes: the goal is reached eventually


def test_invalid_action():
    env = FrozenLake()
    obs = env.reset(0)
    assert env.step("Jump")[3]["action_is_valid"] is False and env.steps == 0 and env.render() == obs


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"size": 1}, r"`size` must be an integer in \[2, 64\], got 1"),
        ({"frozen_prob": 1.5}, r"`frozen_prob` must be in \[0.0, 1.0\], got 1.5"),
        ({"frozen_prob": 0.2}, r"`frozen_prob` must be >= 0.5"),
        ({"slippery": "yes"}, r"`slippery` must be true or false, got 'yes'"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FrozenLake(**kwargs)


def test_ragen_layout_random_start_and_goal():
    """RAGEN draws start and goal at random on each map: mean shortest path 2.78 moves on 4x4 (issue 11)."""
    from ragen_pl.envs.frozen_lake import _path

    env = FrozenLake()
    starts, goals, lengths = set(), set(), []
    for seed in range(2000):
        env.reset(seed)
        assert env.pos == env.start != env.goal and env.start not in env.holes and env.goal not in env.holes
        starts.add(env.start)
        goals.add(env.goal)
        lengths.append(len(_path(env.size, env.holes, env.start, env.goal)) - 1)
    assert len(starts) == len(goals) == 16  # every tile can be either
    assert abs(sum(lengths) / len(lengths) - 2.78) < 0.15


def test_corners_layout_is_gymnasiums():
    env = FrozenLake(layout="corners")
    for seed in range(50):
        env.reset(seed)
        assert (env.start, env.goal) == ((0, 0), (3, 3))
    with pytest.raises(ValueError, match=r"`layout` must be 'random' or 'corners', got 'middle'"):
        FrozenLake(layout="middle")  # type: ignore[arg-type]


def test_cell_separator_spells_the_same_states():
    """`cell_separator=" "` writes every cell apart (one BPE token each) and changes nothing else: the same maps,
    the same slips and rewards, the same text once the separators are taken out."""
    import random

    plain, spaced = FrozenLake(), FrozenLake(cell_separator=" ")
    rng = random.Random(0)
    for seed in range(30):
        a, b = plain.reset(seed), spaced.reset(seed)
        assert b == "\n".join(" ".join(row) for row in a.splitlines())
        for _ in range(10):
            action = rng.choice(FrozenLake.actions)
            (a, ra, da, ia), (b, rb, db, ib) = plain.step(action), spaced.step(action)
            assert b.replace(" ", "") == a and (ra, da, ia) == (rb, db, ib)
            if da:
                break


@pytest.mark.parametrize("sep, match", [("\n", "no newline"), ("_", "no grid symbol"), (" " * 5, "at most 4"),
                                        (1, "must be a string")])
def test_bad_cell_separator_names_the_field(sep, match):
    with pytest.raises((TypeError, ValueError), match=rf"`cell_separator` {match}|`cell_separator` must .*{match}"):
        FrozenLake(cell_separator=sep)


def test_effective_actions_are_the_moves_that_stay_on_the_map():
    env = FrozenLake(size=4, slippery=False)
    env.reset(0)
    for pos, expected in [((0, 0), {"Down", "Right"}), ((0, 2), {"Left", "Down", "Right"}),
                          ((3, 3), {"Left", "Up"}), ((1, 2), {"Left", "Down", "Right", "Up"})]:
        env.pos = pos
        assert set(env.effective_actions()) == expected, pos
    for seed in range(30):  # reference: on ice that does not slip, an effective action is one that moves the player
        env.reset(seed)
        for pos in [(r, c) for r in range(4) for c in range(4) if (r, c) not in env.holes | {env.goal}]:
            moving = set()
            for a in env.actions:
                env.pos, env.steps = pos, 0
                moving |= {a} if env.step(a)[3]["action_is_effective"] else set()
            env.pos = pos
            assert set(env.effective_actions()) == moving
