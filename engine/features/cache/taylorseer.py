"""TaylorSeer calibrator: predicts the skipped middle-block residual from the computed steps.

Kept as the last column of a divided-difference table over the computed steps (step index = model
call index): ``dd[0] = Y(t_n)``, ``dd[k] = Y[t_n-k .. t_n]``. The prediction at step ``t`` is the
Newton polynomial through the last ``order + 1`` computed steps,

    Y(t) ~ dd[0] + dd[1] (t - t_n) + dd[2] (t - t_n)(t - t_n-1)

which equals the Taylor expansion about the last computed step with derivatives estimated from
those steps. Order 1 is cache-dit's linear extrapolation exactly; order 2 is exact for quadratics
also when the computed steps are unevenly spaced (cache-dit's order-2 Taylor term uses the
first derivative of the previous window, a half-window lag). Before enough steps are computed the
order is lowered (one computed step: plain reuse, like DBCache without a calibrator).
It only changes the value used on a cached step, never the decision to cache.
"""
from __future__ import annotations

from typing import List, Optional

import torch


class TaylorSeer:
    def __init__(self, order: int = 1, dtype: Optional[torch.dtype] = None):
        if order not in (1, 2):
            raise ValueError(f"TaylorSeer order must be 1 or 2, got {order}")
        self.order = order
        self.dtype = dtype  # storage dtype of the table (None: as given; half types are kept as float32)
        self.times: List[int] = []
        self.dd: List[torch.Tensor] = []

    def reset(self) -> None:
        self.times, self.dd = [], []

    @property
    def ready(self) -> bool:
        return bool(self.dd)

    def update(self, y: torch.Tensor, step: int) -> None:
        """Record the value ``y`` computed at ``step``."""
        dtype = self.dtype or (torch.float32 if y.dtype in (torch.float16, torch.bfloat16) else y.dtype)
        y = y.to(dtype)
        if self.dd and self.dd[0].shape != y.shape:
            self.reset()
        new = [y]
        for k in range(1, self.order + 1):
            if len(self.dd) < k or len(self.times) < k:
                break
            span = float(step - self.times[-k])
            if span <= 0:
                break
            new.append((new[k - 1] - self.dd[k - 1]) / span)
        self.dd = new
        self.times = (self.times + [int(step)])[-(self.order + 1):]

    def coefficients(self, step: int) -> List[float]:
        """Scalar weights of dd[0..] for a prediction at ``step``."""
        coef, prod = [1.0], 1.0
        for k in range(1, len(self.dd)):
            prod *= float(step - self.times[-k])
            coef.append(prod)
        return coef

    def predict(self, step: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        if not self.dd:
            raise RuntimeError("TaylorSeer.predict before any update")
        out = self.dd[0]
        for c, d in zip(self.coefficients(step)[1:], self.dd[1:]):
            out = out + d * c
        return out.to(dtype or out.dtype)
