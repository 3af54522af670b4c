"""An offline batch job under option.scheduling_policy=length-batched on the real processes:
rows grouped by their length hints, one row stopped by FCR at its group's limit and
recomputed later, every output token-identical to model.generate on the row alone."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from bench.metrics import scrape
from client.offline import OfflineModel
from tests import reference

MAX_NEW = 24
PREEMPTIONS = "seqserve_num_preemptions_total"


def test_fcr_failure_is_recomputed_token_identical(llama_dir, deploy):
    # Buckets of 8 tokens: the row hinted 2 tokens has a limit of 8 and is stopped by FCR
    # before it (8 less the margin for tokens in flight), then runs again after the rest
    # with room for MAX_NEW; the rows hinted MAX_NEW are never stopped.
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
    assert scrape(d.metrics_url)[PREEMPTIONS] >= 2  # rows hinted 2 and 10 outgrow 8 and 16
    for prompt, out in zip(prompts, outputs):
        assert len(out) == MAX_NEW
        assert reference.same_until_eos(out, reference.greedy(llama_dir, prompt, MAX_NEW),
                                        tokenizer.eos_token_id)
