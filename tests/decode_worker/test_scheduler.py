"""The scheduler as plain data: what ``schedule()`` returns for a given state, without a model.

A fake step (``run``) does what the engine thread does with a ``SchedulerOutput``: it advances each
scheduled sequence by its tokens and appends a token to each one that finished its prompt.
"""

from __future__ import annotations

from pdserve.decode_worker.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.engine.block_allocator import BlockAllocator
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence, SequenceStatus

BS = 4  # block size


def seq(rid: str, prompt_len: int, max_tokens: int = 100) -> Sequence:
    return Sequence(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), BS)


def make(num_blocks: int, budget: int = 512, max_seqs: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
                     BlockAllocator(num_blocks), max_model_len=512)


def run(out: SchedulerOutput) -> None:
    """Apply a step's output as the engine thread does (the sampled token is always 7)."""
    for sch in out.scheduled:
        s = sch.seq
        s.num_computed += sch.num_tokens
        s.block_table.num_tokens = s.num_computed
        if s.num_computed == len(s.token_ids):
            s.token_ids.append(7)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(x.seq.request_id, x.num_tokens) for x in out.scheduled]


def running_state(sched: Scheduler, s: Sequence, num_computed: int) -> None:
    """Put ``s`` in the running queue (admitted now) holding the blocks of ``num_computed`` tokens."""
    s.block_table.reserve(sched.allocator, num_computed)
    s.mark_computed(num_computed)
    s.start_running()
    sched.running.append(s)


def test_whole_prompts_are_admitted_in_one_step_when_budget_allows():
    sched = make(64)
    for rid, n in [("a", 5), ("b", 9), ("c", 2)]:
        sched.add(seq(rid, n))
    out = sched.schedule()
    assert plan(out) == [("a", 5), ("b", 9), ("c", 2)]
    assert [s.request_id for s in sched.running] == ["a", "b", "c"]
    assert not sched.waiting
    # Blocks for exactly the scheduled tokens: 2 + 3 + 1.
    assert sched.allocator.num_free == sched.allocator.num_blocks - 6


def test_decodes_come_before_prefill_chunks_and_the_budget_is_respected():
    sched = make(64, budget=6)
    sched.add(seq("long", 10))  # admitted first: its prompt is chunked
    out = sched.schedule()
    assert plan(out) == [("long", 6)]
    run(out)
    sched.add(seq("short", 2))
    # long still prefills (4 left): it takes the whole budget minus nothing decoding; short waits
    out = sched.schedule()
    assert plan(out) == [("long", 4), ("short", 2)]
    run(out)
    # both decode now; add a new long prompt: the decodes go first, the chunk gets the rest
    sched.add(seq("new", 20))
    out = sched.schedule()
    assert plan(out) == [("long", 1), ("short", 1), ("new", 4)]
    assert out.num_tokens == 6
    run(out)
    # a prefilling sequence ahead of decoders in the running queue still comes after them
    assert [s.request_id for s in sched.running] == ["long", "short", "new"]
    sched.running.insert(0, sched.running.pop())  # "new" (prefilling) first in admission order
    out = sched.schedule()
    assert plan(out) == [("long", 1), ("short", 1), ("new", 4)]


def test_budget_smaller_than_the_decodes_defers_the_rest():
    sched = make(64, budget=2)
    for rid in "abc":
        sched.add(seq(rid, 1))
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 1)]  # c waits: no budget left
    assert [s.request_id for s in sched.waiting] == ["c"]
    run(out)
    out = sched.schedule()
    assert out.num_tokens <= 2
    assert plan(out) == [("a", 1), ("b", 1)]


