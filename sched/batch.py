"""What one step runs, as the scheduler hands it on: `ScheduledBatch`, a plain value the runner
and the core read (they never reach back into the scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mm_engine.request import Request


@dataclass(slots=True)
class ScheduledBatch:
    items: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) KV blocks
    # Image features, as the scheduler accounts for them: the images this step's chunks reach whose
    # features the runner does not hold yet (from the encoder cache, or encoded this step), and
    # the images the chunks pass (the runner drops their features after this step). An image a
    # chunk ends inside is in neither list the next step: the runner holds it meanwhile.
    new_images: list[tuple[Request, int]] = field(default_factory=list)  # (request, image index)
    passed_images: list[tuple[str, int]] = field(default_factory=list)  # (request id, image index)
    # Images too big for this step's encoder budget: a share of their tower now, worth this many of
    # the budget's image tokens (vision/sliced_encode.py). A chunk stops before such an image until
    # its features are in the encoder cache.
    encode_slices: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, image, tokens)
    # Hybrid models: snapshot rows copied into slots first (prefix reuse), and per request the
    # points of its chunk whose state the forward keeps: (tokens into the chunk, snapshot row).
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    state_snapshots: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    num_decodes: int = 0  # items that compute one token past their prompt
    encoder_tokens: int = 0  # image tokens the scheduler charged to the encoder budget
    background_only: bool = False  # a step of background work alone (no foreground request ran)
    # Beside a paused step (`schedule(held=...)`), a waiting request could not be admitted: the
    # paused step runs to its end next, so that its requests can give way.
    held_in_way: bool = False

    @property
    def requests(self) -> list[Request]:
        """Every request the step works for: its items', then those it encodes image shares for
        (a failure of the step fails them all)."""
        reqs = [req for req, _ in self.items] + [req for req, _, _ in self.encode_slices]
        return list({req.request_id: req for req in reqs}.values())

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def adopt(self, other: ScheduledBatch) -> None:
        """Become `other`, field by field (the caller holds this object; every field comes along)."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(other, name))

    def drop_finished(self) -> None:
        """Leave out the requests that ended meanwhile (a step read before this one launches)."""
        self.items = [(req, n) for req, n in self.items if not req.is_finished]
        self.new_images = [(req, j) for req, j in self.new_images if not req.is_finished]
        self.encode_slices = [s for s in self.encode_slices if not s[0].is_finished]
        live = {req.request_id for req, _ in self.items}
        self.passed_images = [(rid, j) for rid, j in self.passed_images if rid in live]
        self.state_snapshots = {rid: v for rid, v in self.state_snapshots.items() if rid in live}
