"""Megatron's dynamic loss scaling for fp16 training (bf16 and fp32 use a constant scale of 1).

fp16 gradients underflow without it. The loss is multiplied by the scale before backward and the gradients
divided by it before clipping; a step whose gradients are not finite is skipped and the scale backs off,
after `hysteresis` such steps; `window` clean steps in a row grow it. Defaults are Megatron's
(--initial-loss-scale 2**32, --min-loss-scale 1, --loss-scale-window 1000, --hysteresis 2).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    """The current scale and its update rule; `dynamic=False` keeps it at 1."""

    dynamic: bool = False
    scale: float = 1.0
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    _good_steps: int = 0
    _hysteresis_left: int = 2

    @classmethod
    def for_dtype(cls, param_dtype: str) -> "LossScaler":
        if param_dtype == "fp16":
            return cls(dynamic=True, scale=2.0 ** 32)
        return cls()

    def update(self, found_non_finite: bool) -> None:
        """Advances the schedule after a step whose gradients were (not) finite."""
        if not self.dynamic:
            return
        if found_non_finite:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
        else:
            self._good_steps += 1
            if self._good_steps % self.window == 0:
                self._hysteresis_left = self.hysteresis
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._good_steps = state["good_steps"]
        self._hysteresis_left = state["hysteresis_left"]
