"""Per-request sampling settings, shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

import copy
import enum
import json as _json
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What each output of a running request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything so far: text and token ids from the start (copies grow per step)
    DELTA = 1  # only what is new since the request's previous output
    FINAL_ONLY = 2  # no output until the request finishes; then everything


@dataclass(slots=True)
class StructuredOutputs:
    """Constrain the output to a grammar (vLLM's `StructuredOutputsParams`): exactly one of these."""

    json: dict | str | None = None  # a JSON schema (a dict, or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # exactly one of these strings
    grammar: str | None = None  # an EBNF grammar (xgrammar's dialect of GBNF)

    def key(self) -> tuple[str, str]:
        """(kind, spec as text): what a compiled grammar is cached by. ValueError unless one is set."""
        kinds = [k for k, v in (("json", self.json), ("regex", self.regex), ("choice", self.choice),
                                ("grammar", self.grammar)) if v is not None]  # fmt: skip
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, json_object, regex, choice, "
                             f"grammar; got {', '.join(kinds) or 'none'}")  # fmt: skip
        kind = kinds[0]
        if kind == "json":
            return kind, self.json if isinstance(self.json, str) else _json.dumps(self.json, sort_keys=True)
        if kind == "choice":
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            return kind, _json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        value = getattr(self, kind)
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        return kind, value


MAX_BAD_WORDS = 128


@dataclass(slots=True)
class SamplingParams:
    n: int = 1  # independent samples of the prompt (its KV blocks shared through the prefix cache)
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Logit adjustments (vLLM's meanings), applied in this order before temperature:
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100 to 100)
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's; None: any)
    bad_words: list[str] | None = None  # never generated (vLLM's): each as the tokenizer spells it
    # bad_words as token ids, with and without a leading space: set by the frontend from bad_words
    # (a caller may set ids instead); a word's last token is banned right after the rest of it.
    bad_words_token_ids: list[list[int]] | None = None
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output so far
    frequency_penalty: float = 0.0  # minus this times a token's count in the output so far
    presence_penalty: float = 0.0  # minus this once a token is in the output
    min_p: float = 0.0  # after temperature: tokens below min_p times the top probability go
    logprobs: int | None = None  # the sampled token's logprob and this many top ones (0 to 20)
    prompt_logprobs: int | None = None  # each prompt token's logprob (raw) and this many top ones
    structured_outputs: StructuredOutputs | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, list | tuple):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def children(self) -> list[SamplingParams]:
        """The `n` samples as requests of their own (n=1 each); with a seed, sample i uses seed + i,
        so every choice is reproducible."""
        if self.n == 1:
            return [self]
        seeds = [None] * self.n if self.seed is None else [(self.seed + i) % 2**64 for i in range(self.n)]
        return [self._child(s) for s in seeds]

    def _child(self, seed: int | None) -> SamplingParams:
        # Not re-validated: these params were, and n=1 with a 64-bit seed keeps them valid.
        child = copy.copy(self)
        child.n, child.seed = 1, seed
        return child

    def validate(self) -> None:
        if not _integer(self.n) or not 1 <= self.n <= 128:
            raise ValueError(f"n must be an integer from 1 to 128, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer of at least 1, got {self.max_tokens!r}")
        if not _number(self.temperature) or not 0.0 <= self.temperature < float("inf"):  # NaN too
            raise ValueError(f"temperature must be a finite number of at least 0, got {self.temperature!r}")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _integer(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        # torch.Generator.manual_seed takes 64 bits; a larger seed would overflow inside generate.
        if self.seed is not None and not (_integer(self.seed) and -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer that fits in 64 bits, or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not _integer(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if not _integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer from 0 to max_tokens, got {self.min_tokens!r}")
        for name, lo, hi in (("frequency_penalty", -2.0, 2.0), ("presence_penalty", -2.0, 2.0)):
            value = getattr(self, name)
            if not _number(value) or not lo <= value <= hi:
                raise ValueError(f"{name} must be a number from {lo:g} to {hi:g}, got {value!r}")
        if not _number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_integer(value) and 0 <= value <= 20):
                raise ValueError(f"{name} must be None or an integer from 0 to 20, got {value!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise ValueError("structured_outputs must be a StructuredOutputs")
            self.structured_outputs.key()
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must map token ids to numbers")
            for token, bias in self.logit_bias.items():
                if not _integer(token) or token < 0:
                    raise ValueError(
                        f"logit_bias keys must be token ids (non-negative integers), got {token!r}"
                    )
                if not _number(bias) or not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias values must be numbers from -100 to 100, got {bias!r}")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list | tuple) or not ids or any(not _integer(t) or t < 0 for t in ids):
                raise ValueError(
                    f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}"[:300]
                )

        if self.bad_words is not None and (
            not isinstance(self.bad_words, list | tuple)
            or len(self.bad_words) > MAX_BAD_WORDS
            or any(not isinstance(w, str) or not w.strip() or len(w) > 200 for w in self.bad_words)
        ):
            raise ValueError(
                f"bad_words must be a list of at most {MAX_BAD_WORDS} non-blank strings of at most "
                "200 characters"
            )
        ids = self.bad_words_token_ids
        if ids is not None and (
            not isinstance(ids, list | tuple)
            or len(ids) > 2 * MAX_BAD_WORDS
            or any(not isinstance(w, list | tuple) or not 0 < len(w) <= 64 for w in ids)
            or any(not _integer(t) or t < 0 for w in ids for t in w)
        ):
            raise ValueError(
                f"bad_words_token_ids must be a list of at most {2 * MAX_BAD_WORDS} non-empty lists of "
                "at most 64 token ids"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the tokens generated so far (the penalties and a grammar do)."""
        multi_token_bad_word = any(len(w) > 1 for w in self.bad_words_token_ids or ())
        return self.penalised or self.structured_outputs is not None or multi_token_bad_word

    @property
    def adjusts_logits(self) -> bool:
        return (
            self.needs_history
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
        )


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
