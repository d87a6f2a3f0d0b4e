"""Generate for a fixed set of prompts with one ModelRunner: the engine used on its own.

Every step feeds each unfinished sequence its next chunk (prompt chunks of at most
``prefill_chunk`` tokens, then one token at a time), all in one flat batch. No admission control
or preemption: the decode worker's scheduler does that; this loop is for tests and benchmarks of
the engine itself.
"""

from __future__ import annotations

from pdserve.engine.model_runner import BatchItem, ModelRunner
from pdserve.engine.sampler import sample
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    prefill_chunk: int | None = None,
) -> list[Sequence]:
    """Run every prompt to completion; return the finished sequences in prompt order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [Sequence(str(i), p, sp, runner.block_size, runner.device) for i, (p, sp) in enumerate(zip(prompts, plist))]
    alloc = runner.allocator
    try:
        active = list(seqs)
        while active:
            items, sampled = [], []
            for s in active:
                n = s.num_pending if prefill_chunk is None else min(s.num_pending, prefill_chunk)
                runner.kv.copy_blocks(s.block_table.reserve(alloc, s.num_computed + n))
                done_prefill = s.num_computed + n == len(s.token_ids)
                items.append(BatchItem(s.token_ids[s.num_computed : s.num_computed + n], s.num_computed,
                                       s.block_table.blocks, sample=done_prefill))
                s.mark_computed(s.num_computed + n)
                s.start_running()
                if done_prefill:
                    sampled.append(s)
            logits = runner.execute(items)
            if sampled:
                tokens, logprobs, failed = sample(logits, [s.params for s in sampled],
                                                  [s.next_generator() for s in sampled])
                for j, s in enumerate(sampled):
                    if j in failed:  # only this sequence ends; the others go on
                        s.finish("error")
                        s.block_table.release(alloc)
                        continue
                    reason = s.append_token(tokens[j], logprobs[j] if logprobs else None,
                                            runner.eos_token_ids, runner.max_model_len)
                    if reason:
                        s.finish(reason)
            active = [s for s in active if not s.is_finished]
    finally:
        for s in seqs:
            s.block_table.release(alloc)
    return seqs
