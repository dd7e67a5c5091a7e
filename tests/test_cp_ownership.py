"""Page ownership under context parallelism (issue 22, build item 2, acceptance 3).

Device page `q` is owned by CP rank `q % N`; page k of any path from a root must be owned by
rank `k % N`. Requests go through the real admission, hand-off and cache (match, insert,
host load-back, eviction, flush) in random sequences, and after every step: each running
request's pages keep the owner cycle, every tree node's rotation is its first page's owner,
the per-class free counts add up, and the tree refuses an extension on the wrong owner. At
N = 1 a fixed sequence hands out exactly the page ids it did before ownership existed.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpu_worker.cache.hicache import CacheConfig, PrefixCache
from gpu_worker.memory.allocator import PageAllocator, PageId
from gpu_worker.memory.device_pool import DeviceKVPool
from gpu_worker.memory.kv_spec import KVSpec
from gpu_worker.model.sampling import SamplingParams
from gpu_worker.scheduler.admission import Admission
from gpu_worker.scheduler.config import SchedulerConfig
from gpu_worker.scheduler.handoff import KVHandOff
from gpu_worker.scheduler.request import RemoteKV, Req, ReqState

CPU = torch.device("cpu")
PS = 2
NUM_PAGES = 24
SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, page_size=PS, dtype=torch.float32)
# shared prefixes (A/B/C and A/B/E of Figure 1a, page size 2), so requests hit and branch
PREFIXES = ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [1, 2, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5], [])


class Sim:
    """One rank's cache driven the way the scheduler drives it: admit, load, compute, hand
    off. A request's compute writes nothing (ownership is about page ids, not rows)."""

    def __init__(self, cp_size: int, write_policy: str | None, max_running: int = 3) -> None:
        cfg = CacheConfig(
            page_size=PS,
            num_device_pages=NUM_PAGES,
            enable_hierarchical_cache=write_policy is not None,
            hicache_ratio=0.75,
            hicache_write_policy=write_policy or "write_through",
        )
        self.cp_size = cp_size
        self.cache = PrefixCache(cfg, SPEC, CPU, cp_size=cp_size)
        self.admission = Admission(SchedulerConfig(max_running_requests=max_running), self.cache)
        self.handoff = KVHandOff(self.cache, None, CPU)  # type: ignore[arg-type]  # no export
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.next_rid = 0
        self.next_token = 100  # output tokens never repeat, so outputs branch the tree
        self.handed_out: list[list[int]] = []  # each admitted request's pages, in order

    def submit(self, prompt: list[int], max_new: int, remote: bool | None = None) -> None:
        req = Req(self.next_rid, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
        if remote is not None:
            req.remote = RemoteKV(reuse=remote)
        self.next_rid += 1
        self.waiting.append(req)
        self.admit()

    def admit(self) -> None:
        before = set(self.running)
        self.admission.admit(self.waiting, self.running)
        self.handed_out += [list(r.page_ids) for r in self.running if r not in before]

    def step(self, which: int) -> None:
        """Consume every ACK, then advance running request `which` by one forward."""
        self.cache.drain()
        self.admission.finish_loads(self.running)
        ready = [r for r in self.running if r.state is not ReqState.LOADING]
        if ready:
            req = ready[which % len(ready)]
            if req.state in (ReqState.PREFILL, ReqState.RECEIVING):
                req.lens.computed_len = req.prompt_len
                self.handoff.cache_prompt(req)
                req.state = ReqState.DECODE
            self.next_token += 1
            req.append_outputs([self.next_token], ())
            if req.finish_reason is not None:
                self.handoff.finish(req)
                self.running.remove(req)
        self.admit()

    def join_off_cycle(self, prompt: list[int], extra_pages: int, shift: int) -> bool:
        """Extend `prompt`'s cached device prefix by pages allocated `shift` owners off its
        cycle; the tree must refuse the insert and change nothing. Whether it was tried."""
        cache = self.cache
        match = cache.tree.match_prefix(prompt)
        cache.lock(match.last_device_node)
        start = match.device_len // PS
        bad = cache.alloc(extra_pages, start + shift)
        if bad is None:
            cache.unlock(match.last_device_node)
            return False
        ids = prompt[: match.device_len] + [60 + i for i in range(extra_pages * PS)]
        before = shape(cache)
        with pytest.raises(ValueError, match="owned by CP rank"):
            cache.insert(ids, list(match.device_page_ids) + bad, match.device_len)
        assert shape(cache) == before
        cache.free(bad)
        cache.unlock(match.last_device_node)
        return True

    def check(self) -> None:
        n, cache = self.cp_size, self.cache
        # a load whose ACK was consumed (maybe by a write_back eviction) hands its request
        # the tree's pages first, as the scheduler's next step does: its unused ones are free
        self.admission.finish_loads(self.running)
        held: set[int] = set()
        for req in self.running:
            owners = [p % n for p in req.page_ids]
            assert owners == [k % n for k in range(len(owners))], (req.rid, req.page_ids)
            held.update(req.page_ids)
        cache.check_integrity(held)  # the tree's rotation invariant included (tree_check)
        for node in cache.tree.iter_nodes():
            pages = node.device_page_ids
            start = node.path_len() - len(node.key)
            if pages is not None:
                assert node.owner_rotation == pages[0] % n, node
                assert node.owner_rotation == (start // PS) % n, node
            # host pages keep the cycle too: a page's backup and load stay on its owner
            host = node.host_page_ids
            if host is not None:
                cycle = [(start // PS + i) % n for i in range(len(host))]
                assert [h % n for h in host] == cycle, node
        loads = any(r.state is ReqState.LOADING for r in self.running)
        if not cache.num_queued_acks and not loads:  # no page between a request and the tree
            allocator = cache.device_pool.allocator
            in_use = cache.tree.device_page_set() | held
            for o in range(n):
                used = sum(1 for p in in_use if p % n == o)
                assert allocator.num_free_of(o) + used == len(range(o, NUM_PAGES, n)), o
        if cache.host_pool is not None and not cache.num_queued_acks and not cache.storage:
            host_allocator, num_host = cache.host_pool.allocator, cache.host_pool.num_pages
            assert host_allocator.num_owners == n  # host pages are owner-classed as well
            in_host = cache.tree.host_page_set()
            for o in range(n):
                used = sum(1 for h in in_host if h % n == o)
                assert host_allocator.num_free_of(o) + used == len(range(o, num_host, n)), o


def shape(cache: PrefixCache) -> tuple[Any, ...]:
    tree = cache.tree
    nodes = sorted((n.id, n.path_len(), n.owner_rotation) for n in tree.iter_nodes())
    return nodes, tree.device_page_set(), tree.host_page_set(), cache.num_free_device_pages


def prompt_of(prefix: int, tail: list[int]) -> list[int]:
    return PREFIXES[prefix] + tail + [0]  # the last token is never matched in full


class OwnershipMachine(RuleBasedStateMachine):
    sim: Sim | None = None

    @initialize(
        cp_size=st.sampled_from([2, 3, 4]),
        policy=st.sampled_from([None, "write_through", "write_through_selective", "write_back"]),
    )
    def start(self, cp_size: int, policy: str | None) -> None:
        self.sim = Sim(cp_size, policy)

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        tail=st.lists(st.integers(1, 4), max_size=5),
        max_new=st.integers(1, 3),
        remote=st.sampled_from([None, None, False, True]),
    )
    def submit(self, prefix: int, tail: list[int], max_new: int, remote: bool | None) -> None:
        assert self.sim is not None
        self.sim.submit(prompt_of(prefix, tail), max_new, remote)

    @rule(which=st.integers(0, 2))
    def step(self, which: int) -> None:
        assert self.sim is not None
        self.sim.step(which)

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), tail=st.lists(st.integers(1, 4), max_size=3))
    def match(self, prefix: int, tail: list[int]) -> None:
        """A match splits nodes where it ends; rotations must follow the split."""
        assert self.sim is not None
        self.sim.cache.match(prompt_of(prefix, tail))

    @rule(num_pages=st.integers(1, 8))
    def evict(self, num_pages: int) -> None:
        assert self.sim is not None
        self.sim.cache.drain()  # write_back eviction consumes ACKs: loads land first
        self.sim.admission.finish_loads(self.sim.running)
        self.sim.cache.evict_device(num_pages)

    @precondition(lambda self: self.sim is not None and not self.sim.running)
    @rule()
    def flush(self) -> None:
        assert self.sim is not None
        self.sim.cache.flush()
        allocator = self.sim.cache.device_pool.allocator
        n = self.sim.cp_size
        assert [allocator.num_free_of(o) for o in range(n)] == [
            len(range(o, NUM_PAGES, n)) for o in range(n)
        ]

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        extra=st.integers(1, 3),
        shift=st.integers(1, 3),
    )
    def incompatible_join(self, prefix: int, extra: int, shift: int) -> None:
        assert self.sim is not None
        if shift % self.sim.cp_size:  # a shift of N owners is the cycle itself
            self.sim.join_off_cycle(PREFIXES[prefix], extra, shift)

    @invariant()
    def ownership_holds(self) -> None:
        if self.sim is not None:
            self.sim.check()

    def teardown(self) -> None:
        if self.sim is not None:
            self.sim.cache.close()


OwnershipMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_ownership_under_random_sequences = OwnershipMachine.TestCase


# ----------------------------------------------------------------- small, exact cases


def test_a_run_continues_the_owner_cycle_lowest_ids_first() -> None:
    a = PageAllocator(10, num_owners=3)
    assert a.run_counts(5, first_owner=2) == [2, 1, 2]
    assert a.alloc_run(5, first_owner=2) == [2, 0, 1, 5, 3]  # owners 2, 0, 1, 2, 0
    assert a.alloc_run(2, first_owner=1) == [4, 8]
    assert (a.num_free_of(0), a.num_free_of(1), a.num_free_of(2)) == (2, 1, 0)
    assert a.shortfall(3, first_owner=1) == 1 and a.alloc_run(3, first_owner=1) is None
    assert a.num_free == 3  # nothing taken
    a.free([5, 0, 4])  # each to its own class
    assert (a.num_free_of(0), a.num_free_of(1), a.num_free_of(2)) == (3, 2, 1)
    one = PageAllocator(6)
    assert one.alloc_run(3, first_owner=0) == [0, 1, 2] and one.shortfall(4) == 1


def test_extending_a_b_c_allocates_d_on_the_next_owner() -> None:
    """Figure 1a with two CP ranks: the cached A/B/C sits on owners 0, 1, 0; the request
    that extends it gets D on owner 1, and the tree takes it."""
    sim = Sim(cp_size=2, write_policy=None)
    sim.submit([1, 1, 2, 2, 3, 3, 0], max_new=1)  # A, B, C and the token computed
    sim.step(0)
    assert not sim.running
    a_b_c = list(sim.cache.tree.match_prefix([1, 1, 2, 2, 3, 3]).device_page_ids)
    assert [p % 2 for p in a_b_c] == [0, 1, 0]
    sim.submit([1, 1, 2, 2, 3, 3, 4, 4, 0], max_new=1)  # A/B/C hit, then D
    req = sim.running[0]
    assert req.page_ids[:3] == a_b_c and req.page_ids[3] % 2 == 1
    sim.step(0)
    d = sim.cache.tree.match_prefix([1, 1, 2, 2, 3, 3, 4, 4]).device_page_ids[3]
    assert d % 2 == 1
    sim.check()
    assert sim.join_off_cycle([1, 1, 2, 2, 3, 3], extra_pages=1, shift=1)
    sim.cache.close()


