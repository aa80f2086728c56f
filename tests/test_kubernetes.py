"""deploy/kubernetes/, offline: every manifest against the Kubernetes API schemas (kubernetes-validate ships them in
its wheel: no cluster, no network), strictly (an unknown field fails), and what no schema knows: the kustomization
names every manifest, probes hit the ports and the health services the processes serve, the workers agree on the
slot geometry, the /dev/shm emptyDir holds the arena the decode worker's flags ask for (the slot size from
tests/test_docker.py's formula, itself checked against the engine), memory requests cover the mmapped weights plus
the arena or the prefix cache, the gateway lists exactly the worker pods the StatefulSets make, and every Secret,
ConfigMap and claim a pod mounts exists."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from splitgemma.commands import byte_count
from test_docker import e2b_config, kv_slot_bytes

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"   # the oldest version still supported upstream when this was written; newer ones pass too


def kustomization() -> dict:
    return yaml.safe_load((KUBE / "kustomization.yaml").read_text())


def resources() -> list[tuple[str, dict]]:
    out = []
    for name in kustomization()["resources"]:
        for doc in yaml.safe_load_all((KUBE / name).read_text()):
            if doc is not None:
                out.append((name, doc))
    return out


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in resources() if d["kind"] == kind}


def flags(args: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)


def containers() -> list[tuple[dict, dict]]:
    """(pod template, container) of every workload."""
    out = []
    for kind in ("Deployment", "StatefulSet"):
        for w in by_kind(kind).values():
            for c in w["spec"]["template"]["spec"]["containers"]:
                out.append((w["spec"]["template"], c))
    return out


def service_of(container: dict) -> str | None:
    args = container.get("args") or []
    return args[0] if args and args[0] in ("gateway", "prefill", "decode") else None


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


@pytest.mark.parametrize("version", [K8S_VERSION, kubernetes_validate.latest_version()])
def test_every_manifest_validates_against_the_kubernetes_schemas(version):
    docs = resources()
    assert len(docs) >= 10
    for name, doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field


def test_the_validator_refuses_what_it_should():
    """Not a check that cannot fail: a misspelt field or a wrong type is refused."""
    (_, svc), = [(n, d) for n, d in resources() if d["kind"] == "Service" and d["metadata"]["name"] ==
                 "splitgemma-gateway"]
    bad = {**svc, "spec": {**svc["spec"], "selectr": svc["spec"]["selector"]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = {**svc, "spec": {**svc["spec"], "ports": [{"port": "eight thousand"}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_the_kustomization_names_every_manifest():
    k = kustomization()
    on_disk = {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(k["resources"]) == on_disk
    generated = {g["name"]: g for g in k["secretGenerator"]}
    keys = {f.split("=", 1)[0] for f in generated["splitgemma-credentials"]["files"]}
    assert keys == {"service_token", "api_keys"}


def test_probes_hit_the_health_endpoints_of_each_process():
    grpc_service = {"decode": "splitgemma.v1.Decode", "prefill": "splitgemma.v1.Prefill"}
    for _, c in containers():
        kind = service_of(c)
        if kind is None:
            continue
        ports = {p["containerPort"]: p["name"] for p in c["ports"]}
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        f = flags(c["args"])
        assert int(f["port"]) in ports and f["host"] == "0.0.0.0"
        probes = [c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c]
        assert {"readinessProbe", "livenessProbe"} <= set(c)
        for probe in probes:
            if kind == "gateway":
                assert named[probe["httpGet"]["port"]] == int(f["port"])
                assert probe["httpGet"]["path"] in ("/health", "/ready")
            else:
                # grpc.health.v1 answers without the service token (docs/security.md), so the kubelet may ask
                assert probe["grpc"] == {"port": int(f["port"]), "service": grpc_service[kind]}
        if kind == "gateway":
            assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"


def test_workers_agree_on_the_slot_geometry_and_the_arena_fits_its_emptydir():
    geometry = set()
    for template, c in containers():
        kind = service_of(c)
        if kind not in ("decode", "prefill"):
            continue
        f = flags(c["args"])
        geometry.add((f["max-context"], f["chunk"]))
        notes = template["metadata"]["annotations"]
        slot = kv_slot_bytes(e2b_config(), int(f["max-context"]), int(f["chunk"]))
        assert int(notes["splitgemma.dev/slot-bytes"]) == slot
        model = int(notes["splitgemma.dev/model-bytes"])
        request = memory_bytes(c["resources"]["requests"]["memory"])
        assert memory_bytes(c["resources"]["limits"]["memory"]) >= request
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert volumes[mounts["/models"]]["persistentVolumeClaim"]["readOnly"] is True
        assert f["model"].startswith("/models/")
        if kind == "decode":
            arena = int(f["slots"]) * slot
            shm = volumes[mounts[f["shm-dir"]]]["emptyDir"]
            assert shm["medium"] == "Memory" and memory_bytes(shm["sizeLimit"]) >= arena + (1 << 20)
            assert int(notes["splitgemma.dev/slots"]) == int(f["slots"])
            need = model + arena
        else:
            cache = byte_count(f["prefix-cache-bytes"])
            assert cache == int(notes["splitgemma.dev/prefix-cache-bytes"])
            need = model + cache
        assert request >= need + (512 << 20), (c["name"], request, need)
    assert len(geometry) == 1, geometry


def test_colocated_workers_share_the_arena_and_spread_ones_do_not():
    pair = by_kind("StatefulSet")["splitgemma-pair"]["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in pair["containers"]}
    shm = {c: flags(by_name[c]["args"])["shm-dir"] for c in ("decode", "prefill")}
    assert shm["decode"] == shm["prefill"]
    mounted = {c: {m["mountPath"]: m["name"] for m in by_name[c]["volumeMounts"]}[shm[c]] for c in shm}
    assert mounted["decode"] == mounted["prefill"]   # one emptyDir: the prefill worker maps the arena
    uid = pair["securityContext"]["runAsUser"]        # the arena is 0600: the same uid in both
    assert all(by_name[c].get("securityContext", {}).get("runAsUser", uid) == uid for c in shm)
    spread = by_kind("StatefulSet")["splitgemma-prefill"]["spec"]["template"]["spec"]
    assert all(m["mountPath"] != "/dev/shm" for m in spread["containers"][0]["volumeMounts"])


def test_the_gateway_lists_exactly_the_worker_pods():
    sets, services = by_kind("StatefulSet"), by_kind("Service")
    gateway = next(c for _, c in containers() if service_of(c) == "gateway")
    f = flags(gateway["args"])
    listed = {kind: set(f[kind].split(",")) for kind in ("prefill", "decode")}
    expect = {"prefill": set(), "decode": set()}
    for name, s in sets.items():
        svc = services[s["spec"]["serviceName"]]
        assert svc["spec"]["clusterIP"] == "None"           # headless: a DNS name per pod
        for c in s["spec"]["template"]["spec"]["containers"]:
            kind = service_of(c)
            port = int(flags(c["args"])["port"])
            assert port in {p["port"] for p in svc["spec"]["ports"]}
            for i in range(s["spec"]["replicas"]):
                expect[kind].add(f"{name}-{i}.{svc['metadata']['name']}:{port}")
    assert listed == expect


def test_every_reference_resolves():
    configmaps, claims = by_kind("ConfigMap"), by_kind("PersistentVolumeClaim")
    secrets = {g["name"] for g in kustomization()["secretGenerator"]}
    services = by_kind("Service")
    for template, c in containers():
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for m in c["volumeMounts"]:
            assert m["name"] in volumes
        for v in volumes.values():
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
        f = flags(c.get("args") or [])
        for key in ("service-token-file", "api-key-file"):
            if key in f:
                directory, _, item = f[key].rpartition("/")
                secret_mount = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}[directory]
                source = volumes[secret_mount]["secret"]
                assert item in {i["path"] for i in source.get("items", [{"path": item}])}
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if service_of(c):
            host = env["OTEL_EXPORTER_OTLP_ENDPOINT"].split("//")[1].split(":")[0]
            assert host in services
    # every Service selects pods that exist
    labels = [t["metadata"]["labels"] for t, _ in containers()]
    for s in services.values():
        assert any(s["spec"]["selector"].items() <= l.items() for l in labels), s["metadata"]["name"]
