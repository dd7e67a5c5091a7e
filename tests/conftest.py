"""Test-wide setup.

Triton kernels run on CPU only in interpreter mode, and TRITON_INTERPRET must be set before
any `@triton.jit` decorator runs, so it is set here, before test modules import kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)

# De-quantized GGUF weights are cached per test session, not in the user's cache
# (`gpu_worker/env.py`); engine processes the tests start inherit it.
if "HICACHE_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["HICACHE_CACHE_DIR"] = tempfile.mkdtemp(prefix="hicache-test-cache-")


# ---------------------------------------------------------------- real servers

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from services.launch.servers import ServerProcess, start_nats, start_redis  # noqa: E402


@pytest.fixture(scope="session")
def nats_server() -> Iterator[ServerProcess]:
    """A real nats-server on a free loopback port, for the whole session."""
    server = start_nats()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[ServerProcess]:
    """A real redis-server (or valkey-server) on a free loopback port, for the whole session."""
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def fresh_redis() -> Iterator[ServerProcess]:
    """A Redis of its own, for tests that stop it or need it empty."""
    server = start_redis()
    yield server
    server.stop()


# ---------------------------------------------------------------- scheduling

# The files whose rank worlds and meshes take the longest, longest first. `make test` runs
# the suite with `--dist loadfile` (a file stays on one worker), and xdist hands files out
# in collection order: a long file collected last would run alone at the end while the
# other workers idle, so these are collected first (longest-processing-time-first).
HEAVY_FIRST = (
    "test_cp_engine.py",
    "test_fault_matrix.py",
    "test_real_model_chat.py",
    "test_cp_pd.py",
    "test_cp_stress.py",
    "test_multirank_oracle.py",
    "test_multirank_storage.py",
    "test_multirank_consensus.py",
    "test_spec_pd.py",
    "test_cp_split.py",
    "test_cp_host.py",
    "test_cp_admission.py",
    "test_cp_storage.py",
    "test_spec_multirank.py",
    "test_spec_tiers.py",
    "test_multihost.py",
    "test_redis_sentinel.py",
    "test_nats_cluster.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep order
