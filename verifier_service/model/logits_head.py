"""The model's head as its own forward applies it: the vocabulary projection, then what an architecture
does to the logits after it.

The packed forward runs the base model and the head apart, to project only the positions whose logits
are needed, so whatever a causal LM's forward does after its `lm_head` is done here: Gemma 2 and 3 cap
the logits with a tanh (`final_logit_softcapping`), Cohere multiplies them (`logit_scale`), Granite
divides them (`logits_scaling`). Greedy choices survive all three; sampling, penalties and
log-probabilities do not. Any other difference between this head and the model's own forward is found
by architecture_check.py at start-up, which then refuses the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel


@dataclass(frozen=True)
class LogitsHead:
    projection: torch.nn.Module
    # In this order, each where set, as the models' forwards do it (the same operations, the same bits).
    multiplier: float | None = None  # logits * multiplier (Cohere's logit_scale)
    divisor: float | None = None  # logits / divisor (Granite's logits_scaling)
    softcap: float | None = None  # softcap * tanh(logits / softcap)

    @classmethod
    def of(cls, model: PreTrainedModel) -> LogitsHead:
        config = model.config.get_text_config()

        def number(name: str) -> float | None:
            value = getattr(config, name, None)
            return float(value) if value is not None else None

        return cls(model.get_output_embeddings(), number("logit_scale"), number("logits_scaling"),
                   number("final_logit_softcapping"))

    @property
    def vocab_size(self) -> int:
        return self.projection.out_features  # type: ignore[return-value]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] of last hidden states [N, hidden] (computed in the model's dtype)."""
        logits = self.projection(hidden)
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()
