"""Issue 20, finding 6: stored (L3) objects are authenticated and private.

On real files in a temporary directory: a forged object (another payload under a valid
unkeyed digest, or an object written under another deployment's key) is quarantined as
"unauthenticated", never served; files are 0600 and directories 0700 whatever the umask;
the default MAC key lives beside the objects and survives restarts, an explicit key file is
checked; the default capacity is a bound, not "unlimited"; the quarantine is counted and
keeps only its newest objects.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_storage_file import SIZE, key, object_path, open_store, payload, read

from gpu_worker.storage import FileBackend, StorageConfig
from gpu_worker.storage.file import HEADER, QUARANTINE_DIR


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def forge(path: Path, new_payload: bytes) -> None:
    """Swap the object's payload for `new_payload` and fix every unkeyed field (the payload
    digest, whatever its size), as anyone who can write the file but lacks the key can;
    any field after the digest (a MAC) is left as it was."""
    raw = path.read_bytes()
    fields = list(HEADER.unpack_from(raw))
    digest = fields[4]
    fields[4] = hashlib.blake2b(new_payload, digest_size=len(digest)).digest()
    rest = raw[HEADER.size : len(raw) - len(new_payload)]  # the stored key
    path.write_bytes(HEADER.pack(*fields) + rest + new_payload)


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0)  # the loosest umask: modes must not depend on it
    yield
    os.umask(old)


def test_a_forged_payload_with_a_valid_digest_is_quarantined_not_served(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    store.put([key(0), key(1)], [payload(0), payload(1)])
    forge(object_path(tmp_path, key(0)), payload(1))  # another page's KV, digest made to fit
    assert read(store, [key(0)]) == (0, [])
    stats = store.stats()
    assert stats.quarantined["unauthenticated"] == 1 and stats.num_quarantined == 1
    assert (tmp_path / QUARANTINE_DIR / f"{key(0)}.unauthenticated").is_file()
    assert read(store, [key(1)]) == (1, [payload(1)])  # the genuine object is served
    store.close()


def test_an_object_of_another_key_is_not_served(tmp_path: Path) -> None:
    """Two deployments with their own key files: an object copied from one store into the
    other (whole and well-formed) is quarantined there; each reads its own."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for name in ("ours.key", "theirs.key"):
        (tmp_path / name).write_text(os.urandom(32).hex())
    a = open_store(ours, key_file=tmp_path / "ours.key")
    b = open_store(theirs, key_file=tmp_path / "theirs.key")
    b.put([key(0)], [payload(7)])
    object_path(ours, key(0)).parent.mkdir(parents=True, exist_ok=True)
    object_path(ours, key(0)).write_bytes(object_path(theirs, key(0)).read_bytes())
    assert read(a, [key(0)]) == (0, [])
    assert a.stats().quarantined["unauthenticated"] == 1
    assert read(b, [key(0)]) == (1, [payload(7)])
    a.close()
    b.close()


def test_the_default_key_survives_a_restart_and_an_explicit_one_is_checked(
    tmp_path: Path, umask: None
) -> None:
    root = tmp_path / "store"
    store = open_store(root)
    store.put([key(0)], [payload(0)])
    store.close()
    key_file = root / ".key"
    assert mode(key_file) == 0o600 and len(key_file.read_text().strip()) == 64
    store = open_store(root)  # a restart: the same key, the object is served
    assert read(store, [key(0)]) == (1, [payload(0)])
    store.close()
    with pytest.raises(ValueError, match=r"no storage key file at .*missing"):
        FileBackend(StorageConfig(directory=root, key_file=tmp_path / "missing"))
    (tmp_path / "short").write_text("tooshort\n")
    with pytest.raises(ValueError, match="holds 8 bytes; at least 16"):
        FileBackend(StorageConfig(directory=root, key_file=tmp_path / "short"))