def test_max_num_seqs_bounds_the_running_batch():
    sched = make(64, max_seqs=2)
    seqs = [seq(str(i), 3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert plan(out) == [("0", 3), ("1", 3)]
    run(out)
    out = sched.schedule()
    assert plan(out) == [("0", 1), ("1", 1)]  # nobody admitted while 2 run
    run(out)
    sched.finish(seqs[0], "length")
    out = sched.schedule()
    assert plan(out) == [("1", 1), ("2", 3)]  # a slot freed: the oldest waiting one joins
    assert len(sched.running) == 2


def test_admission_only_when_the_first_chunk_blocks_can_be_reserved():
    sched = make(4)  # 16 token slots
    a, b, c = seq("a", 12), seq("b", 8), seq("c", 2)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    # a takes 3 blocks; b needs 2, only 1 is free: b waits, and c (which would fit) does not jump
    # the queue (admission is first come, first served)
    assert plan(out) == [("a", 12)]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    assert b.block_table.blocks == [] and c.block_table.blocks == []
    assert sched.allocator.num_free == 1
    run(out)
    sched.finish(a, "stop")
    assert sched.allocator.num_free == 4
    out = sched.schedule()
    assert plan(out) == [("b", 8), ("c", 2)]


def test_admission_with_a_small_budget_reserves_only_the_first_chunk():
    sched = make(64, budget=8)
    s = seq("a", 30)
    sched.add(s)
    out = sched.schedule()
    assert plan(out) == [("a", 8)]
    assert len(s.block_table.blocks) == 2


def test_preemption_picks_the_most_recently_admitted():
    sched = make(6)
    seqs = [seq(r, 8) for r in "abc"]
    for s in seqs:
        sched.add(s)
    run(sched.schedule())  # all three prefilled 8 tokens = 2 blocks each: the pool is full
    assert sched.allocator.num_free == 0
    # each now needs a third block for its 9th token: c (admitted last) makes room for a and b
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["c"]
    assert plan(out) == [("a", 1), ("b", 1)]
    c = seqs[2]
    assert c.status is SequenceStatus.WAITING and c.num_computed == 0 and c.block_table.blocks == []
    assert c.num_preemptions == 1 and c.num_pending == 9  # recomputed from prompt + its token
    assert list(sched.waiting) == [c]
    run(out)


def test_preempted_sequences_go_first_and_nobody_is_admitted_in_that_step():
    sched = make(6)
    seqs = [seq(r, 8) for r in "abc"]
    for s in seqs:
        sched.add(s)
    run(sched.schedule())
    sched.add(seq("late", 1))
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["c"]
    assert "late" not in [r for r, _ in plan(out)]
    assert [s.request_id for s in sched.waiting] == ["c", "late"]


def test_a_decoding_sequence_admitted_last_yields_itself_not_an_older_prefill():
    """The most recently admitted sequence is the victim even when it is the one asking for a block
    (as in vLLM): an older sequence that is still prefilling keeps its KV."""
    sched = make(4, budget=8)
    old = seq("old", 16)
    new = seq("new", 4)
    running_state(sched, old, 12)  # 3 blocks, 4 prompt tokens to go
    running_state(sched, new, 4)  # 1 block, decoding its first output token next
    new.token_ids.append(7)
    assert sched.allocator.num_free == 0
    out = sched.schedule()
    assert [s.request_id for s in out.preempted] == ["new"]
    assert plan(out) == [("old", 4)]
    assert old.num_preemptions == 0 and len(old.block_table.blocks) == 4


def test_a_sequence_that_cannot_fit_beside_scheduled_ones_yields_itself():
    sched = make(3, budget=8)
    a, b = seq("a", 4), seq("b", 7)
    running_state(sched, a, 4)
    a.token_ids.append(7)  # decodes next: needs a second block
    running_state(sched, b, 4)  # prefilling: needs a second block for its last 3 tokens
    assert sched.allocator.num_free == 1
    out = sched.schedule()
    # a goes first (decode) and takes the free block; b, the newest, yields itself
    assert plan(out) == [("a", 1)]
    assert [s.request_id for s in out.preempted] == ["b"]
    assert sched.allocator.num_free == sched.allocator.num_blocks - 2


def test_finish_frees_blocks_of_running_and_waiting_sequences():
    sched = make(8, max_seqs=1)
    a, b = seq("a", 8), seq("b", 4)
    sched.add(a)
    sched.add(b)
    run(sched.schedule())
    assert sched.allocator.num_free == sched.allocator.num_blocks - 2
    sched.finish(b, "abort")  # still waiting
    sched.finish(a, "abort")  # running
    assert sched.allocator.num_free == sched.allocator.num_blocks
    assert not sched.has_work
    assert a.finish_reason == b.finish_reason == "abort"