def test_the_tree_refuses_a_join_of_incompatible_rotations() -> None:
    sim = Sim(cp_size=3, write_policy=None)
    tree = sim.cache.tree
    tree.insert([1, 1, 2, 2], [0, 1])
    with pytest.raises(ValueError, match="path page 2 is owned by CP rank 0"):
        tree.insert([1, 1, 2, 2, 3, 3], [0, 1, 3])  # page 2 of the path needs owner 2
    assert tree.insert([1, 1, 2, 2, 3, 3], [0, 1, 5]).dup_len == 4
    node = tree.match_prefix([1, 1, 2, 2, 3, 3]).last_node
    assert node.owner_rotation == 2
    tree.check_integrity()
    node.device_page_ids[0] = 8  # owner 2 -> 2: still on the cycle
    tree.check_integrity()
    node.device_page_ids[0] = 6  # owner 0: off the cycle
    with pytest.raises(AssertionError, match="breaks the owner cycle"):
        tree.check_integrity()
    sim.cache.close()


def test_the_device_pool_and_the_cache_take_the_owner_classes() -> None:
    pool = DeviceKVPool(SPEC, 8, CPU, num_owners=4)
    assert pool.allocator.num_owners == 4 and pool.allocator.alloc(2, owner=3) == [3, 7]
    assert DeviceKVPool(SPEC, 8, CPU).allocator.num_owners == 1
    cache = PrefixCache(CacheConfig(page_size=PS, num_device_pages=8), SPEC, CPU, cp_size=4)
    assert cache.tree.cp_size == 4 and cache.device_pool.allocator.num_owners == 4
    assert cache.alloc(3, start_page=6) == [2, 3, 0]
    cache.close()
    with pytest.raises(ValueError, match="not in 2 owner classes"):
        PrefixCache(CacheConfig(page_size=PS), SPEC, CPU, pools=cache.pools, cp_size=2)


