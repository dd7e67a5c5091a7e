"""The `file` storage backend on real files: round trips, write-once, verification and
quarantine, key validation, LRU capacity, persistence, concurrent writers, write failures."""

from __future__ import annotations

import errno
import hashlib
import logging
import multiprocessing as mp
import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpu_worker.storage import (
    FileBackend,
    StorageConfig,
    default_storage_dir,
    is_valid_key,
    make_backend,
)
from gpu_worker.storage.file import HEADER, QUARANTINE_DIR, STALE_TMP_S, TMP_PREFIX, file_size

SIZE = 1000  # payload bytes of most test objects


def key(i: int) -> str:
    """A key shaped like the engine's: a 32-hex page hash plus a suffix."""
    return hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest() + "_tp0of2_pp1of2"


def payload(i: int, size: int = SIZE) -> bytes:
    return random.Random(i).randbytes(size)


def read(store: FileBackend, keys: list[str], size: int = SIZE) -> tuple[int, list[bytes]]:
    """get() into fresh buffers: (leading count, the payloads read)."""
    bufs = [bytearray(size) for _ in keys]
    n = store.get(keys, [memoryview(b) for b in bufs])
    return n, [bytes(b) for b in bufs[:n]]


def object_path(root: Path, k: str) -> Path:
    return root / k[:2] / k


def stored_keys(root: Path) -> set[str]:
    """Object files on disk (not temp files, not quarantine)."""
    fans = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")]
    return {f.name for d in fans for f in d.iterdir() if not f.name.startswith(".")}


def temp_files(root: Path) -> list[Path]:
    return list(root.rglob(f"{TMP_PREFIX}*"))


def open_store(root: Path, **config: object) -> FileBackend:
    store = FileBackend(StorageConfig(directory=root, **config))
    assert store.wait_until_scanned(10)
    return store


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(root: Path) -> Iterator[FileBackend]:
    backend = open_store(root)
    yield backend
    backend.check_integrity()
    backend.close()


# ---------------------------------------------------------------- round trip


def test_round_trip_and_leading_counts(store: FileBackend, root: Path) -> None:
    keys = [key(i) for i in range(5)]
    data = [payload(i) for i in range(5)]
    assert store.put(keys, data) == 5
    assert store.exists(keys) == 5
    n, got = read(store, keys)
    assert n == 5 and got == data

    missing = key(99)
    assert store.exists([keys[0], keys[1], missing, keys[2]]) == 2
    assert store.exists([missing, *keys]) == 0
    n, got = read(store, [keys[3], missing, keys[4]])
    assert n == 1 and got == [data[3]]
    assert store.stats().num_reads == 5 + 2  # the object after the miss is not read
    assert stored_keys(root) == set(keys)
    fans = {p.name for p in root.iterdir() if not p.name.startswith(".")}  # not .key
    assert fans == {k[:2] for k in keys}  # fan-out by 2 chars


def test_put_accepts_memoryviews_and_get_fills_typed_buffers(store: FileBackend) -> None:
    src = np.arange(250, dtype=np.float32)
    assert store.put([key(0)], [memoryview(src)]) == 1
    dst = np.zeros(250, dtype=np.float32)
    assert store.get([key(0)], [memoryview(dst)]) == 1
    assert (dst == src).all()
    with pytest.raises(ValueError, match="writable"):
        store.get([key(0)], [memoryview(bytes(1000))])


def test_put_is_write_once(store: FileBackend, root: Path) -> None:
    assert store.put([key(0)], [payload(0)]) == 1
    before = object_path(root, key(0)).stat()
    assert store.put([key(0), key(1)], [payload(7), payload(1)]) == 2  # counts as stored
    n, got = read(store, [key(0), key(1)])
    assert n == 2 and got == [payload(0), payload(1)]
    assert object_path(root, key(0)).stat().st_ino == before.st_ino
    assert store.stats().num_written == 2


# ---------------------------------------------------------------- verification


def assert_quarantined(store: FileBackend, root: Path, k: str, reason: str) -> None:
    """`k` fails verification once: a miss, moved to the quarantine, counted, never read
    again; a fresh put stores it again."""
    assert read(store, [k]) == (0, [])
    stats = store.stats()
    assert stats.quarantined[reason] == 1 and stats.num_quarantined == 1
    assert not object_path(root, k).exists()
    assert (root / QUARANTINE_DIR / f"{k}.{reason}").is_file()
    assert k not in store.lru_keys()

    assert read(store, [k]) == (0, [])
    assert store.exists([k]) == 0
    assert store.stats().num_quarantined == 1  # nothing left to read, nothing counted twice

    assert store.put([k], [payload(0)]) == 1
    assert read(store, [k]) == (1, [payload(0)])


