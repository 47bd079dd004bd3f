"""The scheduler on its own: admission order and the running cap, the chunked-prefill token budget, draft
slots and their limits, preemption of the newest running request when pages run out, and finishing.
The engine drives the same scheduler in every engine test; here `commit` stands in for it."""
from __future__ import annotations

from specserve.config import SchedulerConfig
from specserve.kv_pages import PageAllocator
from specserve.scheduler import Scheduler
from specserve.types import Request, RequestStatus, SamplingParams, StepPlan

PAGE = 4


def scheduler(num_pages: int = 64, max_running: int = 8, budget: int = 64, max_model_len: int = 256,
              draft_slots: int = 0, chunk: int | None = None) -> Scheduler:
    config = SchedulerConfig(max_running_requests=max_running, max_num_batched_tokens=budget,
                             max_prefill_chunk=chunk)
    return Scheduler(config, PageAllocator(num_pages), PAGE, max_model_len, lambda req: draft_slots)


def request(rid: str, prompt_len: int, max_new_tokens: int = 16) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new_tokens))


def commit(plan: StepPlan, emitted: int = 1) -> None:
    """What the engine's commit does to the scheduler's view: fed tokens become computed, and a request
    that sampled gets `emitted` new tokens (the last of them not fed yet)."""
    for s in plan.scheduled:
        s.request.num_computed_tokens = s.start + s.num_feed
        if s.samples:
            s.request.num_computed_tokens += emitted - 1
            s.request.output_token_ids += [7] * emitted


def held_pages(sched: Scheduler) -> int:
    return sum(len(r.pages) for r in sched.running)


def test_admission_is_first_come_first_served_up_to_the_running_cap():
    sched = scheduler(max_running=2)
    reqs = [request(f"r{i}", 5) for i in range(3)]
    for r in reqs:
        sched.add(r)
    plan = sched.schedule()
    assert [s.request for s in plan.scheduled] == reqs[:2]
    assert all(s.start == 0 and s.num_feed == 5 and s.samples for s in plan.scheduled)
    assert [r.status for r in reqs] == [RequestStatus.RUNNING, RequestStatus.RUNNING, RequestStatus.WAITING]
    assert list(sched.waiting) == reqs[2:]
    commit(plan)
    plan = sched.schedule()
    # running requests come first, each feeding its one new token
    assert [(s.request, s.num_feed) for s in plan.scheduled] == [(reqs[0], 1), (reqs[1], 1)]


def test_a_long_prompt_is_prefilled_in_chunks_under_the_token_budget():
    sched = scheduler(budget=8)
    long = request("long", 20)
    sched.add(long)
    chunks = []
    while not chunks or not chunks[-1][2]:
        plan = sched.schedule()
        (s,) = plan.scheduled
        chunks.append((s.start, s.num_feed, s.samples))
        commit(plan)
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert len(long.pages) == 5            # the 20 prompt tokens; the sampled token's slot comes with its step


def test_the_budget_is_shared_and_a_later_request_gets_what_is_left():
    sched = scheduler(budget=10, chunk=10)
    first, second, third = request("a", 7), request("b", 6), request("c", 2)
    for r in (first, second, third):
        sched.add(r)
    plan = sched.schedule()
    assert [(s.request, s.num_feed, s.samples) for s in plan.scheduled] == [(first, 7, True), (second, 3, False)]
    assert list(sched.waiting) == [third]  # no budget left
    commit(plan)
    plan = sched.schedule()
    # the decode step of `first` (1 token) and the rest of `second`'s prompt go first, then `third` is admitted
    assert [(s.request, s.start, s.num_feed) for s in plan.scheduled] == [(first, 7, 1), (second, 3, 3), (third, 0, 2)]


