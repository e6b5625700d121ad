"""A rollout engine written only against ``ragen_pl.rollout.engine.RolloutEngine`` and the README: it samples from
its own copy of the policy's weights (``holds_weights``), as an engine in another process or on another device
would, one prompt at a time with a plain loop (no KV cache: an example, not a fast engine)."""

from __future__ import annotations

import torch

from ragen_pl.rollout.engine import Generation, RolloutEngine, SamplingParams


class CopyEngine(RolloutEngine):
    holds_weights = True

    def __init__(self, seed: int = 0) -> None:
        """
        Args:
            seed: seed of the sampling generator.
        """
        self.seed = seed
        self.copy = None
        self.generator = torch.Generator().manual_seed(seed)

    def load_weights(self, state_dict) -> None:
        if self.copy is None:  # the bound policy's architecture, our own weights
            from transformers import AutoModelForCausalLM

            self.copy = AutoModelForCausalLM.from_config(self.model.config).eval()
        self.copy.load_state_dict(state_dict)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if self.copy is None:
            raise RuntimeError("CopyEngine.generate before load_weights: no weights to sample from")
        eos = self.tokenizer.eos_token_id
        out = []
        for prompt in prompts:
            ids, tokens, logprobs, reason = list(prompt), [], [], "length"
            for _ in range(params.max_new_tokens):
                logits = self.copy(input_ids=torch.tensor([ids])).logits[0, -1].float()
                logp = torch.log_softmax(logits / max(params.temperature, 1e-6), -1)
                token = int(torch.multinomial(logp.exp(), 1, generator=self.generator)) if params.temperature > 0 \
                    else int(logp.argmax())
                ids.append(token)
                tokens.append(token)
                logprobs.append(float(logp[token]))
                if token == eos and not params.ignore_eos:
                    reason = "eos"
                    break
                if any(s in self.tokenizer.decode(tokens) for s in params.stop):
                    reason = "stop"
                    break
            out.append(Generation(tokens, logprobs, reason))
        return out

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
