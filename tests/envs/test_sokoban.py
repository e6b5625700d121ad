import random

import pytest

from ragen_pl.envs.sokoban import DEFAULT_SYMBOLS, Sokoban, solve

ROOM = """\
######
#_O__#
#_X__#
#_P__#
#____#
######"""


def test_same_seed_same_room_and_differs_across_seeds():
    a, b = Sokoban(), Sokoban()
    assert a.reset(7) == b.reset(7)
    assert len({Sokoban().reset(s) for s in range(50)}) > 40


def test_thousand_rooms_all_solvable_and_unsolved():
    env = Sokoban()
    lengths = []
    for seed in range(1000):
        env.reset(seed)
        assert not env.solved
        plan = solve(env)
        assert plan, f"seed {seed} gave an unsolvable room:\n{env.render()}"
        lengths.append(len(plan))
    assert sum(lengths) / len(lengths) > 3  # rooms need real pushing, not a single step


def test_solver_plan_actually_solves_through_step():
    env = Sokoban(dim_room=(8, 8), num_boxes=2)
    for seed in range(20):
        env.reset(seed)
        plan = solve(env)
        assert plan
        total = 0.0
        for i, action in enumerate(plan):
            _, reward, done, info = env.step(action)
            total += reward
            assert done == (i == len(plan) - 1)
        assert info["success"]


def test_render_symbols_and_load_round_trip():
    env = Sokoban()
    assert env.load(ROOM) == ROOM
    assert env.player == 3 * 6 + 2 and env.boxes == {2 * 6 + 2}


def test_push_onto_target_rewards():
    env = Sokoban()
    env.load(ROOM)
    # Up pushes the box from (2,2) onto the target at (1,2): -0.1 step +1 box on target +10 all boxes placed.
    obs, reward, done, info = env.step("up")
    assert reward == pytest.approx(10.9) and done and info["success"] and info["action_is_effective"]
    assert obs.splitlines()[1] == "#_√__#" and obs.splitlines()[2] == "#_P__#"


def test_push_off_target_and_walls():
    env = Sokoban()
    # Two boxes, one already on its target at (2,2); pushing it off costs 1.
    env.load("######\n#__O_#\n#_√P_#\n#____#\n#X___#\n######")
    _, reward, done, info = env.step("Left")  # push the placed box off its target into (2,1)
    assert reward == pytest.approx(-1.1) and not done and info["action_is_effective"]
    _, reward, _, info = env.step("Left")  # box at (2,1) against the wall: no move
    assert reward == pytest.approx(-0.1) and not info["action_is_effective"] and info["action_is_valid"]
    env.load("######\n#____#\n#PXX_#\n#_OO_#\n#____#\n######")
    _, reward, _, info = env.step("Right")  # box into another box: blocked
    assert not info["action_is_effective"] and env.player == 2 * 6 + 1


def test_no_pulling():
    env = Sokoban()
    env.load("######\n#____#\n#XP__#\n#_O__#\n#____#\n######")
    env.step("Right")
    assert env.boxes == {2 * 6 + 1}  # the box stayed


def test_invalid_action_is_a_noop():
    env = Sokoban()
    obs = env.reset(0)
    for bad in ("", "jump", "Up Up", "<answer>Up</answer>"):
        assert env.step(bad) == (obs, 0.0, False, {"success": False, "action_is_valid": False,
                                                    "action_is_effective": False})
    assert env.steps == 0


def test_max_steps_ends_episode():
    env = Sokoban(max_steps=3)
    env.reset(0)
    rng = random.Random(0)  # its own: the global one's state depends on the tests before (3 random moves can solve)
    steps = [env.step(rng.choice(env.actions)) for _ in range(3)]
    assert [done for _, _, done, _ in steps] == [False, False, True] and not steps[-1][3].get("success")
    assert env.step("Up")[3]["action_is_valid"] is False