def test_a_long_prefill_is_capped_while_others_wait_and_decoding_goes_first():
    """Alone, a long prompt takes the whole budget; once a short request arrives, the long one's chunks are
    capped so the short one starts in the same step, and decoding requests are planned first."""
    sched = scheduler(budget=64, chunk=16)
    long = request("long", 300)
    sched.add(long)
    plan = sched.schedule()
    assert [(s.request, s.num_feed) for s in plan.scheduled] == [(long, 64)]
    commit(plan)
    short = request("short", 5)
    sched.add(short)
    plan = sched.schedule()
    assert [(s.request, s.start, s.num_feed, s.samples) for s in plan.scheduled] == [
        (long, 64, 16, False), (short, 0, 5, True)]
    commit(plan)
    plan = sched.schedule()
    assert [(s.request, s.num_feed) for s in plan.scheduled] == [(short, 1), (long, 16)]
    assert scheduler(budget=64).config.max_prefill_chunk is None      # default: an eighth of the budget
    default = scheduler(budget=64)
    for r in (request("a", 40), request("b", 40)):
        default.add(r)
    assert [s.num_feed for s in default.schedule().scheduled] == [8, 8]


def test_draft_slots_are_reserved_within_budget_length_and_context():
    sched = scheduler(budget=64, max_model_len=20, draft_slots=4, chunk=64)
    roomy, short, near_end = request("roomy", 3, max_new_tokens=50), request("short", 3, 3), request("end", 14, 50)
    for r in (roomy, short, near_end):
        sched.add(r)
    plan = sched.schedule()
    # a prefill that ends in sampling may already carry drafts (the n-gram option drafts from the prompt)
    assert [s.max_drafts for s in plan.scheduled] == [4, 2, 4]
    commit(plan)
    plan = sched.schedule()
    by_id = {s.request.request_id: s for s in plan.scheduled}
    assert by_id["roomy"].max_drafts == 4
    assert by_id["short"].max_drafts == 1          # 3 new tokens allowed, 1 out: 2 more, one of them the bonus
    assert by_id["end"].max_drafts == 4            # 15 tokens of 20: 4 drafts and the bonus still fit
    for s in plan.scheduled:                       # every draft has a KV slot
        assert len(s.request.pages) * PAGE >= s.start + s.num_feed + s.max_drafts
    tight = scheduler(budget=3, draft_slots=4)
    tight.add(request("x", 2))
    assert tight.schedule().scheduled[0].max_drafts == 1    # 2 fed + 1 draft fill the budget


def test_the_newest_running_request_is_preempted_when_pages_run_out():
    sched = scheduler(num_pages=4, budget=64)
    old, new = request("old", 8, max_new_tokens=40), request("new", 7, max_new_tokens=40)
    sched.add(old)
    sched.add(new)
    plan = sched.schedule()                        # 2 + 2 pages: the pool is full
    assert [s.request for s in plan.scheduled] == [old, new] and sched.allocator.num_free == 0
    commit(plan)
    plan = sched.schedule()                        # `old` needs a third page for position 8
    assert plan.preempted == (new,)
    assert [s.request for s in plan.scheduled] == [old]
    assert new.status is RequestStatus.WAITING and new.pages == [] and new.num_preemptions == 1
    assert new.num_computed_tokens == 0 and new.output_token_ids == [7]   # recomputed later, tokens kept
    assert list(sched.waiting) == [new] and held_pages(sched) == 3


def test_finish_frees_pages_of_running_and_waiting_requests():
    sched = scheduler(max_running=1)
    running, waiting = request("a", 5), request("b", 5)
    sched.add(running)
    sched.add(waiting)
    sched.schedule()
    sched.finish(running, "stop")
    sched.finish(waiting, "abort")
    assert running.status is waiting.status is RequestStatus.FINISHED
    assert (running.finish_reason, waiting.finish_reason) == ("stop", "abort")
    assert not sched.has_unfinished and sched.allocator.num_free == sched.allocator.num_pages


def test_a_request_planned_in_this_step_is_never_the_preemption_victim():
    """Decoding requests are planned first; when a prefill chunk then lacks pages, the victim is the newest
    request not planned yet (here the prefilling one itself), never one whose step is already planned."""
    sched = scheduler(num_pages=5, budget=64, chunk=8)
    old, new = request("old", 30, max_new_tokens=40), request("new", 7, max_new_tokens=40)
    sched.add(old)
    sched.add(new)
    commit(sched.schedule())                 # old: 8 of 30 prompt tokens (2 pages); new: whole prompt (2 pages)
    plan = sched.schedule()                  # new decodes first; old's next chunk needs 2 more pages, 1 is free
    assert plan.preempted == (old,) and [s.request for s in plan.scheduled] == [new]
    assert all(len(s.request.pages) * PAGE >= s.start + s.num_feed for s in plan.scheduled)
