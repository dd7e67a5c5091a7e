"""deploy/kubernetes/ cannot drift from the Kubernetes API or from the CLI (issue 24, build 4).

What `kubectl apply -k` would send is rendered here the way kustomize renders it, for the
few kustomize features the folder uses (resources, labels, secretGenerator, images, RFC 6902
patches; any other field fails the test rather than being skipped), then:

- every object is valid against the Kubernetes 1.31 JSON schemas in strict mode (no unknown
  field: a misspelled key fails, checked on a broken copy), offline (`kubernetes-validate`);
- every container command parses with the service's own argparse parser, and every probe
  command with `services.healthcheck`'s;
- every Secret, Service and port a pod names exists; the Secrets hold exactly the files
  `hicache-mesh credentials` writes; the router's probes are its real `/ready` and `/health`
  on its `--port`; the engines' probes ask the engine of their own `--engine-id`;
- every container requests CPU and memory, every engine a GPU;
- no credential on a command line or in a literal environment value: credentials are files
  of mode 0400 from Secrets, in pods without an fsGroup (which would make them 0440, and
  `read_credentials` refuses a group-readable file: checked on real files);
- the multi-host overlay is a rendezvous that can form: one pod per rank, pod ordinal =
  `--node-rank`, `--dist-init-addr` = pod 0's stable name through the headless Service,
  DNS published before readiness, pods started together;
- the Helm values for NATS and Redis name what the manifests use (servers, Sentinels, the
  master set), the NATS include resolves to the mounted auth Secret (a real `nats-server -t`
  reads the config and the auth file `hicache-mesh credentials` wrote), and the Redis ACL
  users are those of `hicache-mesh credentials`.

Not checked: nothing here runs a cluster, kustomize or helm (none on these machines).
"""

from __future__ import annotations

import argparse
import base64
import copy
import importlib
import posixpath
import re
import stat
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
BASE = DEPLOY / "base"
KUSTOMIZATIONS = [BASE, DEPLOY / "overlays" / "multi-host"]
K8S_VERSION = "1.31"
# flag -> number of values: flags of issue 24's other builds, not in this branch's parsers yet
KUSTOMIZE_FIELDS = {"apiVersion", "kind", "resources", "labels", "secretGenerator", "images"}
KUSTOMIZE_FIELDS |= {"patches"}
SECRET_MODES = {0o400, 0o600}
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"

Obj = dict[str, Any]


