"""The product benchmarks compare fairly: train_step's plain-loop baseline pads each micro-batch to its own longest row
(as a collator does), and rollout.py says how much of its prompts is one shared prefix."""

import torch

from benchmarks.rollout import common_prefix
from benchmarks.train_step import plain_update
from tests.helpers import make_batch


def test_the_plain_loop_cuts_each_micro_batch_to_its_longest_row():
    """Rows of 2, 2, 5 and 5 real tokens in micro-batches of two: the model sees widths 2 and 5, never the batch's
    5 for the short pair (the review measured the baseline padding every micro-batch to the batch's longest row)."""
    widths = []

    class Spy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 10)

        def forward(self, input_ids, attention_mask=None):
            widths.append(input_ids.shape[1])
            return type("Out", (), {"logits": self.emb(input_ids)})()

    batch = make_batch([[0, 1, 0, 0, 0], [0, 1, 0, 0, 0], [0, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    batch.attention_mask[:2, 2:] = False  # the first two rows are 2 real tokens long, right-padded
    batch.input_ids = batch.input_ids % 10
    batch.advantages = torch.ones_like(batch.rewards)
    model = Spy()
    plain_update(model, batch, torch.optim.SGD(model.parameters(), lr=0.1), micro=2)
    assert widths == [2, 5]


def test_common_prefix():
    assert common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert common_prefix([[7, 1], [8, 1]]) == 0 and common_prefix([[1, 2], [1, 2]]) == 2
