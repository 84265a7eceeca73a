"""min_tokens, logit_bias, repetition/frequency/presence penalties and min_p, batched, against a
plain per-row, per-token reference written from their definitions (vLLM's and OpenAI's); then
through the engine, also with async scheduling (where a penalty waits for the step in flight)."""

from __future__ import annotations

import pytest
import torch

from mm_engine import LLM, SamplingParams
from mm_engine.core.logit_adjust import RowContext, adjust_logits
from mm_engine.core.sampler import Sampler

VOCAB = 12


def _reference(
    logits: list[float], p: SamplingParams, prompt: list[int], output: list[int], stops
) -> list[float]:
    out = list(logits)
    if len(output) < p.min_tokens:
        for t in stops:
            out[t] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    for word in p.bad_words_token_ids or ():
        if len(word) == 1 or output[len(output) - len(word) + 1 :] == word[:-1]:
            out[word[-1]] = float("-inf")
    for t in range(VOCAB):
        if p.repetition_penalty != 1.0 and (t in prompt or t in output):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        n = output.count(t)
        out[t] -= p.frequency_penalty * n + (p.presence_penalty if n else 0.0)
    return out


CASES = [
    (SamplingParams(), [1, 2], [3]),
    (SamplingParams(frequency_penalty=0.7), [1, 2], [3, 3, 5, 3]),
    (SamplingParams(presence_penalty=-1.2), [4], [3, 3, 6]),
    (SamplingParams(repetition_penalty=1.8), [1, 2, 2, 40], [2, 7]),  # 40: an image id outside the vocabulary
    (SamplingParams(repetition_penalty=0.6, frequency_penalty=0.3, presence_penalty=0.5), [0], [0, 1, 1]),
    (SamplingParams(logit_bias={2: 5.0, 9: -100.0}), [1], []),
    (SamplingParams(min_tokens=3, max_tokens=8), [1], [4, 5]),  # masked: 2 < 3
    (SamplingParams(min_tokens=2, max_tokens=8, logit_bias={11: 3.0}), [1], [4, 5]),  # not masked
    # bad words: 8 always; 9 after "4 5" (it ends the output); 10 after "7 4" (it does not)
    (SamplingParams(bad_words_token_ids=[[8], [4, 5, 9], [7, 4, 10]], presence_penalty=0.5), [1], [4, 5]),
]


def test_batched_adjustments_equal_the_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((len(CASES), VOCAB), generator=gen) * 3
    stops = frozenset({11, 0})
    params = [p for p, _, _ in CASES]
    rows = [RowContext.of([*prompt, *out], len(prompt), stops, p) for p, prompt, out in CASES]
    got = adjust_logits(logits.clone(), params, rows)
    for i, (p, prompt, out) in enumerate(CASES):
        want = torch.tensor(_reference(logits[i].tolist(), p, prompt, out, stops))
        torch.testing.assert_close(got[i], want, msg=f"case {i}")


def test_a_requests_tensors_are_made_once_and_a_steps_view_of_its_output_stays_fixed():
    from types import SimpleNamespace

    from mm_engine.core.logit_adjust import row_contexts

    params = SamplingParams(frequency_penalty=1.0, logit_bias={t: 1.0 for t in range(VOCAB)})
    req = SimpleNamespace(params=params, token_ids=[1, 2], prompt_token_ids=[1, 2], num_prompt_tokens=2,
                          eos_token_ids=frozenset({0}), grammar=None, logit_state=None)  # fmt: skip
    seen, states = [], []
    for step in range(100):  # past the first buffer's capacity: the views handed out keep theirs
        (row,) = row_contexts([req], VOCAB)
        seen.append(row.output)
        states.append(row.state)
        req.token_ids.append(step % VOCAB)
    assert all(s is req.logit_state for s in states)
    assert [v.tolist() for v in seen] == [[t % VOCAB for t in range(k)] for k in range(100)]
    req.token_ids.append(-1)  # a placeholder (a token in flight) is not copied
    assert row_contexts([req], VOCAB)[0].output.numel() == 100


def test_min_p_drops_tokens_below_its_share_of_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = Sampler._filtered_probs(logits, [SamplingParams(min_p=0.35)])
    assert probs[0, 2] == probs[0, 3] == 0  # below 0.35 * 0.5
    torch.testing.assert_close(probs[0, :2], torch.tensor([0.625, 0.375]))
    sampler, params = Sampler(), [SamplingParams(min_p=0.35)]
    seen = {sampler.sample(logits, params, [torch.Generator().manual_seed(s)])[0] for s in range(60)}
    assert seen == {0, 1}


def test_the_sampler_needs_each_rows_context_for_adjustments():
    with pytest.raises(ValueError, match="context"):
        Sampler().sample(torch.zeros((1, VOCAB)), [SamplingParams(frequency_penalty=1.0)], [None])


def test_params_are_validated_by_name():
    bad = [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
    ]
    for kwargs, name in bad:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


def _counts(ids: list[int]) -> int:
    return max(ids.count(t) for t in set(ids))