def test_corrupt_object_is_quarantined(store: FileBackend, root: Path) -> None:
    store.put([key(0), key(1)], [payload(0), payload(1)])
    path = object_path(root, key(0))
    raw = bytearray(path.read_bytes())
    raw[-SIZE // 2] ^= 0x01  # one payload bit
    path.write_bytes(raw)
    assert read(store, [key(0), key(1)]) == (0, [])  # the count stops at the bad one
    stats = store.stats()
    assert stats.quarantined["corrupt"] == 1
    assert stats.num_reads == 1  # key(1) was not read
    assert read(store, [key(1)]) == (1, [payload(1)])
    assert_quarantined(store, root, key(0), "corrupt")


@pytest.mark.parametrize(
    "keep",
    [-1, HEADER.size + len(key(0)), HEADER.size + 10, 20, 0],
    ids=["in_payload", "no_payload", "in_key", "in_header", "empty"],
)
def test_truncated_object_is_quarantined(store: FileBackend, root: Path, keep: int) -> None:
    store.put([key(0)], [payload(0)])
    path = object_path(root, key(0))
    path.write_bytes(path.read_bytes()[:keep])
    assert_quarantined(store, root, key(0), "truncated")


def test_misnamed_object_is_quarantined(store: FileBackend, root: Path) -> None:
    store.put([key(0)], [payload(0)])
    target = object_path(root, key(1))
    target.parent.mkdir(exist_ok=True)
    shutil.copyfile(object_path(root, key(0)), target)  # a valid object under another name
    assert store.exists([key(1)]) == 1  # exists does not verify
    assert_quarantined(store, root, key(1), "misnamed")
    assert read(store, [key(0)]) == (1, [payload(0)])  # the original is untouched


def test_other_verification_failures(store: FileBackend, root: Path) -> None:
    """Bad magic and trailing bytes are "corrupt"; a buffer of another size "wrong_size"."""
    store.put([key(0), key(1), key(2)], [payload(0), payload(1), payload(2)])
    p0 = object_path(root, key(0))
    p0.write_bytes(b"X" + p0.read_bytes()[1:])
    with object_path(root, key(1)).open("ab") as f:
        f.write(b"\0")
    assert read(store, [key(0)]) == (0, [])
    assert read(store, [key(1)]) == (0, [])
    assert read(store, [key(2)], size=SIZE - 1) == (0, [])
    q = store.stats().quarantined
    assert dict(q) == {
        "corrupt": 2,
        "truncated": 0,
        "misnamed": 0,
        "wrong_size": 1,
        "unauthenticated": 0,
    }


def test_vanished_object_is_a_plain_miss(store: FileBackend, root: Path) -> None:
    """Another process evicting an object this one knows: a miss, not a quarantine."""
    store.put([key(0), key(1)], [payload(0), payload(1)])
    object_path(root, key(0)).unlink()
    assert read(store, [key(0)]) == (0, [])
    stats = store.stats()
    assert stats.num_misses == 1 and stats.num_quarantined == 0
    assert store.lru_keys() == [key(1)]
    assert stats.num_objects == 1 and stats.num_bytes == file_size(key(1), SIZE)


# ---------------------------------------------------------------- keys


BAD_KEYS = ["../x", "a/b", "", ".hidden", "k" * 201, "a\x00b", "a b", "ab\n", "é"]


@pytest.mark.parametrize("bad", BAD_KEYS)
def test_invalid_keys_raise_and_touch_nothing(store: FileBackend, root: Path, bad: str) -> None:
    assert not is_valid_key(bad)
    before = sorted(root.rglob("*"))
    keys = [key(0), bad]  # the valid key first: it must not be written either
    with pytest.raises(ValueError, match="invalid storage key"):
        store.put(keys, [payload(0), payload(1)])
    with pytest.raises(ValueError, match="invalid storage key"):
        store.exists(keys)
    with pytest.raises(ValueError, match="invalid storage key"):
        store.get(keys, [memoryview(bytearray(SIZE)) for _ in keys])
    assert sorted(root.rglob("*")) == before
    stats = store.stats()
    assert stats.num_reads == 0 and stats.num_written == 0 and stats.num_objects == 0


def test_valid_key_edges() -> None:
    assert is_valid_key("k" * 200) and is_valid_key("a") and is_valid_key("a..b")
    assert is_valid_key("-x_Y.9")
    assert not is_valid_key(None) and not is_valid_key(b"ab")


# ---------------------------------------------------------------- capacity


def test_capacity_evicts_least_recently_used(root: Path) -> None:
    a, b, c, d, e = (key(i) for i in range(5))
    store = open_store(root, capacity_bytes=3 * file_size(a, SIZE))
    store.put([a, b, c], [payload(0), payload(1), payload(2)])
    assert read(store, [a])[0] == 1  # recency: b, c, a
    store.put([d], [payload(3)])  # evicts b
    assert stored_keys(root) == {a, c, d}
    assert store.exists([c]) == 1  # recency: a, d, c
    store.put([e], [payload(4)])  # evicts a
    assert stored_keys(root) == {c, d, e}
    assert store.lru_keys() == [d, c, e]
    stats = store.stats()
    assert stats.num_evictions == 2
    assert stats.num_objects == 3 and stats.num_bytes == 3 * file_size(a, SIZE)
    store.check_integrity()
    store.close()


def test_capacity_never_evicts_objects_of_the_same_put(root: Path) -> None:
    keys = [key(i) for i in range(5)]
    store = open_store(root, capacity_bytes=3 * file_size(keys[0], SIZE))
    assert store.put(keys, [payload(i) for i in range(5)]) == 3
    assert stored_keys(root) == set(keys[:3])
    assert store.stats().write_failures["full"] == 1
    assert store.put(keys[3:], [payload(3), payload(4)]) == 2  # a new put may evict them
    assert stored_keys(root) == {keys[2], keys[3], keys[4]}
    big = key(9)
    assert store.put([big], [payload(9, 4 * SIZE)]) == 0  # larger than the cap: never fits
    assert store.stats().write_failures["full"] == 2
    assert stored_keys(root) == {keys[2], keys[3], keys[4]}  # and nothing was evicted for it
    store.close()


# ---------------------------------------------------------------- persistence


def test_second_backend_sees_the_first_ones_objects(root: Path) -> None:
    first = open_store(root)
    keys = [key(i) for i in range(4)]
    first.put(keys, [payload(i) for i in range(4)])
    first.close()

    second = open_store(root)
    stats = second.stats()
    assert stats.scanned and stats.num_objects == 4
    assert stats.num_bytes == 4 * file_size(keys[0], SIZE)
    assert read(second, keys) == (4, [payload(i) for i in range(4)])
    second.close()


def test_scan_orders_old_objects_by_mtime(root: Path) -> None:
    keys = [key(i) for i in range(3)]
    first = open_store(root)
    first.put(keys, [payload(i) for i in range(3)])
    first.close()
    for age, k in zip((10, 30, 20), keys, strict=True):  # oldest: keys[1], then keys[2]
        t = time.time() - age
        os.utime(object_path(root, k), (t, t))

    second = open_store(root, capacity_bytes=3 * file_size(keys[0], SIZE))
    assert second.lru_keys() == [keys[1], keys[2], keys[0]]
    second.put([key(3)], [payload(3)])
    assert stored_keys(root) == {keys[0], keys[2], key(3)}
    second.close()


def test_scan_removes_stale_temp_files_only(root: Path) -> None:
    fan = root / "ab"
    fan.mkdir(parents=True)
    stale, fresh = fan / f"{TMP_PREFIX}1-old", fan / f"{TMP_PREFIX}2-new"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    t = time.time() - STALE_TMP_S - 60
    os.utime(stale, (t, t))
    store = open_store(root)
    assert not stale.exists() and fresh.exists()
    assert store.stats().num_objects == 0
    store.close()


def test_clear_removes_every_object_and_the_quarantine(store: FileBackend, root: Path) -> None:
    keys = [key(i) for i in range(3)]
    store.put(keys, [payload(i) for i in range(3)])
    object_path(root, keys[0]).write_bytes(b"junk")
    assert read(store, keys) == (0, [])  # quarantined
    store.clear()
    assert stored_keys(root) == set()
    assert list((root / QUARANTINE_DIR).iterdir()) == []
    stats = store.stats()
    assert stats.num_objects == 0 and stats.num_bytes == 0 and store.exists(keys) == 0
    assert store.put(keys, [payload(i) for i in range(3)]) == 3


def test_closed_backend_raises(root: Path) -> None:
    store = open_store(root)
    store.close()
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.exists([key(0)])


# ---------------------------------------------------------------- concurrency


def _put_worker(root: str, barrier: Any, num_keys: int) -> None:
    store = FileBackend(StorageConfig(directory=Path(root)))
    barrier.wait()
    n = store.put(
        [key(i) for i in range(num_keys)], [payload(i, 64 * 1024) for i in range(num_keys)]
    )
    store.close()
    if n != num_keys:
        raise SystemExit(f"put stored {n} of {num_keys}")


def test_concurrent_processes_write_the_same_keys(root: Path) -> None:
    """4 processes put the same 20 keys at once while this one reads: no reader ever sees a
    partial object (nothing is quarantined), and every object verifies afterwards."""
    num_keys, size = 20, 64 * 1024
    keys = [key(i) for i in range(num_keys)]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(5)
    procs = [ctx.Process(target=_put_worker, args=(str(root), barrier, num_keys)) for _ in range(4)]
    for p in procs:
        p.start()
    reader = open_store(root)
    barrier.wait(timeout=60)
    num_reads = 0
    while any(p.is_alive() for p in procs):
        n, got = read(reader, keys, size)
        assert got == [payload(i, size) for i in range(n)]
        num_reads += 1
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert reader.stats().num_quarantined == 0
    assert read(reader, keys, size) == (num_keys, [payload(i, size) for i in range(num_keys)])
    assert temp_files(root) == []
    assert stored_keys(root) == set(keys)
    assert num_reads > 0
    reader.close()


def test_concurrent_threads_write_the_same_keys(store: FileBackend, root: Path) -> None:
    import threading

    keys = [key(i) for i in range(20)]
    data = [payload(i) for i in range(20)]
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(store.put(keys, data))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [20] * 4
    assert read(store, keys) == (20, data)
    assert store.stats().num_written == 20  # each object written by exactly one thread
    assert temp_files(root) == []


# ---------------------------------------------------------------- write failures


def test_fan_out_path_that_is_a_file_stops_the_put(store: FileBackend, root: Path) -> None:
    keys = [key(i) for i in range(3)]
    (root / keys[1][:2]).write_bytes(b"not a directory")
    assert store.put(keys, [payload(i) for i in range(3)]) == 1
    stats = store.stats()
    assert dict(stats.write_failures) == {"full": 0, "read_only": 0, "other": 1}
    assert stored_keys(root) == {keys[0]}
    assert store.exists(keys) == 1 and read(store, keys) == (1, [payload(0)])


def _fail_after(real: Any, num_ok: int, err: int, under: Path) -> Any:
    """os.link / os.open that raise OSError(err) for paths under `under` after `num_ok` calls."""
    calls = [0]

    def fake(path: str, *args: Any, **kwargs: Any) -> Any:
        if str(path).startswith(str(under)) and TMP_PREFIX in str(path):
            calls[0] += 1
            if calls[0] > num_ok:
                raise OSError(err, os.strerror(err), str(path))
        return real(path, *args, **kwargs)

    return fake


@pytest.mark.parametrize(
    ("function", "err", "reason"),
    [
        ("link", errno.ENOSPC, "full"),
        ("link", errno.EDQUOT, "full"),
        ("open", errno.EROFS, "read_only"),
        ("open", errno.EACCES, "read_only"),
        ("open", errno.EIO, "other"),
    ],
)
def test_write_failures_stop_the_put_and_are_counted(
    store: FileBackend,
    root: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    function: str,
    err: int,
    reason: str,
) -> None:
    monkeypatch.setattr(os, function, _fail_after(getattr(os, function), 2, err, root))
    keys = [key(i) for i in range(5)]
    with caplog.at_level(logging.WARNING, logger="gpu_worker.storage.file"):
        assert store.put(keys, [payload(i) for i in range(5)]) == 2
        assert store.put(keys[2:], [payload(i) for i in range(2, 5)]) == 0
    stats = store.stats()
    assert stats.write_failures[reason] == 2 and stats.num_write_failures == 2
    assert stats.num_written == 2 and stats.num_objects == 2
    assert stored_keys(root) == set(keys[:2])
    assert temp_files(root) == []
    assert len([r for r in caplog.records if "storage put stopped" in r.getMessage()]) == 1
    monkeypatch.undo()
    assert read(store, keys) == (2, [payload(0), payload(1)])


# ---------------------------------------------------------------- stats and hooks


def test_stats_counters(store: FileBackend) -> None:
    keys = [key(i) for i in range(3)]
    s0 = store.stats()
    assert (s0.num_objects, s0.num_bytes, s0.num_reads, s0.num_written) == (0, 0, 0, 0)
    store.put(keys, [payload(i) for i in range(3)])
    store.put(keys[:1], [payload(0)])  # already there: not written again
    read(store, keys)
    read(store, [key(9)])
    read(store, [keys[0], key(8), keys[1]])
    s = store.stats()
    assert s.num_written == 3 and s.num_objects == 3
    assert s.num_bytes == 3 * file_size(keys[0], SIZE)
    assert (s.num_reads, s.num_hits, s.num_misses) == (3 + 1 + 2, 3 + 1, 2)
    assert s.num_evictions == 0 and s.num_quarantined == 0 and s.num_write_failures == 0
    with pytest.raises(TypeError):
        s.quarantined["corrupt"] = 5  # type: ignore[index]  # read-only mapping


def test_fault_injection_hooks(root: Path) -> None:
    keys = [key(i) for i in range(3)]
    store = open_store(root, fail_get_after=2, delay_s_per_get=0.02)
    store.put(keys, [payload(i) for i in range(3)])
    start = time.monotonic()
    assert read(store, keys)[0] == 2
    assert time.monotonic() - start >= 3 * 0.02
    assert read(store, keys)[0] == 0
    s = store.stats()
    assert (s.num_hits, s.num_misses, s.num_quarantined) == (2, 2, 0)
    store.close()


# ---------------------------------------------------------------- config and registry


def test_config_validation_and_registry(root: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown storage backend 's3'.*\['file'\]"):
        StorageConfig(backend="s3", directory=root)
    with pytest.raises(ValueError, match="capacity_bytes"):
        StorageConfig(directory=root, capacity_bytes=-1)
    with pytest.raises(ValueError, match="fail_get_after"):
        StorageConfig(directory=root, fail_get_after=-1)
    config = StorageConfig(directory=str(root))  # type: ignore[arg-type]  # a str is accepted
    assert config.directory == root
    backend = make_backend(config)
    assert isinstance(backend, FileBackend)
    backend.close()


def test_default_storage_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HICACHE_STORAGE_DIR", str(tmp_path / "s"))
    assert default_storage_dir() == tmp_path / "s"
    monkeypatch.delenv("HICACHE_STORAGE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_storage_dir() == tmp_path / "xdg" / "hicache-mesh" / "storage"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_storage_dir() == Path.home() / ".cache" / "hicache-mesh" / "storage"


# ---------------------------------------------------------------- a writer killed


BIG = 32 << 20  # a write long enough to be killed in the middle of


def _write_forever(root: str) -> None:
    store = FileBackend(StorageConfig(directory=Path(root)))
    data = payload(0, BIG)
    for i in range(10**6):
        store.put([key(i)], [data])


def test_a_writer_killed_mid_write_leaves_no_torn_object(root: Path) -> None:
    """A process putting 32 MB objects one after the other is killed (SIGKILL) while it
    writes one. What it left under its keys' names is whole and verifies; the object it was
    writing is a plain miss (its bytes sit in a temp file no reader opens); the store takes
    that object again afterwards, and the next start-up scan drops the temp file once stale."""
    ctx = mp.get_context("spawn")
    torn: list[Path] = []
    for _ in range(5):  # until the kill lands inside a write (almost always the first time)
        shutil.rmtree(root, ignore_errors=True)
        proc = ctx.Process(target=_write_forever, args=(str(root),))
        proc.start()
        deadline = time.monotonic() + 120
        while len(stored_keys(root) if root.exists() else ()) < 2:
            assert time.monotonic() < deadline and proc.is_alive(), "the writer made no objects"
            time.sleep(0.005)
        time.sleep(0.03)  # into the next write
        proc.kill()
        proc.join(30)
        files = [p for p in root.glob("*/*") if p.is_file()]  # temp files and objects
        torn = [p for p in files if p.stat().st_size < file_size(key(0), BIG)]
        if torn:
            break
    assert torn, "the writer was never killed inside a write"
    assert all(p.name.startswith(TMP_PREFIX) for p in torn)  # never under a key's name
    done = sorted(stored_keys(root))
    expected = [key(i) for i in range(len(done))]
    assert done == sorted(expected)  # objects 0..m-1, in the order they were put
    reader = open_store(root)
    for k in done:  # every object under its name is whole
        n, got = read(reader, [k], BIG)
        assert n == 1 and got == [payload(0, BIG)], k
    cut = key(len(done))  # the object being written: nothing under its name
    assert reader.exists([cut]) == 0
    assert read(reader, [cut], BIG)[0] == 0
    assert reader.stats().num_quarantined == 0 and reader.stats().num_objects == len(done)
    assert reader.put([cut], [payload(0, BIG)]) == 1  # the store is usable
    assert read(reader, [cut], BIG) == (1, [payload(0, BIG)])
    reader.close()
    old = time.time() - STALE_TMP_S - 60
    for p in torn:
        os.utime(p, (old, old))
    rescan = open_store(root)
    assert [p for p in torn if p.exists()] == []
    assert rescan.stats().num_objects == len(done) + 1
    rescan.close()