def test_eviction_frees_pages_until_the_short_class_has_enough() -> None:
    """A run needs pages of particular classes: eviction goes on (LRU order) until those
    classes have them, and the budget check counts per class too."""
    cache = PrefixCache(CacheConfig(page_size=1, num_device_pages=4), SPEC_1, CPU, cp_size=2)
    first = cache.alloc(2)  # pages 0, 1 for path pages 0, 1
    assert first == [0, 1]
    cache.insert([7, 8], first, cached_len=0)
    second = cache.alloc(1, start_page=0)
    assert second == [2]
    cache.insert([9], second, cached_len=0)  # now only page 3 (owner 1) is free
    cache.match([9, 0])  # [9] is the most recently used
    assert cache.can_alloc(2, start_page=0)  # owners 0, 1: evictable 0, 2 and free 3
    assert cache.alloc(2, start_page=0) == [0, 1]  # [7, 8] went, [9] (page 2) stayed
    assert cache.tree.device_page_set() == {2}
    cache.free([PageId(0)])  # free: 0, 3; evictable: 2
    assert cache.num_available_device_pages == 3
    assert not cache.can_alloc(3, start_page=1)  # owners 1, 0, 1: class 1 has page 3 only
    assert cache.can_alloc(3, start_page=0)  # owners 0, 1, 0: pages 0, 3 and 2 (evicted)
    # eviction frees page 2 (class 0), goes on, finds nothing more: class 1 stays short
    assert cache.alloc(3, start_page=1) is None
    assert cache.device_pool.allocator.free_set() == {0, 2, 3}
    cache.close()


SPEC_1 = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, page_size=1, dtype=torch.float32)


# ----------------------------------------------------------------- long seeded sequences


def random_ops(sim: Sim, rng: random.Random, num_ops: int, check_every: int = 1) -> None:
    """`num_ops` random operations, weighted towards requests (admission, host hits and
    load-backs, hand-offs), with evictions, matches, flushes and, with more than one CP
    rank, extensions on the wrong owner."""
    for i in range(num_ops):
        op = rng.random()
        if op < 0.45:
            tail = [rng.randint(1, 4) for _ in range(rng.randint(0, 5))]
            remote = rng.choice([None, None, None, False, True])
            sim.submit(prompt_of(rng.randrange(len(PREFIXES)), tail), rng.randint(1, 3), remote)
        elif op < 0.88:
            sim.step(rng.randint(0, 2))
        elif op < 0.94:
            sim.cache.drain()  # write_back eviction consumes ACKs: loads land first
            sim.admission.finish_loads(sim.running)
            sim.cache.evict_device(rng.randint(1, 8))
        elif op < 0.97:
            sim.cache.match(prompt_of(rng.randrange(len(PREFIXES)), [rng.randint(1, 4)]))
        elif not sim.running:
            sim.cache.flush()
        elif sim.cp_size > 1:
            sim.join_off_cycle(PREFIXES[rng.randrange(len(PREFIXES))], rng.randint(1, 3), 1)
        if i % check_every == 0:
            sim.check()
    sim.check()


