"""transformers' `generate`, greedy, one request at a time: the reference every engine output is
compared with."""

from __future__ import annotations

import torch


class Reference:
    """`LlavaForConditionalGeneration.generate`, greedy, one request at a time."""

    def __init__(self, path: str) -> None:
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(path)
        self.model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def generate(self, prompt: str, images: list | None, max_new_tokens: int) -> list[int]:
        inputs = self.processor(text=prompt, images=images or None, return_tensors="pt")
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()


class FamilyReference:
    """transformers' `generate` for any family (AutoModelForImageTextToText), greedy, one request
    at a time, inputs from the checkpoint's own processor."""

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.path = path
        self.processor = AutoProcessor.from_pretrained(path)
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()

    def inputs(self, prompt: str, images: list | None, **kwargs):
        if images and self.model.config.model_type == "llava_onevision":
            images = [images]  # one prompt's images, nested: OneVision tiles only a lone image
        return self.processor(text=prompt, images=images or None, return_tensors="pt", **kwargs)

    @torch.inference_mode()
    def generate(self, prompt: str, images: list | None, max_new_tokens: int, **kwargs) -> list[int]:
        inputs = self.inputs(prompt, images, **kwargs)
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()
