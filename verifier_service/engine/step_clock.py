"""What a step costs beside its forward, measured as it runs, for the planner to price drafter calls.

The draft planner weighs a draft's expected tokens against what the step costs (spec_decode/planner.py).
The forward's cost by token count is timed at start-up; two costs are not, and depend on the drafter
and the machine: the step's own work around the forward (scheduling, sampling, handing outputs over),
and, in a step that calls the drafter, the time the model thread spends on the call: building it and
waiting for its answer (a remote drafter's round trip and drafting; little where the call was sent
before the last forward and answered during it, spec_decode/lookahead.py). Both are kept here as
decayed averages of the steps of a busy loop and priced in the cost curve's unit: the one-token
forward: as the forwards of the loop take it, or as timed with the curve at start-up where that is
longer (a step's own forward may return before a GPU is done; timed at start-up, it was synchronised).
"""

from __future__ import annotations

from dataclasses import dataclass

from verifier_service.model.step_costs import CostCurve
from verifier_service.spec_decode.planner import FREE_CALLS, StepPrice

# Weight left to the average at each new step: about the last ten steps count, so a drafter that slows
# down (or recovers) is priced rightly within a few steps.
DECAY = 0.9


@dataclass
class StepClock:
    costs: CostCurve  # the planner's forward cost by tokens, in one-token forwards
    one_token_s: float  # the curve's unit as timed at start-up, in seconds
    forward_unit_s: float | None = None  # the curve's unit as the loop's forwards take it
    fixed_s: float | None = None  # a step's own work: its period minus its forward and its drafter call
    call_s: float | None = None  # in steps that called the drafter: the model thread's time on the call

    def forward(self, seconds: float, tokens: int) -> None:
        """A forward of `tokens` tokens took `seconds`."""
        self.forward_unit_s = _decayed(self.forward_unit_s, seconds / self.costs(tokens))

    def step(self, outside_forward_s: float, drafter_s: float, called: bool) -> None:
        """One step of a busy loop: its period minus its forward, and of that, the time spent on the
        drafter call (if `called`: a step that called none tells nothing of the call's cost)."""
        self.fixed_s = _decayed(self.fixed_s, max(0.0, outside_forward_s - drafter_s))
        if called:
            self.call_s = _decayed(self.call_s, drafter_s)

    def price(self) -> StepPrice:
        unit = max(self.one_token_s, self.forward_unit_s or 0.0)
        if unit <= 0:
            return FREE_CALLS
        return StepPrice((self.fixed_s or 0.0) / unit, (self.call_s or 0.0) / unit)


def _decayed(average: float | None, sample: float) -> float:
    return sample if average is None else DECAY * average + (1 - DECAY) * sample
