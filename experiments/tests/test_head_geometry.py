"""ragen_pl_experiments.research.head_geometry: the hidden states it measures are those the head reads at the answer's scored
positions, and the directions it leaves out are the centred head's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def head_geometry(monkeypatch):
    import ragen_pl_experiments.research.head_geometry as head_geometry

    return head_geometry


def test_scored_positions_are_the_answers(head_geometry, tiny):
    """Position 0 is the prompt's last token (its output is the action): the same state a forward of the prompt
    alone ends with; the next ones are the action's and the closing tag's, whose outputs are the tag's tokens."""
    from ragen_pl_experiments.research.common import load_config, make_env
    from ragen_pl_experiments.research.probe_reading import first_turn

    from ragen_pl.config import RolloutConfig
    from ragen_pl.rollout.chat import ChatTokens

    model, tok = tiny
    model.eval()
    cfg = load_config("frozenlake")
    h, actions = head_geometry.scored_hidden_states(model, tok, cfg, range(2), torch.Generator().manual_seed(0))
    close = tok("</answer>", add_special_tokens=False)["input_ids"]
    assert h.shape == (2, 1 + len(close), model.config.hidden_size) and len(actions) == 2
    env = make_env(cfg["data"]["env"])
    rollout = RolloutConfig(**cfg["data"]["rollout"])
    prompt = ChatTokens(tok, rollout.system_prompt, first_turn(cfg, env, env.reset(1)), rollout.think).ids
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]
    torch.testing.assert_close(h[1, 0], alone, atol=1e-5, rtol=1e-5)


def test_leading_directions_remove_a_shared_part(head_geometry):
    """Rows that share one of 3 large vectors plus a small individual part: the 3 leading directions of their second
    moment remove the shared vectors (what is left is the individual part's size) and keep most of the individual
    part; the mean direction alone does not."""
    from ragen_pl_experiments.readout import project_out, shared_directions

    gen = torch.Generator().manual_seed(0)
    shared = 10 * torch.randn(3, 64, generator=gen)
    h = shared.repeat(200, 1) + 0.1 * torch.randn(600, 64, generator=gen)
    directions = shared_directions(h, 3)
    torch.testing.assert_close(directions.T @ directions, torch.eye(3, dtype=directions.dtype), atol=1e-6, rtol=0)
    assert project_out(h, directions.float()).norm(dim=-1).max() < 1.5
    u = (h.mean(0) / h.mean(0).norm()).unsqueeze(-1)
    assert project_out(h, u).norm(dim=-1).min() > 10


def test_variance_split_by_hand(head_geometry):
    """z[b, t] in one dimension: [[0, 2], [2, 4]] is a board part (1, 3) plus a turn part (1, 3): variance 2, half each,
    no interaction. [[0, 0], [0, 4]]: variance 3, board means (0, 2) and turn means (0, 2) a third each, and the rest
    [[1, -1], [-1, 1]] the last third."""
    split = head_geometry.variance_split(torch.tensor([[[0.0], [2.0]], [[2.0], [4.0]]]))
    assert split == pytest.approx((0.5, 0.5, 0.0))
    split = head_geometry.variance_split(torch.tensor([[[0.0], [0.0]], [[0.0], [4.0]]]))
    assert split == pytest.approx((1 / 3, 1 / 3, 1 / 3))


def test_turn_geometry_prints_the_split(head_geometry, tiny, capsys):
    """``--turns``: on the tiny model, the three shares of both readings add up to 1, and the warm start's action
    probabilities are printed for turn 1 and the later turns."""
    import re

    from ragen_pl_experiments.research.common import load_config, readout

    model, tok = tiny
    cfg = load_config("frozenlake")
    readout(cfg)["tokens"] = [tok.decode([i]) for i in (40, 41, 42, 43)]  # four one-token stand-ins
    head_geometry.turn_geometry(model.eval(), tok, cfg, 3, 3, (1, 2))
    out = capsys.readouterr().out
    shares = re.findall(r": (\d\.\d+) / (\d\.\d+) / (\d\.\d+)(?:; board part kept (\d\.\d+))?$", out, re.M)
    assert len(shares) == 3 and shares[0][3] == "" and all(0 < float(s[3]) <= 1 for s in shares[1:]), out
    for split in shares:
        assert sum(map(float, split[:3])) == pytest.approx(1.0, abs=2e-3)
    assert re.search(r"turn 1 (\d\.\d+, ){3}\d\.\d+; turns 2-3 ", out), out
