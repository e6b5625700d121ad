import threading
import time

import pytest
import torch

from ragen_pl.config import RolloutConfig
from ragen_pl.envs.bandit import Bandit
from ragen_pl.envs.base import Env
from ragen_pl.envs.frozen_lake import FrozenLake
from ragen_pl.envs.sokoban import Sokoban
from ragen_pl.rollout.chat import WindowChat
from ragen_pl.rollout.collector import Collector, EpisodeSpec
from ragen_pl.rollout.engine import Generation, RolloutEngine
from ragen_pl.rollout.hf import HFEngine
from ragen_pl.rollout.prompt import first_user_message, format_instruction
from ragen_pl.sft import demonstrations


class Recording(RolloutEngine):
    """Wraps an engine and records every prompt fed and every continuation sampled."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    @property
    def model(self):  # the wrapped engine's model (the collector reads its context length)
        return self.inner.model

    def generate(self, prompts, params):
        gens = self.inner.generate(prompts, params)
        self.calls.append(([list(p) for p in prompts], [list(g.token_ids) for g in gens]))
        return gens

    def end_rollout(self):
        self.inner.end_rollout()


class Scripted(RolloutEngine):
    """Answers with fixed texts: `script(turn, prompt_text)` -> completion text after the opening tag."""

    def __init__(self, tok, script):
        self.tok, self.script, self.turn = tok, script, 0

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = self.script(self.turn, self.tok.decode(p))
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            out.append(Generation(ids, [-1.0] * len(ids), "stop"))
        self.turn += 1
        return out


def test_update_sequence_is_exactly_what_was_fed_and_sampled(tiny):
    model, tok = tiny
    engine = Recording(HFEngine(seed=1))
    engine.inner.bind(model, tok)
    config = RolloutConfig(max_turns=3, max_new_tokens=10)
    specs = [EpisodeSpec(Sokoban(), seed=s, group_id=s) for s in range(6)]
    result = Collector(engine, tok, config).collect(specs)
    assert_exact_accounting(engine, result)


def test_kept_prefixes_change_nothing_but_the_prefill(tiny):
    """The same seeded multi-turn rollout with and without the engine's kept prefixes: the same batch, a fraction of
    the prompt tokens fed, nothing kept once the rollout ends."""
    model, tok = tiny
    config = RolloutConfig(max_turns=3, max_new_tokens=10)
    specs = [EpisodeSpec(Sokoban(), seed=s // 2, group_id=s // 2) for s in range(6)]
    runs = []
    for keep in (True, False):
        engine = HFEngine(seed=4, prefix_cache=keep)
        engine.bind(model, tok)
        batch = Collector(engine, tok, config).collect(specs).batch
        runs.append((batch, engine.prefilled_tokens))
        assert engine.prefix is None or len(engine.prefix) == 0
    (kept, fed_kept), (whole, fed_whole) = runs
    assert torch.equal(kept.input_ids, whole.input_ids) and torch.equal(kept.loss_mask, whole.loss_mask)
    assert int(kept.turn_ids.max()) == 2  # some trajectory reached the third turn
    assert fed_kept < 0.6 * fed_whole


@pytest.mark.parametrize("window", [None, 1, 2])
def test_the_engine_keeps_only_what_the_next_turn_extends(tiny, window):
    """The collector tells the engine whether the next turn's prompts extend this turn's (not on the last turn, nor
    once a context window drops turns): the same batch and the same prompt tokens fed as an engine that keeps every
    call's KV, and nothing kept that no later call reads."""
    model, tok = tiny
    config = RolloutConfig(max_turns=3, max_new_tokens=10, context_window=window)
    specs = [EpisodeSpec(Sokoban(), seed=s // 2, group_id=s // 2) for s in range(6)]
    runs = []
    for hinted in (True, False):
        engine = HFEngine(seed=4)
        engine.bind(model, tok)
        kept, generate = [], engine.generate

        def counting(prompts, params, engine=engine, kept=kept, generate=generate):
            gens = generate(prompts, params)
            kept.append(len(engine.prefix))
            return gens

        engine.generate = counting
        if not hinted:
            engine.next_call_extends = lambda extends: None  # an engine that ignores the hint keeps everything
        runs.append((Collector(engine, tok, config).collect(specs).batch, engine.prefilled_tokens, kept))
    (hinted, fed, kept), (plain, fed_plain, kept_plain) = runs
    assert torch.equal(hinted.input_ids, plain.input_ids) and torch.equal(hinted.loss_mask, plain.loss_mask)
    assert fed == fed_plain  # nothing that a later turn read was dropped
    extends = min(3, window or 3) - 1  # calls whose sequences the next call extends
    assert len(kept) == 3 and all(k > 0 for k in kept_plain)
    assert kept == kept_plain[:extends] + [0] * (3 - extends)


def assert_exact_accounting(engine: Recording, result) -> None:
    """Every update row is exactly the prompts fed and the tokens sampled (never re-tokenised), and the loss mask
    is true on exactly the sampled tokens, turn by turn."""
    batch = result.batch
    # Follow each trajectory through the engine calls (live envs keep their order in every call).
    live = list(range(len(result.episodes)))
    pieces = {i: [] for i in live}
    for prompts, gens in engine.calls:
        assert len(prompts) == len(live)
        for i, p, g in zip(live, prompts, gens):
            pieces[i].append((p, g))
        live = [i for i in range(len(result.episodes)) if len(pieces[i]) < result.episodes[i].turns]
    for b, ep in enumerate(result.episodes):
        ids = batch.input_ids[b][batch.attention_mask[b]].tolist()
        mask = batch.loss_mask[b][batch.attention_mask[b]].tolist()
        expected_mask = []
        for k, (prompt, sampled) in enumerate(pieces[b]):
            assert ids[:len(prompt)] == prompt  # every prompt fed is a prefix of the update sequence
            assert ids[len(prompt):len(prompt) + len(sampled)] == sampled  # followed by exactly what was sampled
            expected_mask = expected_mask + [False] * (len(prompt) - len(expected_mask)) + [True] * len(sampled)
            turn_of = batch.turn_ids[b, len(prompt):len(prompt) + len(sampled)]
            assert bool((turn_of == k).all())
        last_prompt, last_sampled = pieces[b][-1]
        assert ids == last_prompt + last_sampled  # and nothing else
        assert mask == expected_mask  # the loss mask covers exactly the sampled tokens
        assert ep.turns == len(pieces[b])


def test_rewards_penalties_and_budgets(tiny):
    _, tok = tiny
    answers = {0: "go</think><answer>Up || Jump || Left</answer>", 1: "bad format", 2: "x</think><answer>Down</answer>"}
    engine = Scripted(tok, lambda turn, _: answers[turn])
    config = RolloutConfig(max_turns=3, max_actions_per_turn=5, max_actions_per_episode=10)
    env = Sokoban()
    room = "######\n#____#\n#_X__#\n#_P__#\n#__O_#\n######"

    class Fixed(Sokoban):
        def reset(self, seed):
            return self.load(room)

    result = Collector(engine, tok, config).collect([EpisodeSpec(Fixed(), seed=0, group_id=0)])
    ep, batch = result.episodes[0], result.batch
    # turn 0: Up pushes the box up (-0.1), Jump is invalid (no step, penalty), Left moves (-0.1) -> -0.2 - 0.1
    # turn 1: unparsable -> -0.1, no step.  turn 2: Down (-0.1).
    turn_rewards = [t["reward"] for t in ep.transcript if t["role"] == "model"]
    assert turn_rewards == pytest.approx([-0.3, -0.1, -0.1])
    # Jump is invalid: dropped before counting against the episode budget, as RAGEN does.
    assert ep.actions == 3 and ep.valid_actions == 3 and ep.format_errors == 2 and ep.turns == 3
    ends = batch.turn_ends[0]
    assert int(ends.sum()) == 3
    torch.testing.assert_close(batch.rewards[0][ends], torch.tensor([-0.3, -0.1, -0.1]))
    assert float(batch.rewards[0][~ends].abs().sum()) == 0.0
    assert env.actions == Sokoban.actions


@pytest.mark.parametrize("count_invalid", [False, True])
def test_invalid_actions_and_the_episode_budget(tiny, count_invalid):
    """Budget 3; each answer has 2 invalid actions and 1 valid one. RAGEN (not counting invalid ones) plays 3 valid
    actions over 3 turns; counting them, the budget runs out after the first answer's 3 actions."""
    _, tok = tiny
    engine = Scripted(tok, lambda turn, _: "x</think><answer>Jump || Fly || Left</answer>")
    config = RolloutConfig(max_turns=4, max_actions_per_turn=5, max_actions_per_episode=3,
                           count_invalid_actions=count_invalid)
    ep = Collector(engine, tok, config).collect([EpisodeSpec(Sokoban(), seed=3, group_id=0)]).episodes[0]
    if count_invalid:
        assert (ep.actions, ep.valid_actions, ep.turns) == (3, 1, 1)
    else:
        assert (ep.actions, ep.valid_actions, ep.turns) == (3, 3, 3)
    assert ep.format_errors == ep.turns  # every turn had an invalid action: penalised either way


def test_last_turn_placement_and_action_budget(tiny):
    _, tok = tiny
    engine = Scripted(tok, lambda turn, _: "x</think><answer>Left || Right || Left</answer>")
    config = RolloutConfig(max_turns=5, max_actions_per_turn=2, max_actions_per_episode=3, reward_placement="last_turn")
    result = Collector(engine, tok, config).collect([EpisodeSpec(Sokoban(), seed=3, group_id=0)])
    ep, batch = result.episodes[0], result.batch
    assert ep.actions == 3 and ep.turns == 2  # 2 actions (cap per turn), then 1 left in the episode budget
    assert int((batch.rewards[0] != 0).sum()) == 1
    assert float(batch.rewards[0].sum()) == pytest.approx(-0.3)


def test_done_stops_the_trajectory(tiny):
    _, tok = tiny
    engine = Scripted(tok, lambda turn, _: "x</think><answer>Dragon || Phoenix</answer>")
    result = Collector(engine, tok, RolloutConfig()).collect([EpisodeSpec(Bandit(), seed=s, group_id=s) for s in range(4)])
    for ep in result.episodes:
        assert ep.turns == 1 and ep.actions == 1 and ep.success and ep.done


class Steps(Env):
    """Ends after ``seed % 3 + 1`` actions; seed 99's reset raises."""

    actions = ("A",)

    @property
    def instructions(self) -> str:
        return "Say A."

    def reset(self, seed):
        if seed == 99:
            raise RuntimeError("no board")
        self.left = seed % 3 + 1
        return "start"

    def render(self):
        return f"{self.left} left"

    def step(self, action):
        self.left -= 1
        return self.render(), 0.0, self.left == 0, {"success": False, "action_is_valid": True,
                                                     "action_is_effective": True}


def test_progress_counts_the_episode_turns_and_the_episodes_ended(tiny):
    _, tok = tiny
    engine = Scripted(tok, lambda turn, _: "x</think><answer>A</answer>")
    specs = [EpisodeSpec(Steps(), seed=s, group_id=s) for s in (0, 1, 2, 3, 4, 99)]
    calls = []
    result = Collector(engine, tok, RolloutConfig(max_turns=5)).collect(specs, progress=lambda *a: calls.append(a))
    # turn 1 ends seeds 0 and 3 and the failed reset (3 x 5 turns) and the other 3 played 1 each; turn 2 ends seeds
    # 1 and 4 (5 x 5, seed 2 at 2); turn 3 seed 2 (6 x 5 = every turn of the budget); nothing after
    assert calls == [(3, 18), (5, 27), (6, 30)]
    assert [ep.turns for ep in result.episodes] == [1, 2, 3, 1, 2, 0]
    # an episode the turn budget cuts ends at the last turn: every turn of the budget is counted once, then
    calls = []
    Collector(engine, tok, RolloutConfig(max_turns=2)).collect(specs[:3], progress=lambda *a: calls.append(a))
    assert calls == [(1, 4), (3, 6)]


class Exploding(Env):
    actions = ("A",)

    def __init__(self, mode: str = "raise") -> None:
        super().__init__()
        self.mode = mode

    @property
    def instructions(self) -> str:
        return "Say A."

    def reset(self, seed):
        return "start"

    def render(self):
        return "state"

    def step(self, action):
        if self.mode == "raise":
            raise RuntimeError("boom")
        time.sleep(5)
        return "state", 0.0, True, {"success": False, "action_is_valid": True, "action_is_effective": True}


def test_failing_and_hanging_envs_are_excluded_and_counted(tiny):
    _, tok = tiny
    engine = Scripted(tok, lambda turn, _: "x</think><answer>A</answer>")
    config = RolloutConfig(max_turns=2, step_timeout_s=0.2)
    specs = [EpisodeSpec(Exploding("raise"), 0, 0), EpisodeSpec(Bandit(), 1, 1), EpisodeSpec(Exploding("hang"), 2, 2)]
    start = time.perf_counter()
    result = Collector(engine, tok, config).collect(specs)
    assert time.perf_counter() - start < 3
    failed = [ep.failed for ep in result.episodes]
    assert "boom" in failed[0] and failed[1] is None and "ran past 0.2s" in failed[2]
    assert len(result.batch) == 1 and result.batch.env_tags == ("Bandit",)


class Napping(Env):
    """Sleeps past the limit in C (no SIGALRM off the main thread could cut it), then records its close."""

    actions = ("A",)
    closed: list[int] = []

    @property
    def instructions(self) -> str:
        return "Say A."

    def reset(self, seed):
        self.seed = seed
        return "start"

    def render(self):
        return "state"

    def step(self, action):
        time.sleep(0.8)
        return "state", 0.0, True, {"success": True, "action_is_valid": True, "action_is_effective": True}

    def close(self):
        Napping.closed.append(self.seed)


def test_the_time_limit_holds_off_the_main_thread(tiny):
    """The background rollout of max_staleness >= 1 plays envs off the main thread, where no SIGALRM can be used:
    a hanging env call (asleep in C, or a Python loop) still fails its trajectory at the limit, the others play on,
    and the abandoned env is closed once its call returns."""
    _, tok = tiny
    engine = Scripted(tok, lambda turn, _: "x</think><answer>A</answer>")
    config = RolloutConfig(max_turns=2, step_timeout_s=0.2)
    specs = [EpisodeSpec(Napping(), 7, 0), EpisodeSpec(Bandit(), 1, 1), EpisodeSpec(Exploding("hang"), 2, 2),
             EpisodeSpec(Exploding("raise"), 3, 3)]
    out: dict = {}

    def play():
        start = time.perf_counter()
        out["result"] = Collector(engine, tok, config).collect(specs)
        out["seconds"] = time.perf_counter() - start

    Napping.closed.clear()
    before = set(threading.enumerate())
    worker = threading.Thread(target=play)
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and out["seconds"] < 2
    failed = [ep.failed for ep in out["result"].episodes]
    assert "ran past 0.2s" in failed[0] and failed[1] is None and "ran past 0.2s" in failed[2] and "boom" in failed[3]
    assert len(out["result"].batch) == 1 and out["result"].batch.env_tags == ("Bandit",)
    assert Napping.closed == []  # its call still runs: the env is not touched under it
    time.sleep(1.0)
    assert Napping.closed == [7]
    # the rollout's env thread ended with it, the napping env's with its call; the 5 s hang's still runs
    assert [t.name for t in set(threading.enumerate()) - before] == ["ragen-pl-env-calls"]


def test_rollout_config_errors():
    with pytest.raises(ValueError, match=r"`--data.rollout.max_turns` must be an integer >= 1, got 0"):
        RolloutConfig(max_turns=0)
    with pytest.raises(ValueError, match=r"`--data.rollout.reward_placement` must be one of turn, last_turn, got 'end'"):
        RolloutConfig(reward_placement="end")
    with pytest.raises(ValueError, match=r"`--data.rollout.temperature` must be >= 0, got -1"):
        RolloutConfig(temperature=-1)
    with pytest.raises(ValueError, match=r"`--data.rollout.top_k` must be -1 \(off\) or an integer >= 1, got 0"):
        RolloutConfig(top_k=0)


@pytest.mark.parametrize("window", [1, 2])
def test_context_window_rows_are_exactly_what_was_fed_and_sampled(tiny, window):
    _, tok = tiny
    answers = ["first</think><answer>Up</answer>", "second</think><answer>Left</answer>",
               "third</think><answer>Down</answer>"]
    engine = Recording(Scripted(tok, lambda turn, _: answers[turn]))
    config = RolloutConfig(max_turns=3, context_window=window)
    result = Collector(engine, tok, config).collect([EpisodeSpec(Sokoban(), seed=s, group_id=s) for s in range(2)])
    batch = result.batch
    assert len(batch) == 6 and batch.traj_ids.tolist() == [0, 0, 0, 1, 1, 1]  # one row per turn
    rows = [(p, g) for prompts, gens in engine.calls for p, g in zip(prompts, gens)]
    order = [0, 2, 4, 1, 3, 5]  # engine calls are turn-major, rows trajectory-major
    for b, call in enumerate(order):
        prompt, sampled = rows[call]
        ids = batch.input_ids[b][batch.attention_mask[b]].tolist()
        assert ids == prompt + sampled
        assert batch.loss_mask[b][batch.attention_mask[b]].tolist() == [False] * len(prompt) + [True] * len(sampled)
        text = tok.decode(prompt)
        turn = b % 3
        assert "You are solving the Sokoban puzzle" in text  # the rules always stay
        assert f"Turn {turn + 1}:" in text
        kept = [k for k in range(turn) if k >= turn - (window - 1)]
        for k in range(turn):
            assert (answers[k].split("</think>")[0] in text) == (k in kept), (window, turn, k)
    # Rewards: each turn's on its own row's last sampled token (-0.1 per step in Sokoban).
    assert batch.rewards.sum(-1).tolist() == pytest.approx([-0.1] * 6)


def test_context_window_error():
    with pytest.raises(ValueError, match=r"`--data.rollout.context_window` must be an integer >= 1 or null, got 0"):
        RolloutConfig(context_window=0)
    with pytest.raises(ValueError, match=r"^`--data.rollout.turn_header` must be true or false, got 'no'$"):
        RolloutConfig(turn_header="no")


def test_prompts_without_the_turn_header_are_the_state_alone(tiny):
    """``turn_header: false`` with a window of one turn: every turn's fed prompt is the one turn 1 would be fed on
    that board (the rules, the board, the format; no ``Turn t``, actions left or reward), so the same board gives the
    same prompt on every turn, and the SFT demonstrations of that layout train on the same prompts."""
    _, tok = tiny
    config = RolloutConfig(max_turns=6, max_actions_per_turn=1, max_new_tokens=8, think=False, context_window=1,
                           turn_header=False)
    engine = Recording(Scripted(tok, lambda turn, _: "Up</answer>" if turn % 2 else "Down</answer>"))
    Collector(engine, tok, config).collect([EpisodeSpec(FrozenLake(size=4, cell_separator=" "), seed=5, group_id=0)])
    fmt = format_instruction(False, 1, 8)
    env, compared = FrozenLake(size=4, cell_separator=" "), 0
    obs = env.reset(5)
    for turn, (prompts, _) in enumerate(engine.calls):
        first = WindowChat(tok, config.system_prompt, first_user_message(env.instructions, obs, 10, fmt, False), False,
                           env.instructions, 1)
        assert prompts[0] == first.prompt_ids(), turn
        text = tok.decode(prompts[0])
        assert "Turn" not in text and "actions left" not in text and "Reward" not in text
        compared += 1
        obs, _, done, _ = env.step("Down" if turn % 2 == 0 else "Up")
        if done:
            break
    assert compared >= 2
    with_header = RolloutConfig(**{**config.__dict__, "turn_header": True})
    users = [t["user"] for r in demonstrations([FrozenLake(size=4, cell_separator=" ")], 4, config, seed=1)
             for t in r["turns"]]
    assert len(users) > 4 and all(u.count("State:") == 1 and "Turn" not in u and "Reward" not in u for u in users)
    assert all("Turn" in t["user"] for r in demonstrations([FrozenLake(size=4)], 2, with_header, seed=1)
               for t in r["turns"])


class Growing(Env):
    """An env whose observation is ``words`` words at reset and doubles at every step."""

    actions = ("A",)

    def __init__(self, words: int = 10, tag: str | None = None) -> None:
        super().__init__(tag)
        self.words = words

    @property
    def instructions(self) -> str:
        return "Answer A."

    def reset(self, seed: int) -> str:
        self.n = self.words
        return self.render()

    def step(self, action: str):
        self.n *= 2
        return self.render(), 0.0, False, {"success": False, "action_is_valid": True, "action_is_effective": True}

    def render(self) -> str:
        return "ice " * self.n


def test_a_first_prompt_past_the_context_is_a_one_line_error_before_any_forward(tiny):
    """Issue 21: an observation of 6,000+ tokens (the tiny model has 4,096 positions) was fed anyway."""
    from ragen_pl.errors import ConfigError

    model, tok = tiny
    engine = Recording(HFEngine(seed=0))
    engine.inner.bind(model, tok)
    collector = Collector(engine, tok, RolloutConfig(max_turns=2, max_new_tokens=8))
    assert collector.max_seq_len == 4096  # the model's context, by default
    with pytest.raises(ConfigError, match=r"^env 'Huge' \(seed 3\): its first prompt is \d{4,} tokens, which with "
                                          r"`--data.rollout.max_new_tokens` \(8\) passes the context limit of 4096 "
                                          r"tokens"):
        collector.collect([EpisodeSpec(Growing(6000, tag="Huge"), seed=3, group_id=0)])
    assert engine.calls == []  # nothing reached the model


def test_a_turn_past_the_context_ends_the_trajectory_truncated_and_warns_once_per_env(tiny):
    model, tok = tiny
    engine = Recording(HFEngine(seed=0))
    engine.inner.bind(model, tok)
    config = RolloutConfig(max_turns=6, max_new_tokens=8, think=False, max_seq_len=600)
    collector = Collector(engine, tok, config)
    specs = [EpisodeSpec(Growing(20), seed=s, group_id=s) for s in range(3)]
    with pytest.warns(UserWarning, match=r"env 'Growing': a trajectory ended truncated") as caught:
        result = collector.collect(specs)
    assert len([w for w in caught if "truncated" in str(w.message)]) == 1
    assert all(ep.truncated and ep.turns < 6 for ep in result.episodes)
    longest = max(len(p) for prompts, _ in engine.calls for p in prompts)
    assert longest + config.max_new_tokens <= 600  # no prompt past the limit was fed
    from ragen_pl.metrics import rollout_metrics

    assert float(rollout_metrics(result.episodes)["rollout/truncated"]) == 1.0
    with pytest.warns(UserWarning) as again:  # the same collector does not warn twice for one env
        import warnings

        collector.collect(specs)
        warnings.warn("marker", UserWarning, stacklevel=1)
    assert [str(w.message) for w in again] == ["marker"]


@pytest.mark.parametrize("window", [None, 1, 2])
def test_sft_rows_are_the_rollout_rows_of_the_same_play(tiny, window):
    """A demonstration (the warm start's data) trains on exactly the rows a rollout of the same play gives: one
    sequence, or with a context window one row per turn, token for token, with the same loss mask."""
    import random

    from ragen_pl.sft import demonstrations, encode_rows

    _, tok = tiny
    config = RolloutConfig(max_turns=4, max_actions_per_turn=2, max_actions_per_episode=8, max_new_tokens=12,
                           think=False, context_window=window)
    record = demonstrations([Sokoban()], 1, config, seed=3)[0]
    assert (record.get("context_window"), bool(record.get("instructions"))) == (window, window is not None)
    rows = encode_rows(record, tok)
    engine = Scripted(tok, lambda turn, _: record["turns"][turn]["assistant"])
    seed = random.Random(3).randrange(2**31)  # the env seed demonstrations() drew for its first episode
    batch = Collector(engine, tok, config).collect([EpisodeSpec(Sokoban(), seed=seed, group_id=0)]).batch
    assert len(rows) == len(batch) == (1 if window is None else len(record["turns"]))
    for b, (ids, mask) in enumerate(rows):
        real = batch.attention_mask[b]
        assert batch.input_ids[b][real].tolist() == ids
        assert batch.loss_mask[b][real].tolist() == mask