def test_other_symbols_variant_is_a_config():
    symbols = dict(zip(DEFAULT_SYMBOLS, "@.*+$AB"))
    a, b = Sokoban(symbols=symbols), Sokoban()
    obs_a, obs_b = a.reset(3), b.reset(3)
    table = str.maketrans({DEFAULT_SYMBOLS[k]: v for k, v in symbols.items()})
    assert obs_a == obs_b.translate(table)
    assert "@ wall" in a.instructions


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dim_room": (3, 6)}, r"`dim_room\[0\]` must be an integer in \[4, 64\], got 3"),
        ({"dim_room": 6}, r"`dim_room` must be \(rows, cols\), got 6"),
        ({"num_boxes": 0}, r"`num_boxes` must be an integer in \[1, 10\], got 0"),
        ({"num_boxes": 8}, r"`num_boxes` 8 does not fit a 6x6 room; at most 7 boxes fit"),
        ({"max_steps": 1.5}, r"`max_steps` must be an integer >= 1, got 1.5"),
        ({"symbols": {"wall": "#"}}, r"`symbols` must have exactly the keys"),
        ({"symbols": dict(zip(DEFAULT_SYMBOLS, "#######"))}, r"`symbols` values must be distinct"),
    ],
)
def test_bad_config_names_the_field(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Sokoban(**kwargs)


@pytest.mark.parametrize("dims, boxes, depth, rooms, ragen_mean",
                         [((6, 6), 1, 300, 1000, 3.98), ((8, 8), 2, 10, 500, 5.84)])
def test_difficulty_matches_ragen(dims, boxes, depth, rooms, ragen_mean):
    """RAGEN's generator, measured on its own code (issue 11): mean optimal solution 3.98 moves for 6x6 / 1 box and
    5.84 for its 8x8 / 2-box variant (search depth 10); no room starts with a box on a target."""
    from ragen_pl.envs.sokoban import TARGET, solve

    env = Sokoban(dim_room=dims, num_boxes=boxes, search_depth=depth)
    lengths = []
    for seed in range(rooms):  # integer logic and Python's own RNG: the same rooms on every machine
        env.reset(seed)
        assert not any(env.fixed[b] == TARGET for b in env.boxes), seed
        plan = solve(env)
        assert plan, seed  # solvable by construction
        lengths.append(len(plan))
    mean = sum(lengths) / len(lengths)
    assert abs(mean - ragen_mean) < 0.2, mean
    assert sum(n <= 10 for n in lengths) / len(lengths) >= 0.98


def test_cell_separator_spells_the_same_rooms_and_loads_them():
    """`cell_separator=" "`: the same rooms and moves, written with every cell apart; `load` reads that spelling."""
    plain, spaced = Sokoban(), Sokoban(cell_separator=" ")
    for seed in range(20):
        a, b = plain.reset(seed), spaced.reset(seed)
        assert b == "\n".join(" ".join(row) for row in a.splitlines())
        for action in ("Up", "Left", "Down", "Right", "Up"):
            (a, ra, da, ia), (b, rb, db, ib) = plain.step(action), spaced.step(action)
            assert b.replace(" ", "") == a and (ra, da, ia) == (rb, db, ib)
    spaced_room = "\n".join(" ".join(row) for row in ROOM.splitlines())
    assert spaced.load(spaced_room) == spaced_room
    assert spaced.player == 3 * 6 + 2 and spaced.boxes == {2 * 6 + 2}
    with pytest.raises(ValueError, match="no grid symbol"):
        Sokoban(cell_separator="#")


def test_effective_actions_are_the_moves_that_move_the_player():
    env = Sokoban()
    env.load("######\n#____#\n#PXX_#\n#_OO_#\n#____#\n######")  # wall left, box then box right
    assert set(env.effective_actions()) == {"Up", "Down"}
    env.load("######\n#__O_#\n#_√P_#\n#____#\n#X___#\n######")  # box on target left, free behind it
    assert set(env.effective_actions()) == {"Up", "Down", "Left", "Right"}
    env.load("######\n#XP__#\n#____#\n#_O__#\n#____#\n######")  # wall up, box against the wall left
    assert set(env.effective_actions()) == {"Down", "Right"}
    rng = random.Random(0)
    for seed in range(40):  # reference: apply each action to a copy of the state and see whether the player moved
        env.reset(seed)
        for _ in range(8):
            if env.solved:  # (every move is refused once solved)
                break
            room, moving = env.render(), set()
            for a in env.actions:
                env.load(room)
                moving |= {a} if env.step(a)[3]["action_is_effective"] else set()
            env.load(room)
            assert set(env.effective_actions()) == moving, room
            env.step(rng.choice(env.actions))
