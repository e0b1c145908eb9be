"""The Kubernetes manifests in deploy/kubernetes/ (docs/deploy.md), checked against the code.

Every YAML document parses and names its kind; every container that runs `jaxserve serve` is
parsed by jaxserve's own CLI parser and EngineConfig (Kubernetes' `$(VAR)` references replaced
by placeholders first), so a renamed or misspelled flag fails here rather than in a pod; the
probes, container port, `--port` and Service ports agree. No model, no cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import pathlib
import re

import pytest
import yaml

from jaxserve.cli import _engine_kwargs, _with_model, build_parser
from jaxserve.config import EngineConfig

REPO = pathlib.Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
# Values for the `$(VAR)` references the manifests use: what LeaderWorkerSet sets in each pod.
PLACEHOLDERS = {"LWS_LEADER_ADDRESS": "jaxserve-tp-0.jaxserve-tp", "LWS_GROUP_SIZE": "2",
                "LWS_WORKER_INDEX": "1"}


def documents() -> list[tuple[str, dict]]:
    docs = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def pod_specs(node):
    """Every pod spec (a mapping with `containers`) anywhere under `node`."""
    if isinstance(node, dict):
        if isinstance(node.get("containers"), list):
            yield node
        for value in node.values():
            yield from pod_specs(value)
    elif isinstance(node, list):
        for value in node:
            yield from pod_specs(value)


def serve_containers() -> list[tuple[str, dict, dict]]:
    """(file, pod spec, container) for every container whose command runs `jaxserve serve`
    (the image's ENTRYPOINT is jaxserve, so args alone count too)."""
    found = []
    for name, doc in documents():
        for spec in pod_specs(doc):
            for c in spec["containers"]:
                argv = c.get("command", ["jaxserve"]) + c.get("args", [])
                if argv[:2] == ["jaxserve", "serve"]:
                    found.append((name, spec, c))
    return found


def substitute(arg: str) -> str:
    def one(m):
        assert m.group(1) in PLACEHOLDERS, f"no placeholder for $({m.group(1)}) in {arg!r}"
        return PLACEHOLDERS[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, str(arg))


def serve_parser() -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["serve"]


def parse_serve(argv: list[str]):
    """The namespace `jaxserve serve` would get, or a failure with argparse's message. Flags
    must be spelled out: argparse would take a prefix (`--num-process`) as the flag it starts."""
    exact = serve_parser()._option_string_actions
    for a in argv:
        flag = str(a).split("=")[0]
        if flag.startswith("--"):
            assert flag in exact, f"jaxserve serve has no flag {flag} (in {argv})"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args([substitute(a) for a in argv])
    except SystemExit:
        pytest.fail(f"jaxserve refuses {argv}: {err.getvalue().strip()}")
    return _with_model(args)


def container_port(container: dict, port) -> int:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    assert port in named, f"port {port!r} is not a named port of container {container['name']}"
    return named[port]


def test_every_document_parses_and_names_itself():
    docs = documents()
    assert {n for n, _ in docs} == {p.name for p in MANIFESTS} and len(MANIFESTS) >= 3
    for name, doc in docs:
        assert isinstance(doc, dict), name
        for key in ("apiVersion", "kind"):
            assert isinstance(doc.get(key), str) and doc[key], f"{name}: no {key}"
        assert doc.get("metadata", {}).get("name"), f"{name}: {doc['kind']} has no metadata.name"


def test_serve_commands_parse_with_jaxserves_own_cli():
    containers = serve_containers()
    assert len(containers) == 3  # the Deployment, the LWS leader and worker
    for name, _, c in containers:
        argv = c.get("command", ["jaxserve"])[1:] + c["args"]
        args = parse_serve(argv)
        assert args.func is not None and args.command == "serve", name
        EngineConfig(**_engine_kwargs(args))  # the values pass the engine's own validation


def test_ports_and_probes_agree_with_the_server():
    for name, spec, c in serve_containers():
        args = parse_serve(c.get("command", ["jaxserve"])[1:] + c["args"])
        if args.process_id not in (None, 0):
            assert "readinessProbe" not in c, f"{name}: a worker serves no HTTP to probe"
            continue
        assert args.host == "0.0.0.0", f"{name}: the server must listen beyond the pod"
        ports = {p["containerPort"] for p in c["ports"]}
        assert args.port in ports, f"{name}: --port {args.port} is not a container port"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert get["path"] == "/health", f"{name}: {probe} path {get['path']}"
            assert container_port(c, get["port"]) == args.port, f"{name}: {probe} port"
        # The grace period covers the preStop sleep and the server's drain (60 s).
        sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert spec["terminationGracePeriodSeconds"] >= sleep + 60, name


def test_services_route_to_the_serving_port():
    served = {}  # pod label set -> the serving container
    for name, doc in documents():
        for tmpl in _templates(doc):
            for c in tmpl["spec"]["containers"]:
                if c in [x for _, _, x in serve_containers()] and c.get("readinessProbe"):
                    served[name] = (tmpl["metadata"].get("labels", {}), c)
    services = [(n, d) for n, d in documents() if d["kind"] == "Service"]
    assert services
    for name, svc in services:
        labels, c = served[name]
        selector = {k: v for k, v in svc["spec"]["selector"].items()
                    if not k.startswith("leaderworkerset.sigs.k8s.io/")}  # set by LWS
        assert selector.items() <= labels.items(), f"{name}: the Service selects no server pod"
        args = parse_serve(c.get("command", ["jaxserve"])[1:] + c["args"])
        for port in svc["spec"]["ports"]:
            assert container_port(c, port["targetPort"]) == args.port, name


def _templates(doc: dict):
    """Pod templates (with metadata) of a Deployment or a LeaderWorkerSet."""
    spec = doc.get("spec", {})
    if "template" in spec:
        yield spec["template"]
    lwt = spec.get("leaderWorkerTemplate", {})
    for key in ("leaderTemplate", "workerTemplate"):
        if key in lwt:
            yield {"metadata": lwt[key].get("metadata", {}), "spec": lwt[key]["spec"]}


def test_inference_pool_selects_the_deployment_on_its_port():
    pools = [d for _, d in documents() if d["kind"] == "InferencePool"]
    assert len(pools) == 1
    pool = pools[0]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    deployment = next(d for _, d in documents() if d["kind"] == "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    args = parse_serve(c.get("command", ["jaxserve"])[1:] + c["args"])
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [args.port]
    assert pool["spec"]["endpointPickerRef"]["name"] and \
        pool["spec"]["endpointPickerRef"]["port"]["number"]


def serve_knows(flag: str) -> bool:
    return flag in serve_parser()._option_string_actions


def test_serve_knows_its_flags_and_not_others():
    assert serve_knows("--port") and serve_knows("--coordinator-address")
    assert not serve_knows("--no-such-flag") and not serve_knows("--num-process")
