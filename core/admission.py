"""What a request must satisfy to be admitted at all, checked before it takes anything: the limits
the engine was built with, as plain numbers (the pools' own check stays with the block manager)."""

from __future__ import annotations

from dataclasses import dataclass

from mm_engine.request import ImageSpan
from mm_engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Admission:
    max_model_len: int
    max_image_tokens: int
    max_num_batched_tokens: int
    encoder_cache_bytes: int
    encoder_budget: int
    vocab_size: int
    bytes_per_embed: int  # one image embedding in the encoder cache (DeepStack features included)
    whole_images: bool  # an image's runs must be prefilled in one step (Gemma 3)
    refused_tokens: tuple[tuple[int, str], ...] = ()  # (id, why): placeholders the engine cannot serve

    def check(self, ids: list[int], spans: list[ImageSpan], params: SamplingParams) -> None:
        """Raise a ValueError naming the first limit the request breaks. The params are checked
        again here, at submission: they are a mutable dataclass a caller may have changed since
        building them (a route builds and validates them once; this is the core's own check)."""
        params.validate()
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"the prompt is {len(ids)} tokens, longer than max_model_len={self.max_model_len}"
            )
        self._token_ids(ids, spans)
        for k, span in enumerate(spans):
            self._image(k, span)
        for name, ids_ in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("bad_words_token_ids", [t for w in params.bad_words_token_ids or () for t in w]),
        ):
            over = next((t for t in ids_ if t >= self.vocab_size), None)
            if over is not None:
                last = self.vocab_size - 1
                raise ValueError(f"{name} token {over} is not a token id of this model (0 .. {last})")
        banned = {w[0] for w in params.bad_words_token_ids or () if len(w) == 1}
        if params.allowed_token_ids is not None and set(params.allowed_token_ids) <= banned:
            # Every logit would be -inf: nothing to sample, and NaN logprobs.
            raise ValueError("allowed_token_ids and bad_words together leave no token to sample")

    def _token_ids(self, ids: list[int], spans: list[ImageSpan]) -> None:
        """Every id the language model embeds must be one (image positions are replaced, so their
        placeholder ids may lie outside the vocabulary)."""
        replaced = {span.offset + i for span in spans for i in range(span.length) if span.is_embed(i)}
        refused = dict(self.refused_tokens)
        for pos, tok in enumerate(ids):
            if pos in replaced:
                continue
            if tok in refused:
                raise ValueError(f"prompt token {pos} is {refused[tok]}")
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < self.vocab_size:
                last = self.vocab_size - 1
                raise ValueError(f"prompt token {pos} is {tok!r}, not a token id of this model (0 .. {last})")

    def _image(self, k: int, span: ImageSpan) -> None:
        longest = max((hi - lo for lo, hi in span.embed_runs()), default=0)
        name = f"{'video' if span.video else 'image'} {k}"
        if self.whole_images and longest > self.max_num_batched_tokens:
            raise ValueError(
                f"{name} has a run of {longest} tokens, more than one step's budget "
                f"(max_num_batched_tokens={self.max_num_batched_tokens}); this model prefills "
                "an image in one step, so raise max_num_batched_tokens"
            )
        # A clip's tokens are bounded by its processor's budget (max_video_tokens) and max_model_len.
        if not span.video and span.length > self.max_image_tokens:
            raise ValueError(
                f"image {k} takes {span.length} tokens, more than max_image_tokens="
                f"{self.max_image_tokens}; raise max_image_tokens, or send a smaller image or a lower "
                "resolution through the model's mm_processor_kwargs (max_pixels, longest_edge or "
                "max_patches, by family)"
            )
        feat_bytes = span.num_embeds * self.bytes_per_embed
        if feat_bytes > self.encoder_cache_bytes:
            raise ValueError(
                f"{name}'s encoder output is {feat_bytes} bytes, larger than the encoder cache "
                f"({self.encoder_cache_bytes} bytes); raise encoder_cache_bytes"
            )
        if span.num_embeds > self.encoder_budget:
            fewer = " (or sample fewer frames: fps, num_frames, max_video_tokens)" if span.video else ""
            raise ValueError(
                f"{name} is {span.num_embeds} encoder tokens, more than the per-step encoder "
                f"budget ({self.encoder_budget}); raise max_num_encoder_tokens{fewer}"
            )