# ---------------------------------------------------------------- rendering, as kustomize


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def json_patch(doc: Obj, ops: list[Obj]) -> Obj:
    """RFC 6902 add / replace / remove (what the overlays use); a path that does not exist
    fails, as it fails kustomize."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] == "add" and isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), op["value"])
        elif op["op"] in ("add", "replace"):
            key: Any = int(last) if isinstance(node, list) else last
            if op["op"] == "replace" and not (
                key in node if isinstance(node, dict) else key < len(node)
            ):
                raise KeyError(f"replace: {op['path']} does not exist")
            node[key] = op["value"]
        elif op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        else:
            raise AssertionError(f"unsupported patch op {op['op']!r}")
    return doc


@cache
def kustomization(folder: Path) -> Obj:
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - KUSTOMIZE_FIELDS
    assert not unknown, f"{folder}: kustomize fields this test does not render: {unknown}"
    return dict(spec)


def render(folder: Path) -> list[Obj]:
    """The objects `kustomize build folder` makes (Secrets with placeholder data, names
    without the content-hash suffix, which kustomize changes on both sides of a reference)."""
    spec = kustomization(folder)
    out: list[Obj] = []
    for entry in spec.get("resources", []):
        path = (folder / entry).resolve()
        if path.is_dir():
            out += render(path)
        else:
            out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for gen in spec.get("secretGenerator", []):
        data = {f.split("=", 1)[0]: base64.b64encode(b"x").decode() for f in gen["files"]}
        meta = {"name": gen["name"]}
        out.append({"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": data})
    for patch in spec.get("patches", []):
        ops = yaml.safe_load((folder / patch["path"]).read_text())
        target = patch["target"]
        hits = [
            i
            for i, o in enumerate(out)
            if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]
        ]
        assert len(hits) == 1, f"{folder}: patch target {target} matches {len(hits)} objects"
        out[hits[0]] = json_patch(out[hits[0]], ops)
    for label in spec.get("labels", []):
        assert not label.get("includeSelectors") and not label.get("includeTemplates")
        for o in out:
            o["metadata"].setdefault("labels", {}).update(label["pairs"])
    for image in spec.get("images", []):
        for c in (c for o in out for c in containers(o)):
            if c["image"].split(":")[0] == image["name"]:
                c["image"] = (
                    f"{image.get('newName', image['name'])}:{image.get('newTag', 'latest')}"
                )
    return out


def pod_spec(obj: Obj) -> Obj | None:
    if obj["kind"] in ("Deployment", "StatefulSet"):
        return dict(obj["spec"]["template"]["spec"])
    return None


def containers(obj: Obj) -> list[Obj]:
    spec = pod_spec(obj)
    return [] if spec is None else [*spec.get("initContainers", []), *spec["containers"]]


def by_kind(objs: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def rendered() -> Iterator[tuple[str, list[Obj]]]:
    for folder in KUSTOMIZATIONS:
        yield folder.relative_to(DEPLOY).as_posix(), render(folder)


RENDERED = dict(rendered())
IDS = list(RENDERED)


# ---------------------------------------------------------------- the API's schemas


def _validate(obj: Obj) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", IDS)
def test_every_object_is_valid_kubernetes(name: str) -> None:
    import kubernetes_validate

    objs = RENDERED[name]
    assert {"Deployment", "StatefulSet", "Service", "Secret", "PodDisruptionBudget"} <= {
        o["kind"] for o in objs
    }
    for obj in objs:
        _validate(obj)
    # strict: a misspelled field fails (and so does a wrong type)
    (router,) = [o for o in objs if o["metadata"]["name"] == "router" and o["kind"] == "Deployment"]
    broken = copy.deepcopy(router)
    probe = broken["spec"]["template"]["spec"]["containers"][0].pop("livenessProbe")
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = probe
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        _validate(broken)
    broken = json_patch(router, [{"op": "replace", "path": "/spec/replicas", "value": "two"}])
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(broken)


def test_names_are_unique_and_patches_apply() -> None:
    for objs in RENDERED.values():
        keys = [(o["kind"], o["metadata"]["name"]) for o in objs]
        assert len(keys) == len(set(keys)), keys
    with pytest.raises(KeyError):  # a patch whose target path is wrong fails the render
        json_patch({"spec": {}}, [{"op": "replace", "path": "/spec/replica", "value": 2}])


# ---------------------------------------------------------------- commands and the CLI


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion of command arguments from the container's env."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def container_env(c: Obj) -> dict[str, str]:
    """name -> value; a field reference (the pod index) as a sample value, 0."""
    out = {}
    for e in c.get("env", []):
        out[e["name"]] = e.get("value", "0")
    return out


def parser_of(module: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = importlib.import_module(f"{module}.__main__").build_parser()
    return parser


def service_commands(objs: list[Obj]) -> list[tuple[str, str, list[str], Obj]]:
    out = []
    for obj in objs:
        for c in containers(obj):
            cmd = [expand(a, container_env(c)) for a in c["command"]]
            assert cmd[:2] == ["python", "-m"], (obj["metadata"]["name"], cmd)
            out.append((f"{obj['kind']}/{obj['metadata']['name']}", cmd[2], cmd[3:], c))
    return out


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("name", IDS)
def test_every_command_parses_with_its_service_parser(name: str) -> None:
    commands = service_commands(RENDERED[name])
    modules = sorted({m for _, m, _, _ in commands})
    assert modules == ["router", "services.engine", "services.index"]  # compose's parts
    for where, module, argv, _ in commands:
        parser = parser_of(module)
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{name} {where}: `{module}` rejects {argv} (exit {e.code})")
        # the bus is the three-server cluster, Redis its Sentinels
        servers = flag(argv, "--nats-url").split(",")
        assert servers == nats_servers(), where
        if module != "services.engine":
            assert flag(argv, "--redis-sentinel").split(",") == redis_sentinels(), where
            assert flag(argv, "--redis-sentinel-master") == redis_values()["sentinel"]["masterSet"]
            assert "--redis-url" not in argv, where  # Sentinel names the primary
            # the chart puts the ACL users on the Sentinels too: the same user logs in there
            assert flag(argv, "--redis-sentinel-credentials") == flag(argv, "--redis-credentials")


# ---------------------------------------------------------------- references


def secrets_of(objs: list[Obj]) -> dict[str, set[str]]:
    return {n: set(s.get("data", {})) for n, s in by_kind(objs, "Secret").items()}


def secret_mounts(obj: Obj, c: Obj) -> dict[str, str]:
    """mount path -> Secret name, for the container's Secret volumes."""
    spec = pod_spec(obj) or {}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    out = {}
    for m in c.get("volumeMounts", []):
        vol = volumes.get(m["name"])
        if vol and "secret" in vol:
            out[m["mountPath"]] = vol["secret"]["secretName"]
    return out


