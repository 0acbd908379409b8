"""deploy/: the manifests load strictly into the real `kubernetes` and `kserve` API models (the PodMonitor into
the fields of the Prometheus Operator's CRD that it uses), `kubectl kustomize` renders them with the monitoring
namespace from its one field, the InferenceService runs `onecard serve` with the team's args (no shell) that
onecard's own `serve` parser accepts, and the Dockerfile's version claims hold.

The Kubernetes client ignores keys it does not know, so `build()` walks every key against the model class's
`attribute_map` / `openapi_types` and builds the real model objects (their setters check required fields); a
round trip back through `sanitize_for_serialization` must give the YAML back unchanged.
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes = pytest.importorskip("kubernetes")
kserve_models = pytest.importorskip("kserve.models")
from kserve.api_client import ApiClient as KServeApiClient
from kubernetes.client import ApiClient
from kubernetes.utils import parse_quantity

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
MODEL_ID = "ModelCloud/Qwen3-Coder-30B-A3B-Instruct-GPTQMODEL-W4A16-A"
# The team's deployment flags, as the issue gives them.
TEAM_ARGS = [
    f"--model={MODEL_ID}", "--served-model-name", "coder", "reasoning", "--quantization=gptq",
    "--dtype=float16", "--kv-cache-dtype=auto", "--max-model-len=65536", "--tensor-parallel-size=1",
    "--pipeline-parallel-size=1", "--gpu-memory-utilization=0.90", "--max-num-seqs=16",
    "--max-num-batched-tokens=8192", "--long-prefill-token-threshold=2048", "--enable-chunked-prefill",
    "--enable-prefix-caching", "--reasoning-parser=qwen3", "--enable-auto-tool-choice",
    "--tool-call-parser=hermes", "--host=0.0.0.0", "--port=8080",
]
MODELS = {
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy",
    ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService",
    ("monitoring.coreos.com/v1", "PodMonitor"): "PodMonitor",
}
# The PodMonitor fields this deployment uses, with their types, from the Prometheus Operator's CRD
# (monitoring.coreos.com_podmonitors.yaml, v1); anything else is refused like a misspelt field.
_LABEL_SELECTOR = {"matchLabels": {str: str}, "matchExpressions": [dict]}
PODMONITOR = {
    "apiVersion": str, "kind": str,
    "metadata": {"name": str, "namespace": str, "labels": {str: str}, "annotations": {str: str}},
    "spec": {"selector": _LABEL_SELECTOR, "namespaceSelector": {"any": bool, "matchNames": [str]},
             "jobLabel": str, "podTargetLabels": [str], "sampleLimit": int,
             "podMetricsEndpoints": [{"port": str, "portNumber": int, "path": str, "scheme": str,
                                      "interval": str, "scrapeTimeout": str, "honorLabels": bool}]},
}
_DURATION = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
                       r"(([0-9]+)ms)?)$")


# ---------------------------------------------------------------- strict loading
class SchemaError(AssertionError):
    pass


def _model_class(name: str) -> type:
    # kserve names the k8s types it embeds by Go package, e.g. K8sIoApiAppsV1DeploymentStrategy.
    m = re.fullmatch(r"K8sIoApi[A-Z][a-z]+(V\d+(?:alpha\d+|beta\d+)?)(\w+)", name)
    if m:
        name = m.group(1) + m.group(2)
    for module in (kserve_models, kubernetes.client.models):
        if hasattr(module, name):
            return getattr(module, name)
    raise SchemaError(f"no API model named {name}")


def build(data: Any, type_name: str, path: str = "") -> Any:
    """Build `type_name` from YAML data, failing on any key the model does not have."""
    if data is None:
        return None
    # The generators spell containers list[X] / dict(str, X); some kserve models use List[X] / Dict[str, X].
    if m := re.fullmatch(r"[lL]ist\[(.+)\]", type_name):
        if not isinstance(data, list):
            raise SchemaError(f"{path}: expected a list for {type_name}, got {type(data).__name__}")
        return [build(v, m.group(1), f"{path}[{i}]") for i, v in enumerate(data)]
    if m := re.fullmatch(r"[dD]ict[(\[]str, (.+)[)\]]", type_name):
        if not isinstance(data, dict):
            raise SchemaError(f"{path}: expected a mapping for {type_name}")
        return {k: build(v, m.group(1), f"{path}.{k}") for k, v in data.items()}
    primitive = {"str": str, "int": int, "bool": bool, "float": (int, float), "datetime": str, "date": str}
    if type_name == "object":           # IntOrString and free-form fields
        return data
    if type_name in primitive:
        ok = isinstance(data, primitive[type_name]) and not (type_name == "int" and isinstance(data, bool))
        if not ok:
            raise SchemaError(f"{path}: {data!r} is not a {type_name}")
        return data
    cls = _model_class(type_name)
    if not isinstance(data, dict):
        raise SchemaError(f"{path}: expected a {type_name} mapping, got {data!r}")
    by_json = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    kwargs = {}
    for key, value in data.items():
        if key not in by_json:
            raise SchemaError(f"{path}.{key}: not a field of {cls.__name__} (fields: {sorted(by_json)})")
        attr = by_json[key]
        kwargs[attr] = build(value, cls.openapi_types[attr], f"{path}.{key}")
    try:
        return cls(**kwargs)
    except ValueError as e:             # the generated setters reject missing required fields
        raise SchemaError(f"{path}: {cls.__name__}: {e}") from None


def check_shape(data: Any, shape: Any, path: str) -> None:
    """``data`` against a nested shape: a dict of known keys, {str: T} maps, [T] lists, or a type."""
    if isinstance(shape, dict) and list(shape) == [str]:
        if not isinstance(data, dict):
            raise SchemaError(f"{path}: expected a mapping")
        for k, v in data.items():
            check_shape(v, shape[str], f"{path}.{k}")
    elif isinstance(shape, dict):
        if not isinstance(data, dict):
            raise SchemaError(f"{path}: expected a mapping, got {data!r}")
        for k, v in data.items():
            if k not in shape:
                raise SchemaError(f"{path}.{k}: not a field (fields: {sorted(shape)})")
            check_shape(v, shape[k], f"{path}.{k}")
    elif isinstance(shape, list):
        if not isinstance(data, list):
            raise SchemaError(f"{path}: expected a list")
        for i, v in enumerate(data):
            check_shape(v, shape[0], f"{path}[{i}]")
    elif not isinstance(data, shape) or (shape is int and isinstance(data, bool)):
        raise SchemaError(f"{path}: {data!r} is not a {shape.__name__}")


def load_podmonitor(doc: dict[str, Any]) -> dict[str, Any]:
    check_shape(doc, PODMONITOR, "PodMonitor")
    endpoints = doc["spec"]["podMetricsEndpoints"]
    assert endpoints and doc["spec"]["selector"]["matchLabels"], "a PodMonitor needs endpoints and a selector"
    for ep in endpoints:
        for key in ("interval", "scrapeTimeout"):
            if key in ep and not _DURATION.match(ep[key]):
                raise SchemaError(f"PodMonitor endpoint {key}={ep[key]!r} is not a Prometheus duration")
    return doc


def load_strict(doc: dict[str, Any]) -> Any:
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in MODELS:
        raise SchemaError(f"no API model registered for {key}")
    if MODELS[key] == "PodMonitor":
        return load_podmonitor(doc)
    obj = build(doc, MODELS[key], doc["kind"])
    # kserve's serializer walks attribute_map on any model (kubernetes' own one skips kserve objects).
    back = KServeApiClient().sanitize_for_serialization(obj)
    assert back == doc, f"{doc['kind']} does not round-trip through {MODELS[key]}"
    return obj


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


@pytest.fixture(scope="module")
def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def isvc_doc() -> dict[str, Any]:
    (doc,) = _docs("inferenceservice.yaml")
    return doc


@pytest.fixture(scope="module")
def isvc(isvc_doc):
    return load_strict(isvc_doc)


@pytest.fixture(scope="module")
def container(isvc):
    (c,) = isvc.spec.predictor.containers
    return c


def test_every_manifest_loads_strictly(kustomization):
    for name in kustomization["resources"]:
        for doc in _docs(name):
            load_strict(doc)
            assert doc["metadata"]["namespace"] == kustomization["namespace"] == "llm-serving", name
    # Every manifest in the folder is part of the kustomization.
    listed = set(kustomization["resources"])
    assert {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"} == listed


def test_misspelt_fields_fail(isvc_doc):
    bad = copy.deepcopy(isvc_doc)
    bad["spec"]["predictor"]["containers"][0]["readinessProbe"]["periodSecond"] = 10
    with pytest.raises(SchemaError, match=r"readinessProbe\.periodSecond: not a field of V1Probe"):
        load_strict(bad)
    bad = copy.deepcopy(isvc_doc)
    bad["spec"]["predictor"]["nodeSelecter"] = bad["spec"]["predictor"].pop("nodeSelector")
    with pytest.raises(SchemaError, match="nodeSelecter"):
        load_strict(bad)
    bad = copy.deepcopy(isvc_doc)
    bad["spec"]["predictor"]["minReplicas"] = "1"
    with pytest.raises(SchemaError, match="minReplicas"):
        load_strict(bad)
    # ...which the client's own deserializer lets through silently: the reason for `build`.
    probe = ApiClient()._ApiClient__deserialize({"periodSecond": 10}, "V1Probe")
    assert probe.period_seconds is None


def test_networkpolicy_from_the_client_deserializer_too(isvc, container):
    (doc,) = _docs("networkpolicy.yaml")
    np_ = ApiClient()._ApiClient__deserialize(doc, "V1NetworkPolicy")
    assert ApiClient().sanitize_for_serialization(np_) == doc
    assert np_.spec.policy_types == ["Ingress"]
    # It selects the predictor pods: KServe labels them with the InferenceService's name.
    assert np_.spec.pod_selector.match_labels == {"serving.kserve.io/inferenceservice": isvc.metadata.name}
    clients, scrape = np_.spec.ingress
    assert [p.namespace_selector.match_labels for p in clients._from] == [{"kubernetes.io/metadata.name": "poimen"}]
    assert [(p.protocol, p.port) for p in clients.ports] == [("TCP", 8080)]
    # The scrape: the monitoring namespace only, on the port that serves /metrics only.
    assert [p.namespace_selector.match_labels for p in scrape._from] == [
        {"kubernetes.io/metadata.name": "monitoring"}]
    assert all(p.pod_selector is None and p.ip_block is None for p in scrape._from)
    metrics_port = int(isvc.spec.predictor.annotations["prometheus.io/port"])
    assert [(p.protocol, p.port) for p in scrape.ports] == [("TCP", metrics_port)]
    assert metrics_port in [p.container_port for p in container.ports]


def test_scrape_configuration(isvc, container):
    ann = isvc.spec.predictor.annotations
    assert (ann["prometheus.io/scrape"], ann["prometheus.io/path"]) == ("true", "/metrics")
    (pm,) = _docs("podmonitor.yaml")
    load_podmonitor(pm)
    assert pm["spec"]["selector"]["matchLabels"] == {"serving.kserve.io/inferenceservice": isvc.metadata.name}
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    (port,) = [p for p in container.ports if p.name == ep["port"]]
    assert (port.container_port, ep["path"]) == (int(ann["prometheus.io/port"]), "/metrics")
    bad = copy.deepcopy(pm)
    bad["spec"]["podMetricEndpoints"] = bad["spec"].pop("podMetricsEndpoints")
    with pytest.raises(SchemaError, match="podMetricEndpoints: not a field"):
        load_podmonitor(bad)
    bad = copy.deepcopy(pm)
    bad["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(SchemaError, match="duration"):
        load_podmonitor(bad)


def _kustomize(folder: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_kustomize_renders_and_names_the_monitoring_namespace_once(tmp_path, kustomization):
    docs = _kustomize(K8S)
    assert sorted(d["kind"] for d in docs) == ["InferenceService", "NetworkPolicy", "PersistentVolumeClaim",
                                               "PodMonitor"]        # the settings ConfigMap stays local
    for d in docs:
        load_strict(d)
    (lit,) = kustomization["configMapGenerator"][0]["literals"]
    assert lit == "monitoring-namespace=monitoring"
    # Change the one field: the policy's scrape rule follows.
    shutil.copytree(K8S, tmp_path / "k8s")
    kfile = tmp_path / "k8s" / "kustomization.yaml"
    kfile.write_text(kfile.read_text().replace(lit, "monitoring-namespace=observability"))
    (np_,) = [d for d in _kustomize(tmp_path / "k8s") if d["kind"] == "NetworkPolicy"]
    assert [r["from"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
            for r in np_["spec"]["ingress"]] == ["poimen", "observability"]
    images = {d["spec"]["predictor"]["containers"][0]["image"] for d in docs if d["kind"] == "InferenceService"}
    assert images == {"ghcr.io/onecard/onecard:0.1.0"}


def test_inferenceservice_shape(isvc, container):
    meta, pred = isvc.metadata, isvc.spec.predictor
    assert (meta.name, meta.namespace) == ("coder", "llm-serving")
    assert meta.annotations["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert pred.deployment_strategy.type == "Recreate"
    assert pred.min_replicas == pred.max_replicas == 1
    assert pred.node_selector
    assert [p.container_port for p in container.ports] == [8080]
    for probe in (container.startup_probe, container.readiness_probe):
        assert (probe.http_get.path, probe.http_get.port) == ("/health", 8080)
    # The start-up budget covers a 16.9 GB cold download at 25 MB/s plus 5 minutes of loading.
    s = container.startup_probe
    assert s.period_seconds * s.failure_threshold >= 16.9e9 / 25e6 + 300
    req, lim = container.resources.requests, container.resources.limits
    assert req["nvidia.com/gpu"] == lim["nvidia.com/gpu"] == "1"
    for res in ("cpu", "memory"):
        assert 0 < parse_quantity(req[res]) <= parse_quantity(lim[res]), res
    env = {e.name: e.value for e in container.env}
    assert env["HF_HOME"] == "/mnt/models"


def test_volumes(isvc, container):
    volumes = {v.name: v for v in isvc.spec.predictor.volumes}
    mounts = {m.mount_path: volumes[m.name] for m in container.volume_mounts}
    (pvc,) = _docs("pvc.yaml")
    assert mounts["/mnt/models"].persistent_volume_claim.claim_name == pvc["metadata"]["name"]
    shm = mounts["/dev/shm"].empty_dir
    assert shm.medium == "Memory" and parse_quantity(shm.size_limit) > 64 * 2**20
    # A memory-backed emptyDir counts against the container's memory limit.
    assert parse_quantity(shm.size_limit) < parse_quantity(container.resources.limits["memory"]) / 2


def test_args_are_the_team_flags_and_parse_with_onecard_serve(container):
    from onecard.cli import build_serve_parser, check_parser_flags, engine_args_from_namespace

    assert container.args == TEAM_ARGS
    parser = build_serve_parser()
    parser.allow_abbrev = False          # a flag renamed to a longer name must not match by prefix
    try:
        ns = parser.parse_args(container.args)
    except SystemExit as e:
        pytest.fail(f"onecard serve rejects the manifest's args (exit {e.code}); see the usage error above")
    assert ns.served_model_name == ["coder", "reasoning"]
    assert (ns.quantization, ns.dtype, ns.kv_cache_dtype) == ("gptq", "float16", "auto")
    assert (ns.max_model_len, ns.max_num_seqs, ns.max_num_batched_tokens) == (65536, 16, 8192)
    assert ns.long_prefill_token_threshold == 2048 and ns.gpu_memory_utilization == pytest.approx(0.9)
    assert ns.enable_chunked_prefill is True and ns.enable_prefix_caching is True
    assert (ns.reasoning_parser, ns.enable_auto_tool_choice, ns.tool_call_parser) == ("qwen3", True, "hermes")
    assert (ns.host, ns.port) == ("0.0.0.0", container.ports[0].container_port)
    check_parser_flags(ns)               # parser names exist, auto tool choice has its parser
    ea = engine_args_from_namespace(ns)
    assert ea.model == MODEL_ID and ea.tensor_parallel_size == ea.pipeline_parallel_size == 1


def test_container_runs_onecard_serve_directly(container):
    # No shell wrapper: the container's command is `onecard serve` and its args are vllm serve's list.
    assert container.command == ["onecard", "serve"]
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["onecard"]' in dockerfile
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["onecard"] == "onecard.cli:main"


def test_kustomize_image_matches_the_container(kustomization, container):
    (image,) = kustomization["images"]
    assert container.image.split(":")[0] == image["name"]


def test_dockerfile_versions():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    base = re.search(r"ARG CUDA_BASE=nvidia/cuda:(\d+)\.(\d+)", text)
    assert base and base.group(1) == "12", "CUDA 13 cannot target sm70: the base must be CUDA 12.x"
    assert re.search(r"ARG TORCH_INDEX=https://download.pytorch.org/whl/cu126\b", text)
    torch_v = tuple(int(x) for x in re.search(r"ARG TORCH_VERSION=(\d+)\.(\d+)", text).groups())
    assert (2, 6) <= torch_v <= (2, 14), "PyTorch published cu126 (sm_70) wheels for 2.6 .. 2.14"
    triton_v = re.search(r"ARG TRITON_VERSION=([\d.]+)", text).group(1)
    triton = pytest.importorskip("triton")
    assert triton_v == triton.__version__, "the image's Triton differs from the one the kernel tests use"


def test_triton_bundled_ptxas_accepts_sm70(tmp_path):
    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton has no bundled ptxas")
    src = tmp_path / "k.ptx"
    src.write_text(".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry k() { ret; }\n")
    subprocess.run([str(ptxas), "--gpu-name=sm_70", str(src), "-o", str(tmp_path / "k.cubin")], check=True,
                   capture_output=True, timeout=60, env={**os.environ})
    assert (tmp_path / "k.cubin").stat().st_size > 0
