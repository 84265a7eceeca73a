"""What every family beyond LLaVA-1.5 must do alike: a repeated image reuses prefix KV and is
encoded once (then comes from the encoder cache after different text), and `LLM.chat` goes
through the checkpoint's own template; tokens equal transformers' `generate` throughout."""

from __future__ import annotations

import pytest

from helpers.families import ALL_FAMILIES, assert_all_free, engine, family_prompt, greedy, mm
from helpers.images import make_image


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def family(request, vl_family):
    return request.param, *vl_family(request.param)


def test_repeated_image_reuses_prefix_and_is_encoded_once(family):
    name, path, ref = family
    llm = engine(path, "torch")
    img = make_image(9, (100, 60))
    first = [
        (family_prompt(name, "what is this", 1), [img]),
        (family_prompt(name, "what color is it", 1), [img]),
    ]
    outs = llm.generate([mm(p, i) for p, i in first], greedy(6))
    for out, (text, imgs) in zip(outs, first, strict=True):
        assert out.outputs[0].token_ids == ref.generate(text, imgs, 6)
    assert outs[1].num_cached_tokens > 0  # the shared prompt start, image included
    assert llm.engine.core.runner.num_encoded_images == 1
    # The same picture after different text: no shared prefix, but the encoder cache has it.
    late = family_prompt(name, f"tell me about this photo {llm.engine.inputs.image_token} please")
    out = llm.generate(mm(late, [img]), greedy(6))[0]
    assert out.outputs[0].token_ids == ref.generate(late, [img], 6)
    assert llm.engine.core.runner.num_encoded_images == 1
    assert_all_free(llm)


def test_chat_goes_through_the_checkpoint_template(family):
    from helpers.api import data_url, image_bytes

    _, path, ref = family
    img = make_image(7, (50, 40))
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(image_bytes(7, size=(50, 40)))}},
        {"type": "text", "text": "what is this"},
    ]
    out = engine(path).chat([{"role": "user", "content": parts}], greedy(8))[0]
    text = ref.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert out.prompt == text
    assert out.outputs[0].token_ids == ref.generate(text, [img], 8)
