"""deploy/k8s/*.yaml parse, hold the expected kinds, and agree with the scripts they run: the
server's args are valid serve.py flags, its port is the one the probes, the Prometheus
annotations, the Service and the ServiceMonitor name; the RayJob's entrypoint is a valid
batch_infer.py --ray command."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path
from typing import Any

import yaml

from jaxcb.server.cli import build_parser as serve_parser

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy/k8s"


def load(name: str) -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return {d["kind"]: d for d in docs}


def test_every_manifest_parses() -> None:
    kinds = {kind for path in K8S.glob("*.yaml") for kind in load(path.name)}
    assert kinds == {"Deployment", "Service", "ServiceMonitor", "RayJob"}


def test_server_ports_probes_and_flags_agree() -> None:
    docs = load("jaxcb-server.yaml")
    pod = docs["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["command"][-1] == "scripts/serve.py"
    args = serve_parser().parse_args(container["args"])  # SystemExit on an unknown flag
    assert args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.port}
    for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in ("http", args.port)
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == args.port
    assert notes["prometheus.io/path"] == "/metrics"
    selector = docs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    (service_port,) = docs["Service"]["spec"]["ports"]
    assert service_port["targetPort"] in ("http", args.port)
    assert docs["Service"]["spec"]["selector"] == selector
    (endpoint,) = docs["ServiceMonitor"]["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"] and endpoint["path"] == "/metrics"
    assert docs["ServiceMonitor"]["spec"]["selector"]["matchLabels"].items() <= (
        docs["Service"]["metadata"]["labels"].items()
    )


def test_ray_job_runs_batch_infer_with_ray() -> None:
    job = load("jaxcb-ray-batch.yaml")["RayJob"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["python", "scripts/batch_infer.py"]
    spec = importlib.util.spec_from_file_location("batch_infer", ROOT / argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.build_parser().parse_args(argv[2:])
    assert args.ray and args.ray_address == "auto"
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    gpus = sum(
        int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) * group["replicas"]
        for group in workers
        for c in group["template"]["spec"]["containers"]
    )
    assert gpus >= args.num_replicas * args.ray_gpus_per_replica
