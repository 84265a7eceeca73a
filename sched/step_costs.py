"""How long a step takes, learned from the steps that ran: the cost model behind a time-bounded
step (the scheduler's `step_time_factor`).

    seconds ~ fixed + per_decode * decodes + per_prefill * prefill_tokens + per_encoded * encoded_tokens

fitted by least squares over the steps seen so far, the older ones weighing less (each new step
scales the sums by `decay`), every coefficient kept at zero or above. A little ridge keeps the fit
defined while some kind of work has not been seen yet (no image encoded so far: an encoded token is
then taken to cost what a prefill token does).
"""

from __future__ import annotations

from dataclasses import dataclass

_RIDGE = 1e-9  # seconds^2 per unit^2: negligible against real sums, enough to keep the system solvable


@dataclass(slots=True, frozen=True)
class StepShape:
    """What one step ran, as the cost model counts it."""

    decodes: int  # requests that computed one token past their prompt
    prefill_tokens: int  # every other token: prompt chunks, recomputed output
    encoded_tokens: int  # image tokens the tower produced for it (not from the encoder cache)

    def features(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.decodes), float(self.prefill_tokens), float(self.encoded_tokens))


@dataclass(slots=True, frozen=True)
class Costs:
    """A fitted model, in seconds."""

    fixed: float
    per_decode: float
    per_prefill: float
    per_encoded: float

    def seconds(self, shape: StepShape) -> float:
        x = shape.features()
        return self.fixed * x[0] + self.per_decode * x[1] + self.per_prefill * x[2] + self.per_encoded * x[3]

    def allowance(self, decodes: int, factor: float) -> tuple[int, int | None, float]:
        """What a step of `decodes` may add to take at most `factor` times as long as they alone:
        prefill tokens, encoded image tokens (None: no bound known), and the prefill tokens one
        encoded token's time is worth. Needs `per_prefill` above zero."""
        extra = (factor - 1.0) * self.seconds(StepShape(decodes, 0, 0))
        encoded = int(extra / self.per_encoded) if self.per_encoded > 0.0 else None
        return int(extra / self.per_prefill), encoded, self.per_encoded / self.per_prefill


class StepCosts:
    def __init__(self, decay: float = 0.98, min_steps: int = 8) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.min_steps = min_steps
        self._xtx = [[0.0] * 4 for _ in range(4)]
        self._xty = [0.0] * 4
        self._steps = 0
        self._prefill_steps = 0  # steps that computed prompt tokens
        self._encode_steps = 0  # steps that encoded images
        self._fit: Costs | None = None

    def observe(self, shape: StepShape, seconds: float) -> None:
        x, d = shape.features(), self.decay
        for i in range(4):
            row = self._xtx[i]
            for j in range(4):
                row[j] = d * row[j] + x[i] * x[j]
            self._xty[i] = d * self._xty[i] + x[i] * seconds
        self._steps += 1
        self._prefill_steps += shape.prefill_tokens > 0
        self._encode_steps += shape.encoded_tokens > 0
        self._fit = None

    def fitted(self) -> Costs | None:
        """The model, or None until enough steps (some with prefill) were seen to trust one."""
        if self._steps < self.min_steps or self._prefill_steps < 2:
            return None
        if self._fit is None:
            free = [0, 1, 2, 3] if self._encode_steps >= 2 else [0, 1, 2]
            coef = _nonnegative_fit(self._xtx, self._xty, free)
            if self._encode_steps < 2:
                coef[3] = coef[2]
            self._fit = Costs(*coef)
        return self._fit


def _nonnegative_fit(xtx: list[list[float]], xty: list[float], free: list[int]) -> list[float]:
    """Least squares over the `free` coefficients (the others zero); a coefficient that comes out
    negative is fixed at zero and the rest refitted (a step never gets cheaper with more work)."""
    coef = [0.0] * 4
    free = list(free)
    while free:
        a = [[xtx[i][j] + (_RIDGE if i == j else 0.0) for j in free] for i in free]
        sol = _solve(a, [xty[i] for i in free])
        negative = [k for k, v in zip(free, sol, strict=True) if v < 0.0]
        if not negative:
            for k, v in zip(free, sol, strict=True):
                coef[k] = v
            return coef
        free.remove(min(negative, key=lambda k: sol[free.index(k)]))
    return coef


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a few unknowns: no library call pays)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        if m[col][col] == 0.0:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        s = m[r][n] - sum(m[r][c] * out[c] for c in range(r + 1, n))
        out[r] = s / m[r][r] if m[r][r] != 0.0 else 0.0
    return out
