"""`PageChains` gives exactly `page_hashes`, hashing only the pages a recent prompt did not
share, and stays within its byte budget."""

from __future__ import annotations

import random
from array import array

import pytest

import router.page_chains as pc
from bus_schemas import page_hashes
from router.page_chains import PageChains

PAGE = 4
NS = "ns"


def ids(values: list[int]) -> array:
    return array("I", values)


def expected(values: list[int], salt: str = "", page: int = PAGE, ns: str = NS) -> str:
    return "".join(page_hashes(values, page, ns, salt))


class CountingHasher:
    """`chain_digests` that notes the number of pages each call hashed, in order."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def __call__(self, parent: bytes, data: bytes, page_size: int) -> bytes:
        self.counts.append(len(data) // (4 * page_size))
        return pc.chain_digests(parent, data, page_size)


@pytest.fixture
def hasher() -> CountingHasher:
    return CountingHasher()


def test_repeat_extend_diverge_and_shorter_prompts_hash_only_new_pages(
    hasher: CountingHasher,
) -> None:
    chains = PageChains(1 << 20, hasher)
    turn1 = list(range(1, 19))  # 4 whole pages and 2 tokens
    assert chains.hex_hashes(ids(turn1), PAGE, NS, "") == expected(turn1)
    assert chains.hex_hashes(ids(turn1), PAGE, NS, "") == expected(turn1)  # a resend
    turn2 = [*turn1, 50, 51, 52, 53, 54, 55]  # 6 pages: 2 new (the partial page changed)
    assert chains.hex_hashes(ids(turn2), PAGE, NS, "") == expected(turn2)
    other = [*turn1[:8], 9, 9, 9, 9, 9, 9, 9, 9]  # shares 2 pages, then differs
    assert chains.hex_hashes(ids(other), PAGE, NS, "") == expected(other)
    shorter = turn2[:12]  # a prefix of what is held
    assert chains.hex_hashes(ids(shorter), PAGE, NS, "") == expected(shorter)
    assert chains.hex_hashes(ids(turn2), PAGE, NS, "") == expected(turn2)
    assert hasher.counts == [4, 2, 2]


def test_salt_namespace_and_page_size_seed_separate_chains(hasher: CountingHasher) -> None:
    chains = PageChains(1 << 20, hasher)
    values = list(range(100, 116))
    assert chains.hex_hashes(ids(values), PAGE, NS, "") == expected(values)
    assert chains.hex_hashes(ids(values), PAGE, NS, "alice") == expected(values, "alice")
    assert chains.hex_hashes(ids(values), PAGE, "other", "") == expected(values, ns="other")
    assert chains.hex_hashes(ids(values), 8, NS, "") == expected(values, page=8)
    assert hasher.counts == [4, 4, 4, 2]


def test_short_prompts_and_a_disabled_cache() -> None:
    chains = PageChains(1 << 20)
    assert chains.hex_hashes(ids([1, 2, 3]), PAGE, NS, "") == ""
    off = PageChains(0)
    values = list(range(40))
    assert off.hex_hashes(ids(values), PAGE, NS, "") == expected(values)
    assert off.num_bytes == 0


def test_conversations_sharing_a_first_page_keep_their_own_chains(
    hasher: CountingHasher,
) -> None:
    chains = PageChains(1 << 20, hasher)
    system = [7, 7, 7, 7]
    convs = [system + [c] * 8 for c in range(pc.CHAINS_PER_HEAD)]
    for conv in convs:
        assert chains.hex_hashes(ids(conv), PAGE, NS, "") == expected(conv)
    for conv in convs:  # every conversation's next turn reuses its own 3 pages
        turn = conv + [99] * 4
        assert chains.hex_hashes(ids(turn), PAGE, NS, "") == expected(turn)
    assert hasher.counts == [3] + [2] * (pc.CHAINS_PER_HEAD - 1) + [1] * pc.CHAINS_PER_HEAD


def test_memory_stays_within_the_budget_least_recently_used_first() -> None:
    one_prompt = 4 * 64 + 16 * 16  # 64 tokens of page 4: token bytes + 16 digests
    chains = PageChains(3 * one_prompt)
    prompts = [[p] * 64 for p in range(5)]
    for p in prompts:
        chains.hex_hashes(ids(p), PAGE, NS, "")
        assert chains.num_bytes <= 3 * one_prompt
    assert chains.num_bytes == 3 * one_prompt
    assert [head[3][0] for head in chains._heads] == [2, 3, 4]


def test_random_prompts_match_page_hashes() -> None:
    rng = random.Random(7)
    chains = PageChains(1 << 16)
    base = [rng.randrange(260) for _ in range(400)]
    for _ in range(300):
        cut = rng.randrange(len(base))
        values = base[:cut] + [rng.randrange(260) for _ in range(rng.randrange(40))]
        if rng.random() < 0.3:
            base = values + [rng.randrange(260) for _ in range(50)]
        salt = rng.choice(["", "s"])
        assert chains.hex_hashes(ids(values), PAGE, NS, salt) == expected(values, salt)