def test_files_are_0600_and_directories_0700_whatever_the_umask(
    tmp_path: Path, umask: None
) -> None:
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)  # a directory an older version made
    for root in (tmp_path / "fresh" / "store", loose):
        store = open_store(root)
        store.put([key(0), key(1)], [payload(0), payload(1)])
        forge(object_path(root, key(1)), payload(2))
        assert read(store, [key(1)]) == (0, [])  # quarantined
        store.close()
        assert mode(root) == 0o700, root
        assert mode(root / ".key") == 0o600
        assert mode(object_path(root, key(0))) == 0o600
        assert mode(object_path(root, key(0)).parent) == 0o700
        assert mode(root / QUARANTINE_DIR) == 0o700
        assert mode(root / QUARANTINE_DIR / f"{key(1)}.unauthenticated") == 0o600


def test_the_default_capacity_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No cap given: a tenth of the filesystem at most, and at most half the space free for
    the store (free space plus what it holds, once its start-up scan has counted that); 0
    still means no cap. The half-free rule is checked on a filesystem of fixed figures: other
    processes change a real disk's free space between the store's reading and the test's."""
    import gpu_worker.storage.base as base

    real = os.statvfs(tmp_path)
    store = open_store(tmp_path / "store")
    store.put([key(0)], [payload(0)])
    assert 0 < store.stats().capacity_bytes <= real.f_blocks * real.f_frsize // 10
    store.close()
    frsize = real.f_frsize
    for free_blocks in (9_000, 100):  # the tenth of the filesystem binds, then half-free
        fake = os.statvfs_result((frsize, frsize, 100_000, free_blocks, free_blocks, *real[5:]))
        monkeypatch.setattr(base.os, "statvfs", lambda _path, fake=fake: fake)
        store = open_store(tmp_path / "store")
        assert store.wait_until_scanned(30)
        held = store.stats().num_bytes
        assert held > 0
        want = min(10_000 * frsize, (free_blocks * frsize + held) // 2)
        assert store.stats().capacity_bytes == want
        store.close()
    unlimited = open_store(tmp_path / "store", capacity_bytes=0)
    assert unlimited.stats().capacity_bytes == 0
    unlimited.close()


def test_the_quarantine_is_counted_and_keeps_only_its_newest(tmp_path: Path) -> None:
    store = open_store(tmp_path, quarantine_max_objects=3)
    keys = [key(i) for i in range(5)]
    store.put(keys, [payload(i) for i in range(5)])
    for k in keys:
        forge(object_path(tmp_path, k), payload(9))
        assert read(store, [k]) == (0, [])
    held = sorted(p.name for p in (tmp_path / QUARANTINE_DIR).iterdir())
    assert held == sorted(f"{k}.unauthenticated" for k in keys[2:])  # the two oldest dropped
    stats = store.stats()
    assert stats.num_quarantined == 5 and stats.quarantine_dropped == 2
    assert stats.quarantine_objects == 3
    assert stats.quarantine_bytes == sum(
        p.stat().st_size for p in (tmp_path / QUARANTINE_DIR).iterdir()
    )
    store.close()
    # a restart counts what the quarantine holds, and bounds it by the new limit
    store = open_store(tmp_path, quarantine_max_objects=1, quarantine_max_bytes=10**9)
    stats = store.stats()
    assert (stats.quarantine_objects, stats.quarantine_dropped) == (1, 2)
    assert [p.name for p in (tmp_path / QUARANTINE_DIR).iterdir()] == [f"{keys[4]}.unauthenticated"]
    store.close()
    # bytes bound too: an object over it is not kept at all
    small = open_store(tmp_path / "b", quarantine_max_bytes=SIZE)
    small.put([key(0)], [payload(0)])
    forge(object_path(tmp_path / "b", key(0)), payload(1))
    assert read(small, [key(0)]) == (0, [])
    assert small.stats().quarantine_objects == 0 and small.stats().quarantine_dropped == 1
    small.close()
