"""What a captioning job tells its user: progress while it runs and the summary at the end."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass

from tqdm import tqdm


@dataclass(slots=True)
class CaptionSummary:
    inputs: int  # in this job (this shard), including those already done
    captioned: int
    failed: int
    skipped: int  # already in the output file (resume)
    prompt_tokens: int
    generated_tokens: int
    images_per_second: float  # over the captioning, after the model is loaded
    tokens_per_second: float  # generated tokens
    wall_time_s: float  # the whole job, loading included
    load_time_s: float
    out: str

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"{self.inputs} inputs: {self.captioned} captioned, {self.failed} failed, "
            f"{self.skipped} already done; {self.images_per_second:.2f} images/s, "
            f"{self.tokens_per_second:.1f} generated tokens/s; wall time {self.wall_time_s:.1f} s "
            f"(model load {self.load_time_s:.1f} s) -> {self.out}"
        )


def progress_mode(progress: str | bool) -> str:
    mode = {True: "auto", False: "none"}.get(progress, progress)  # type: ignore[arg-type]
    if mode not in ("auto", "bar", "log", "none"):
        raise ValueError(f"progress must be 'auto', 'bar', 'log' or 'none', got {progress!r}")
    if mode == "auto":
        mode = "bar" if sys.stderr.isatty() else "log"
    return mode


class Tally:
    """Counts results and reports progress: a tqdm bar (images/s, time left) on a terminal, a log
    line every `interval` seconds otherwise."""

    def __init__(self, total: int, skipped: int) -> None:
        self.total, self.skipped, self.done, self.logged = total, skipped, skipped, skipped
        self.captioned = self.failed = self.prompt_tokens = self.tokens = 0
        self.mode, self.interval, self.bar = "none", 0.0, None
        self.start = self.last = time.perf_counter()

    def start_reporting(self, mode: str, interval: float) -> None:
        self.mode, self.interval = mode, interval
        self.start = self.last = time.perf_counter()
        if mode == "bar":
            self.bar = tqdm(
                total=self.total, initial=self.skipped, unit="img", dynamic_ncols=True, file=sys.stderr
            )

    def add(self, rec: dict) -> None:
        self.done += 1
        if "error" in rec:
            self.failed += 1
        else:
            self.captioned += 1
            self.prompt_tokens += rec["prompt_tokens"]
            self.tokens += rec["completion_tokens"]
        now = time.perf_counter()
        if self.bar is not None:
            tok_s = self.tokens / max(now - self.start, 1e-9)
            self.bar.set_postfix(failed=self.failed, tok_s=f"{tok_s:.0f}", refresh=False)
            self.bar.update(1)
        elif self.mode == "log" and now - self.last >= self.interval:
            self._log(now)

    def _log(self, now: float) -> None:
        self.last, self.logged = now, self.done
        print(self.line(now), file=sys.stderr, flush=True)

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = (self.done - self.skipped) / elapsed
        left = tqdm.format_interval((self.total - self.done) / rate) if rate > 0 else "unknown"
        return (
            f"caption: {self.done}/{self.total} inputs ({100 * self.done / max(self.total, 1):.0f}%), "
            f"{self.failed} failed, {rate:.2f} images/s, {self.tokens / elapsed:.1f} generated tokens/s, "
            f"{left} left"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.mode == "log" and self.done != self.logged:  # the last count, unless just logged
            self._log(time.perf_counter())

    def summary(self, wall: float, load: float, out: str) -> CaptionSummary:
        elapsed = time.perf_counter() - self.start if self.done > self.skipped else 0.0
        rate = lambda n: n / elapsed if elapsed > 0 else 0.0
        return CaptionSummary(
            inputs=self.total,
            captioned=self.captioned,
            failed=self.failed,
            skipped=self.skipped,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.tokens,
            images_per_second=rate(self.done - self.skipped),
            tokens_per_second=rate(self.tokens),
            wall_time_s=wall,
            load_time_s=load,
            out=out,
        )
