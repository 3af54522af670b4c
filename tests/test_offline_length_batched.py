"""An offline batch job under option.scheduling_policy=length-batched on the real processes:
rows grouped by their length hints, one row stopped by FCR at its group's limit and
recomputed later, every output token-identical to model.generate on the row alone; and
GenerateRequest.eos_after_tokens ending a response where a benchmark's trace says."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from bench.metrics import scrape
from client.api import build_request
from client.offline import OfflineModel
from seqserve.v1 import generate_pb2
from tests import reference

MAX_NEW = 24
PREEMPTIONS = "seqserve_num_preemptions_total"


# Slow: a deployment's start dominates it (about 20 s of wall time on a quiet-ish machine),
# and `make test` is at its 15-minute budget; tests/test_length_batched.py covers the
# planning in the fast suite.
@pytest.mark.slow
def test_fcr_failure_is_recomputed_token_identical(llama_dir, deploy):
    # Buckets of 8 tokens: the row hinted 2 tokens has a limit of 8 and is stopped by FCR
    # there, then runs again after the rest with room for MAX_NEW (so does the row hinted
    # 10, at 16); the rows hinted MAX_NEW are never stopped.
    d = deploy(llama_dir, scheduling_policy="length-batched", length_bucket_tokens=8,
               max_rolling_batch_size=2)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    rng = random.Random(7)
    prompts = [reference.prompt_of_tokens(tokenizer, n, rng) for n in (5, 9, 7, 12)]
    rows = [tokenizer(p).input_ids for p in prompts]
    hints = [MAX_NEW, 2, MAX_NEW, 10]
    with OfflineModel(d.address, timeout=120, max_in_flight=len(rows)) as model:
        outputs = model.generate(rows, pad_token=-1, max_new_tokens=MAX_NEW, ignore_eos=True,
                                 include_prompt=False, length_hints=hints)
        # A benchmark's trace length: ended there as by EOS, unseen by the policy.
        [cut] = model.run_requests([build_request(rows[0], max_new_tokens=MAX_NEW,
                                                  ignore_eos=True, eos_after_tokens=5)])
    assert [t.id for t in cut.tokens] == outputs[0][:5]
    assert cut.finish_reason == generate_pb2.FINISH_REASON_EOS
    assert scrape(d.metrics_url)[PREEMPTIONS] >= 2  # rows hinted 2 and 10 outgrow 8 and 16
    for prompt, out in zip(prompts, outputs):
        assert len(out) == MAX_NEW
        assert reference.same_until_eos(out, reference.greedy(llama_dir, prompt, MAX_NEW),
                                        tokenizer.eos_token_id)


# Slow for the same reason: one more deployment.
@pytest.mark.slow
def test_http_and_openai_take_the_length_hint_and_the_eos_position(llama_dir, deploy):
    """/invocations (in `parameters`) and the OpenAI endpoints (extra body fields) take
    generate.proto's length_hint and eos_after_tokens: the response ends as by EOS where
    told, the hint is the policy's prediction (its error is the hint's distance from the
    real length), and bad values are refused naming the field."""
    from tests.test_priority import _post

    d = deploy(llama_dir, scheduling_policy="length-batched", length_bucket_tokens=8)
    url, completions = d.http_url + "/invocations", d.openai_url + "/completions"
    status, body = _post(url, {"inputs": "hello", "parameters": {
        "max_new_tokens": 8, "ignore_eos": True, "length_hint": 6, "eos_after_tokens": 3}})
    assert status == 200, body
    assert (body["details"]["finish_reason"], body["details"]["generated_tokens"]) == ("eos", 3)
    status, body = _post(completions, {"prompt": "hello", "max_tokens": 8, "ignore_eos": True,
                                       "length_hint": 7, "eos_after_tokens": 4})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "stop"
    m = scrape(d.metrics_url)
    assert m["seqserve_length_predictions_total"] == 2
    assert m["seqserve_length_prediction_error_tokens_total"] == (6 - 3) + (7 - 4)

    for params, message in (({"eos_after_tokens": 0}, "eos_after_tokens must be >= 1"),
                            ({"length_hint": "long"}, "length_hint must be an integer >= 1")):
        status, body = _post(url, {"inputs": "hello", "parameters": params})
        assert status == 400 and message in body["error"], body
    for extra, message in (({"length_hint": 0}, "length_hint must be >= 1"),
                           ({"num_beams": 2, "eos_after_tokens": 2},
                            "eos_after_tokens does not work with beam search")):
        status, body = _post(completions, {"prompt": "hello", "max_tokens": 4, **extra})
        assert status == 400 and message in body["error"]["message"], body
        assert body["error"]["param"] == next(k for k in extra if k != "num_beams")