@pytest.mark.parametrize("mode", [None, "inline", "thread"])
def test_through_the_engine(clip_llama, mode):
    kw = {} if mode is None else dict(async_scheduling=True, async_launch=mode)
    llm = LLM(clip_llama, kv_cache_memory_bytes=8 * 1024**2, **kw)
    prompt = "USER: bottom bottom ASSISTANT:"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert _counts(plain.token_ids) > 3  # the tiny model repeats itself
    penalised = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                    frequency_penalty=2.0, presence_penalty=2.0))  # fmt: skip
    ids = penalised[0].outputs[0].token_ids
    assert _counts(ids) < _counts(plain.token_ids)
    banned = plain.token_ids[0]
    biased = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, logit_bias={banned: -100.0}))
    assert banned not in biased[0].outputs[0].token_ids
    eos = sorted(llm.engine.frontend.eos_token_ids)[0]
    forced = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=6, logit_bias={eos: 100.0}, min_tokens=4)
    )
    out = forced[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "stop"  # EOS as soon as min_tokens allows
    with pytest.raises(ValueError, match="logit_bias token"):
        llm.generate(prompt, SamplingParams(logit_bias={10**6: 1.0}))
    # allowed_token_ids: sampled (not greedy) from those only, the batch's other rows untouched.
    allowed = sorted(set(plain.token_ids[1:4]))
    mixed = llm.generate(
        [prompt, prompt],
        [SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed),
         SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)],
    )  # fmt: skip
    assert set(mixed[0].outputs[0].token_ids) <= set(allowed)
    assert mixed[1].outputs[0].token_ids == plain.token_ids
    with pytest.raises(ValueError, match="allowed_token_ids token"):
        llm.generate(prompt, SamplingParams(allowed_token_ids=[10**6]))
    with pytest.raises(ValueError, match="allowed_token_ids must be"):
        SamplingParams(allowed_token_ids=[])
    # bad_words_token_ids: a pair the plain output writes is never written in that order.
    a, b = plain.token_ids[2], plain.token_ids[3]
    banned = (
        llm.generate(
            prompt,
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words_token_ids=[[a, b]]),
        )[0]
        .outputs[0]
        .token_ids
    )
    assert all((x, y) != (a, b) for x, y in zip(banned, banned[1:], strict=False))
    assert banned[:3] == plain.token_ids[:3]
    with pytest.raises(ValueError, match="bad_words_token_ids token"):
        llm.generate(prompt, SamplingParams(bad_words_token_ids=[[10**6]]))
    with pytest.raises(ValueError, match="leave no token"):
        llm.generate(prompt, SamplingParams(allowed_token_ids=[a], bad_words_token_ids=[[a]]))
    with pytest.raises(ValueError, match="bad_words must be"):
        SamplingParams(bad_words=["  "])


def test_penalised_tokens_are_the_same_with_async_scheduling(clip_llama):
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3 + 0.1 * i,
                             frequency_penalty=0.5) for i in range(4)]  # fmt: skip
    prompts = [f"USER: bottom {'left ' * i}ASSISTANT:" for i in range(4)]
    want = [o.outputs[0].token_ids for o in LLM(clip_llama, max_num_seqs=2).generate(prompts, params)]
    llm = LLM(clip_llama, max_num_seqs=2, async_scheduling=True, async_launch="thread")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_row_left_with_no_token_ends_its_request_and_no_other(clip_llama, async_scheduling):
    """`a` once, then `a a` is a bad word and min_tokens masks EOS: nothing is left to sample. The
    request ends ("abort") with the tokens it had, rather than a made-up token with a NaN logprob."""
    from helpers.families import assert_all_free

    kw = dict(async_scheduling=True, async_launch="thread") if async_scheduling else {}
    llm = LLM(clip_llama, kv_cache_memory_bytes=8 * 1024**2, max_num_seqs=2, **kw)
    prompt = "USER: bottom left ASSISTANT:"
    eos = sorted(llm.engine.frontend.eos_token_ids)[0]
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = 5
    stuck = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, allowed_token_ids=[a, eos],
                           bad_words_token_ids=[[a, a]], logprobs=2)  # fmt: skip
    want = llm.generate(prompt, plain)[0].outputs[0].token_ids
    out = llm.generate([prompt, prompt], [stuck, plain])
    ended, other = out[0].outputs[0], out[1].outputs[0]
    assert ended.token_ids == [a] and ended.finish_reason == "abort"
    assert all(x.logprob == x.logprob for step in ended.logprobs for x in step.values())  # no NaN
    assert other.token_ids == want and other.finish_reason == "length"
    assert_all_free(llm)


def test_the_openai_client_sends_them_and_gets_the_offline_answer(clip_llama):
    from helpers.api import served_in_process

    kw = dict(kv_cache_memory_bytes=8 * 1024**2)
    messages = [{"role": "user", "content": "bottom bottom"}]
    params = SamplingParams(temperature=0, max_tokens=12, frequency_penalty=1.5, presence_penalty=0.5,
                            repetition_penalty=1.2, logit_bias={5: -100.0, 7: 4.0}, min_tokens=3)  # fmt: skip
    want = LLM(clip_llama, **kw).chat(messages, params)[0].outputs[0].text
    with served_in_process(clip_llama, **kw) as (client, http):
        got = client.chat.completions.create(
            model="m", messages=messages, max_tokens=12, temperature=0, frequency_penalty=1.5,
            presence_penalty=0.5, logit_bias={"5": -100, "7": 4},
            extra_body={"repetition_penalty": 1.2, "min_tokens": 3},
        )  # fmt: skip
        assert got.choices[0].message.content == want
        bad = http.post("/v1/chat/completions", json={"messages": messages, "logit_bias": {"x": 1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"
        bad = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "min_tokens": 9})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_tokens"
        far = http.post("/v1/chat/completions", json={"messages": messages, "logit_bias": {"9999999": 1}})
        assert far.status_code == 400 and "logit_bias token" in far.json()["error"]["message"]
