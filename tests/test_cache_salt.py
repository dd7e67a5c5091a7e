"""cache_salt at the radix level: the same ids under different salts never share KV
(DESIGN.md invariant 5); under the same salt they do, and their page hashes say which."""

from __future__ import annotations

from bus_schemas.page_hash import page_hashes
from gpu_worker.cache.kv_events import KVEventRecord
from gpu_worker.cache.radix import RadixTree

NS = "tiny|float64|p4"
PS = 4
IDS = list(range(40, 57))  # 17 tokens: 16 matchable (4 pages)


def test_same_ids_under_another_salt_match_nothing() -> None:
    tree = RadixTree(PS, NS)
    tree.insert(IDS, [0, 1, 2, 3], salt="alice")
    for salt in ("bob", "", "alice "):
        m = tree.match_prefix(IDS, salt)
        assert (m.device_len, m.host_len, len(m.device_page_ids)) == (0, 0, 0), salt
    m = tree.match_prefix(IDS, "alice")
    assert m.device_len == 16 and list(m.device_page_ids) == [0, 1, 2, 3]
    tree.check_integrity()


def test_each_salt_keeps_its_own_pages_and_hashes() -> None:
    tree = RadixTree(PS, NS)
    tree.insert(IDS, [0, 1, 2, 3], salt="alice")
    result = tree.insert(IDS, [4, 5, 6, 7], salt="bob")
    assert result.dup_len == 0  # bob's pages are taken, not deduplicated against alice's
    assert list(tree.match_prefix(IDS, "bob").device_page_ids) == [4, 5, 6, 7]
    assert list(tree.match_prefix(IDS, "alice").device_page_ids) == [0, 1, 2, 3]
    assert tree.drain_events() == [
        KVEventRecord("stored", "device", page_hashes(IDS[:16], PS, NS, cache_salt="alice")),
        KVEventRecord("stored", "device", page_hashes(IDS[:16], PS, NS, cache_salt="bob")),
    ]
    assert page_hashes(IDS[:16], PS, NS, cache_salt="alice") != page_hashes(
        IDS[:16], PS, NS, cache_salt="bob"
    )
    # the same salt again: every page is a duplicate
    assert tree.insert(IDS, [8, 9, 10, 11], salt="alice").dup_len == 16
    assert tree.num_device_pages == 8
    tree.check_integrity()