@pytest.mark.parametrize("policy", [None, "write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_ownership_over_long_seeded_sequences(cp_size: int, policy: str | None) -> None:
    sim = Sim(cp_size, policy)
    random_ops(sim, random.Random(cp_size * 10 + len(policy or "")), 1500)
    stats = sim.cache.stats
    assert len(sim.handed_out) > 50 and stats.device_hit_tokens > 0
    assert policy is None or stats.num_loads > 0  # host hits were loaded back
    sim.cache.close()


# ----------------------------------------------------------------- N = 1: nothing changes


def fixed_sequence(seed: int, policy: str | None) -> tuple[list[list[int]], list[int], int, int]:
    """A fixed sequence on one CP rank: the pages every admitted request was handed, the
    tree's device pages at the end, and how many loads and device evictions it made."""
    sim = Sim(cp_size=1, write_policy=policy, max_running=2)
    random_ops(sim, random.Random(seed), 200, check_every=10)
    pages = sorted(sim.cache.tree.device_page_set())
    stats = sim.cache.stats
    sim.cache.close()
    return sim.handed_out, pages, stats.num_loads, stats.evicted_device_pages


def digest(handed_out: list[list[int]]) -> str:
    return hashlib.blake2b(repr(handed_out).encode(), digest_size=8).hexdigest()


# Recorded at db7b75c (before ownership) by running `fixed_sequence` there (this file, less
# `cp_size=`): the number of admissions, of pages handed out, their digest, and the tree's
# device pages at the end. A change to `Sim` or `random_ops` needs them recorded again.
BEFORE_OWNERSHIP = {
    (1, None): (
        38,
        194,
        "77475983d20bd45b",
        [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 16, 17, 19, 20, 21, 22, 23],
    ),
    (2, "write_through"): (
        41,
        219,
        "6cf6d95b684f8fff",
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 17, 18, 19, 21, 22, 23],
    ),
    (3, "write_through_selective"): (
        40,
        181,
        "552cb2315d1187ee",
        [0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13, 14, 15, 20, 21, 22],
    ),
    (4, "write_back"): (
        45,
        209,
        "708d3974f89e5fcb",
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 21, 22, 23],
    ),
}
FIRST_OF_SEED_5 = [
    [0, 1, 2, 3, 4, 5],
    [0, 5, 6, 7, 8, 9],
    [0, 5, 10, 11],
    [0, 5, 12, 13, 14],
    [0, 1, 11, 15],
    [0, 1, 12, 15, 16],
    [14, 17, 18, 19, 20, 21],
    [2, 3, 4, 7, 8],
    [2, 3, 4, 8, 9, 10],
    [11, 13, 14, 17, 18, 21],
    [0, 5, 6, 16, 22, 23],
    [0, 1, 12],
]


@pytest.mark.parametrize(("seed", "policy"), list(BEFORE_OWNERSHIP))
def test_one_cp_rank_hands_out_the_page_ids_it_did_before(seed: int, policy: str | None) -> None:
    handed_out, pages, num_loads, num_evicted = fixed_sequence(seed, policy)
    assert (len(handed_out), sum(map(len, handed_out)), digest(handed_out), pages) == (
        BEFORE_OWNERSHIP[seed, policy]
    )
    assert num_evicted > 0 and (policy is None or num_loads > 0)  # the paths it covers


def test_one_cp_rank_hands_out_these_exact_pages() -> None:
    assert fixed_sequence(5, "write_back")[0][:12] == FIRST_OF_SEED_5