def secret_file(obj: Obj, c: Obj, path: str, secrets: dict[str, set[str]]) -> None:
    """`path` is a key of a Secret mounted in this container."""
    folder, key = posixpath.split(path)
    mounts = secret_mounts(obj, c)
    assert folder in mounts, f"{obj['metadata']['name']}: {path} is on no Secret volume"
    assert key in secrets[mounts[folder]], f"{obj['metadata']['name']}: Secret lacks {key!r}"


@pytest.mark.parametrize("name", IDS)
def test_every_reference_exists(name: str) -> None:
    objs = RENDERED[name]
    secrets, services = secrets_of(objs), by_kind(objs, "Service")
    workloads = [o for o in objs if pod_spec(o) is not None]
    for obj in workloads:
        spec = pod_spec(obj) or {}
        assert not spec.get("imagePullSecrets")
        for v in spec.get("volumes", []):
            assert "configMap" not in v  # none used: would need a ConfigMap here
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets, v
                for item in v["secret"].get("items", []):
                    assert item["key"] in secrets[v["secret"]["secretName"]], item
        for c in containers(obj):
            names = {v["name"] for v in spec.get("volumes", [])}
            templates = {t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])}
            for m in c.get("volumeMounts", []):
                assert m["name"] in names | templates, m
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]], e
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items()
        if obj["kind"] == "StatefulSet":
            headless = services[obj["spec"]["serviceName"]]
            assert headless["spec"]["clusterIP"] == "None"
    for svc in services.values():
        selected = [
            o
            for o in workloads
            if svc["spec"]["selector"].items()
            <= o["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            target = port["targetPort"]
            for o in selected:
                ports = {p["name"]: p["containerPort"] for c in containers(o) for p in c["ports"]}
                assert target in ports, (svc["metadata"]["name"], target)
                assert port["port"] == ports[target]
    for pdb in by_kind(objs, "PodDisruptionBudget").values():
        match = pdb["spec"]["selector"]["matchLabels"]
        assert [
            o
            for o in workloads
            if match.items() <= o["spec"]["template"]["metadata"]["labels"].items()
        ]


@pytest.mark.parametrize("name", IDS)
def test_credential_files_are_the_credentials_cli_makes(name: str, tmp_path: Path) -> None:
    """Every file a Secret is generated from is one `hicache-mesh credentials base/credentials
    --engines <the manifests' engines>` writes (the API key aside: the README's command), and
    every credentials flag names a file of the pod's own Secret."""
    from services.launch.credentials import EngineGrant, MeshCredentials

    objs = RENDERED[name]
    engines = sorted(
        {
            flag(argv, "--engine-id")
            for _, m, argv, _ in service_commands(objs)
            if m == "services.engine"
        }
    )
    assert engines == ["engine-0", "engine-1"]
    MeshCredentials.fresh([EngineGrant(e) for e in engines]).write(tmp_path / "credentials")
    (tmp_path / "credentials" / "api_key").write_text("key\n")  # README: made beside them
    for gen in kustomization(BASE)["secretGenerator"]:
        for entry in gen["files"]:
            assert (tmp_path / entry.split("=", 1)[1]).is_file(), entry
    secrets = secrets_of(objs)
    for obj in (o for o in objs if pod_spec(o) is not None):
        for c in containers(obj):
            argv = c["command"]
            for f in ("--nats-credentials", "--redis-credentials", "--redis-sentinel-credentials"):
                if f in argv:
                    secret_file(obj, c, flag(argv, f), secrets)
            for e in c.get("env", []):
                if e["name"].endswith("_FILE"):
                    secret_file(obj, c, e["value"], secrets)
            # each pod mounts only its own identity's Secret
            own = {f"hicache-{obj['metadata']['name']}"}
            assert set(secret_mounts(obj, c).values()) == own, obj["metadata"]["name"]


# ---------------------------------------------------------------- probes and resources


@pytest.mark.parametrize("name", IDS)
def test_probes_point_at_real_endpoints(name: str) -> None:
    from aiohttp import web

    from router.handlers import add_routes
    from services.healthcheck import build_parser as probe_parser

    app = web.Application()
    add_routes(app)
    routes = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    objs = RENDERED[name]
    (router,) = [c for o in [by_kind(objs, "Deployment")["router"]] for c in containers(o)]
    port = int(flag(router["command"], "--port"))
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    probes = {k: router[k]["httpGet"] for k in ("readinessProbe", "livenessProbe")}
    assert probes["readinessProbe"]["path"] == "/ready"
    assert probes["livenessProbe"]["path"] == "/health"
    for get in probes.values():
        assert get["path"] in routes
        assert ports.get(get["port"], get["port"]) == port
    assert by_kind(objs, "Service")["router"]["spec"]["ports"][0]["port"] == port
    (index,) = [c for o in [by_kind(objs, "Deployment")["index"]] for c in containers(o)]
    cmd = index["livenessProbe"]["exec"]["command"]
    assert cmd[:3] == ["python", "-m", "services.healthcheck"]
    args = probe_parser().parse_args(cmd[3:])
    assert args.probe == "nats-client" and args.name == "hicache-index"  # the index's client name
    monitor = nats_values()["config"]["monitor"]
    monitors = [
        u.replace("nats://", "http://").replace(":4222", f":{monitor['port']}")
        for u in nats_servers()
    ]
    assert monitor["enabled"] is True and args.monitor_url.split(",") == monitors
    assert index["livenessProbe"]["timeoutSeconds"] > args.timeout * len(monitors)
    for where, module, argv, c in service_commands(objs):
        if module != "services.engine":
            continue
        for kind in ("startupProbe", "livenessProbe"):
            cmd = c[kind]["exec"]["command"]
            assert cmd[:3] == ["python", "-m", "services.healthcheck"], where
            args = probe_parser().parse_args(cmd[3:])
            assert args.probe == "engine" and args.engine_id == flag(argv, "--engine-id")
            assert args.nats_credentials == flag(argv, "--nats-credentials")
            assert args.nats_url == flag(argv, "--nats-url")
            assert c[kind]["timeoutSeconds"] > args.timeout  # the probe answers first


@pytest.mark.parametrize("name", IDS)
def test_every_container_requests_cpu_memory_and_engines_a_gpu(name: str) -> None:
    for where, module, _, c in service_commands(RENDERED[name]):
        requests, limits = c["resources"]["requests"], c["resources"].get("limits", {})
        assert {"cpu", "memory"} <= set(requests), where
        assert "memory" in limits, where
        if module == "services.engine":
            assert int(requests["nvidia.com/gpu"]) >= 1, where
            assert limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"], where  # must match
            assert "--device" in c["command"] and flag(c["command"], "--device") == "cuda"


@pytest.mark.parametrize("name", IDS)
def test_the_grace_period_outlasts_the_drain(name: str) -> None:
    """SIGTERM stops a process within its drain deadline (DESIGN.md 7a): the kubelet must
    not kill it before (its default grace is 30 s)."""
    drains = {"router": "shutdown_timeout", "services.engine": "shutdown_grace"}
    for obj in (o for o in RENDERED[name] if pod_spec(o) is not None):
        grace = (pod_spec(obj) or {}).get("terminationGracePeriodSeconds", 30)
        for c in containers(obj):
            module = c["command"][2]
            argv = [expand(a, container_env(c)) for a in c["command"][3:]]
            if module in drains:
                parser = parser_of(module)
                args = parser.parse_args(argv)
                assert grace > getattr(args, drains[module]), obj["metadata"]["name"]


# ---------------------------------------------------------------- credentials stay files

SECRET_DEST = re.compile(r"(^|_)(key|password|passwd|secret|auth_token|api_token)$")
SECRET_ENV = re.compile(r"(KEY|PASSWORD|PASSWD|SECRET|TOKEN)")


def secret_flags(module: str) -> set[str]:
    """The parser's flags that would take a secret's value itself (not a file)."""
    out = set()
    for action in parser_of(module)._actions:
        if SECRET_DEST.search(action.dest):
            out |= set(action.option_strings)
    return out


@pytest.mark.parametrize("name", IDS)
def test_no_credential_on_a_command_line(name: str) -> None:
    objs = RENDERED[name]
    for where, module, argv, c in service_commands(objs):
        assert not (set(argv) & secret_flags(module)), where
        probes = [c[k].get("exec", {}).get("command", []) for k in c if k.endswith("Probe")]
        for arg in [*argv, *(a for p in probes for a in p)]:
            assert not re.search(r"://[^/@\s]+:[^/@\s]*@", arg), (where, "userinfo in a URL")
        for e in c.get("env", []):
            if SECRET_ENV.search(e["name"]) and "value" in e:
                assert e["name"].endswith("_FILE"), (where, e["name"])
    assert "--api-key" in secret_flags("router")  # the check sees the router's key flag


@pytest.mark.parametrize("name", IDS)
def test_credential_files_are_private_and_readable(name: str, tmp_path: Path) -> None:
    """Secret volumes of mode 0400 (or 0600), read by their owner (root) in pods with no
    fsGroup: the kubelet makes a Secret's files group-readable under an fsGroup, and
    read_credentials refuses those."""
    from bus_schemas.connection import CredentialsError, read_credentials

    for obj in (o for o in RENDERED[name] if pod_spec(o) is not None):
        spec = pod_spec(obj) or {}
        secret_volumes = [v for v in spec.get("volumes", []) if "secret" in v]
        assert secret_volumes, obj["metadata"]["name"]
        for v in secret_volumes:
            assert v["secret"]["defaultMode"] in SECRET_MODES, v
            assert all(i.get("mode", 0o400) in SECRET_MODES for i in v["secret"].get("items", []))
        security = spec.get("securityContext", {})
        assert "fsGroup" not in security, obj["metadata"]["name"]
        assert security.get("runAsUser") == 0, obj["metadata"]["name"]  # the files' owner
        for c in containers(obj):
            assert all(
                m.get("readOnly")
                for m in c["volumeMounts"]
                if m["mountPath"].startswith("/run/secrets")
            )
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
    path = tmp_path / "nats"
    path.write_text("router:pw\n")
    for mode, ok in ((0o400, True), (0o600, True), (0o440, False)):
        path.chmod(mode)
        if ok:
            assert read_credentials(path).user == "router"
        else:
            with pytest.raises(CredentialsError, match=f"{stat.S_IMODE(mode):04o}"):
                read_credentials(path)


# ---------------------------------------------------------------- one engine, two hosts


def test_multi_host_engine_is_an_indexed_statefulset() -> None:
    objs = RENDERED["overlays/multi-host"]
    sts, services = by_kind(objs, "StatefulSet"), by_kind(objs, "Service")
    engine = sts["engine-1"]
    (c,) = containers(engine)
    argv = c["command"]
    nnodes = int(flag(argv, "--nnodes"))
    assert engine["spec"]["replicas"] == nnodes == 2
    # the ordinal is the rank: the pod-index label, through the environment
    assert flag(argv, "--node-rank") == "$(NODE_RANK)"
    (rank_env,) = [e for e in c["env"] if e["name"] == "NODE_RANK"]
    assert rank_env["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX
    # rank 0's stable DNS name, through the headless Service, on a declared port
    host, port = flag(argv, "--dist-init-addr").rsplit(":", 1)
    service = engine["spec"]["serviceName"]
    assert host == f"{engine['metadata']['name']}-0.{service}"
    assert services[service]["spec"]["clusterIP"] == "None"
    assert services[service]["spec"]["publishNotReadyAddresses"] is True  # before readiness
    assert int(port) in {p["containerPort"] for p in c["ports"]}
    assert engine["spec"]["podManagementPolicy"] == "Parallel"  # rank 0 waits for rank 1
    # the world is the pods' GPUs: one rank per GPU
    size = (
        int(flag(argv, "--tp-size")) * int(flag(argv, "--pp-size")) * int(flag(argv, "--cp-size"))
    )
    assert size == nnodes * int(c["resources"]["limits"]["nvidia.com/gpu"])
    # and the single-host engines have none of it
    for other in (s for n, s in sts.items() if n != "engine-1"):
        (oc,) = containers(other)
        assert other["spec"]["replicas"] == 1 and "--nnodes" not in oc["command"]
    parser = parser_of("services.engine")
    argv0 = [expand(a, {"NODE_RANK": "0"}) for a in argv[3:]]
    parser.parse_args(argv0)


# ---------------------------------------------------------------- the charts' values


def nats_values() -> Obj:
    return dict(yaml.safe_load((DEPLOY / "helm" / "nats-values.yaml").read_text()))


def redis_values() -> Obj:
    return dict(yaml.safe_load((DEPLOY / "helm" / "redis-values.yaml").read_text()))


NATS_RELEASE, REDIS_RELEASE = "hicache-nats", "hicache-redis"


def nats_servers() -> list[str]:
    """The pods of the `nats` chart installed as NATS_RELEASE, by stable name."""
    cluster = nats_values()["config"]["cluster"]
    assert cluster["enabled"] is True
    return [
        f"nats://{NATS_RELEASE}-{i}.{NATS_RELEASE}-headless:4222"
        for i in range(cluster["replicas"])
    ]


def redis_sentinels() -> list[str]:
    values = redis_values()
    assert values["sentinel"]["enabled"] is True and values["architecture"] == "replication"
    return [
        f"{REDIS_RELEASE}-node-{i}.{REDIS_RELEASE}-headless:26379"
        for i in range(values["replica"]["replicaCount"])
    ]


def readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Run on Kubernetes")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def readme_secrets() -> dict[str, set[str]]:
    """Secret name -> keys, from the README's `kubectl create secret generic` commands."""
    out = {}
    for line in readme_section().replace("\\\n", " ").splitlines():
        m = re.search(r"kubectl create secret generic (\S+)", line)
        if m:
            out[m.group(1)] = set(re.findall(r"--from-file=([\w.-]+)=", line))
    return out


def test_the_readme_runs_what_is_here() -> None:
    text = readme_section()
    assert len(nats_servers()) == 3 and len(redis_sentinels()) == 3
    assert (
        f"helm install {NATS_RELEASE} nats/nats -f deploy/kubernetes/helm/nats-values.yaml" in text
    )
    assert (
        f"helm install {REDIS_RELEASE} bitnami/redis -f deploy/kubernetes/helm/redis-values.yaml"
        in text
    )
    for folder in KUSTOMIZATIONS:
        assert f"kubectl apply -k {folder.relative_to(ROOT).as_posix()}" in text
    assert (
        "hicache-mesh credentials deploy/kubernetes/base/credentials --engines engine-0,engine-1"
        in text
    )
    made = readme_secrets()
    # what the charts' values name
    nats_mount = nats_values()["podTemplate"]["patch"][0]["value"]["secret"]["secretName"]
    redis = redis_values()["auth"]
    assert made[nats_mount] == {"nats-auth.conf"}
    assert made[redis["acl"]["userSecret"]] == {u["username"] for u in redis["acl"]["users"]}
    assert made[redis["existingSecret"]] == {redis["existingSecretPasswordKey"]}
    assert not re.search(r"--from-literal", text), "a literal is a secret on a command line"
    # the Redis chart reads its users' Secret while it renders (no Secret: no password)
    assert text.index(f"generic {redis['acl']['userSecret']}") < text.index("helm install")


def test_nats_values_include_the_auth_secret(tmp_path: Path) -> None:
    """The chart's config includes nats-auth.conf from the mounted Secret; a real nats-server
    reads a config laid out as the chart lays it out (its /etc/nats-config/nats.conf, the
    Secret at the patch's mount path) with the file `hicache-mesh credentials` wrote."""
    from services.launch.credentials import EngineGrant, MeshCredentials
    from services.launch.servers import NATS_MAX_PAYLOAD, find_nats_server

    values = nats_values()
    merge = values["config"]["merge"]
    assert merge["max_payload"] == NATS_MAX_PAYLOAD  # as compose/nats.conf and `up`
    (mount,) = [p["value"] for p in values["container"]["patch"] if p["path"] == "/volumeMounts/-"]
    (volume,) = [p["value"] for p in values["podTemplate"]["patch"] if p["path"] == "/volumes/-"]
    assert mount["name"] == volume["name"] and mount["readOnly"] is True
    assert volume["secret"]["defaultMode"] in SECRET_MODES
    include = posixpath.normpath(posixpath.join("/etc/nats-config", merge["$include"]))
    assert posixpath.dirname(include) == mount["mountPath"]
    root = tmp_path / "root"
    config_dir = root / "etc" / "nats-config"
    config_dir.mkdir(parents=True)
    auth = root / mount["mountPath"].lstrip("/")
    MeshCredentials.fresh([EngineGrant("engine-0")]).write(auth)
    assert (auth / posixpath.basename(include)).is_file()
    conf = config_dir / "nats.conf"
    conf.write_text(
        f"port: 4222\nmax_payload: {merge['max_payload']}\ninclude {merge['$include']}\n"
    )
    checked = subprocess.run(
        [find_nats_server(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30
    )
    assert checked.returncode == 0, checked.stderr + checked.stdout
    (auth / posixpath.basename(include)).write_text("authorization { users = [ {user: a\n")
    broken = subprocess.run(
        [find_nats_server(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30
    )
    assert broken.returncode != 0  # the check reads the included file


def test_redis_values_make_the_credentials_acl_users() -> None:
    """The chart writes `user NAME on #HASH KEYS CHANNELS COMMANDS` per ACL user: the same
    rules as `hicache-mesh credentials`' redis-users.acl (its `default off` aside: the chart
    keeps `default` for replication and Sentinel, with a password no hicache process has)."""
    from services.launch.credentials import EngineGrant, MeshCredentials

    acl = MeshCredentials.fresh([EngineGrant("engine-0")]).redis_acl()
    ours = {}
    for line in acl.splitlines():
        _, user, state, *rules = line.split()
        if user != "default":
            assert state == "on"
            ours[user] = [r for r in rules if not r.startswith("#")]
    chart = {}
    for u in redis_values()["auth"]["acl"]["users"]:
        assert u["enabled"] == "on"
        chart[u["username"]] = f"{u['keys']} {u['channels']} {u['commands']}".split()

    def split(rules: list[str]) -> tuple[set[str], list[str]]:
        commands = [r for r in rules if r[0] in "+-"]
        return {r for r in rules if r not in commands}, commands

    assert set(chart) == set(ours)
    for user in ours:
        assert split(chart[user]) == split(ours[user]), user
    assert redis_values()["auth"]["acl"]["sentinel"] is True  # the users reach the Sentinels
