"""Ray Serve deployment (`boundgen.serve_ray`): config → deployment options anywhere; with Ray
installed, a local Ray with 2 CPU replicas of the tiny model behind Serve's HTTP proxy, concurrent
requests, the same answers as the single-process server, both replicas used, per-replica health and
metrics.

The live part needs `pip install 'boundgen[ray]'` (skipped without it) and takes ~30-60 s on 2
cores.
"""

from __future__ import annotations

import argparse
import builtins
import concurrent.futures as cf
import re
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")

from boundgen.config import EngineConfig
from boundgen.serve_ray import (
    REPLICA_HEADER,
    RayNotInstalled,
    builder_settings,
    deployment_options,
    replica_engine_config,
    require_ray,
)
from boundgen.server.config import (
    RAY_INSTALL_HINT,
    RayServeConfig,
    ServerConfig,
    add_serve_flags,
    load_settings,
    settings_from_args,
    wants_ray,
)

# ---------------------------------------------------------------------------------- without Ray


def test_fixed_replicas_one_gpu_each_on_cuda_none_on_cpu():
    opts = deployment_options(
        ServerConfig(max_queue=512, drain_timeout_s=20),
        EngineConfig(device="cuda:1"),
        RayServeConfig(replicas=4),
    )
    assert opts["num_replicas"] == 4 and "autoscaling_config" not in opts
    assert opts["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1}
    assert opts["max_ongoing_requests"] == 512  # the app's own admission limit, not Serve's default
    assert opts["graceful_shutdown_timeout_s"] == 20
    assert opts["logging_config"] == {"enable_access_log": False, "log_level": "INFO"}
    cpu = deployment_options(ServerConfig(), EngineConfig(device="cpu"), RayServeConfig(replicas=2))
    assert cpu["ray_actor_options"]["num_gpus"] == 0
    # Inside a replica Ray shows only its own GPU.
    assert replica_engine_config(EngineConfig(device="cuda:3"), 1).device == "cuda"
    assert replica_engine_config(EngineConfig(device="cuda:1"), 0.5).device == "cuda"
    assert replica_engine_config(EngineConfig(device="cpu"), 0).device == "cpu"


def test_autoscaling_target_ongoing_requests():
    cfg = RayServeConfig(
        replicas=2,
        min_replicas=1,
        max_replicas=8,
        target_ongoing_requests=48,
        downscale_delay_s=120,
    )
    opts = deployment_options(ServerConfig(), EngineConfig(device="cuda"), cfg)
    assert "num_replicas" not in opts
    assert opts["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 8,
        "initial_replicas": 2,
        "target_ongoing_requests": 48,
        "downscale_delay_s": 120,
    }
    with pytest.raises(ValueError, match="min_replicas=5 > max_replicas=2"):
        RayServeConfig(min_replicas=5, max_replicas=2).validate()
    with pytest.raises(ValueError, match="min_replicas needs max_replicas"):
        RayServeConfig(min_replicas=2).validate()
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        RayServeConfig(replicas=0).validate()


def test_one_config_file_for_server_engine_and_ray(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(
        "model: /models/m\nport: 9000\nmax_queue: 300\n"
        "engine: {device: cuda, dtype: bfloat16}\n"
        "ray: {min_replicas: 2, max_replicas: 16, target_ongoing_requests: 24}\n"
    )
    settings = load_settings(path)
    server, engine, ray_cfg = settings.server, settings.engine, settings.ray
    assert (server.model, server.port, server.max_queue) == ("/models/m", 9000, 300)
    assert (engine.device, engine.dtype) == ("cuda", "bfloat16")
    assert ray_cfg == RayServeConfig(min_replicas=2, max_replicas=16, target_ongoing_requests=24)
    assert settings.ray_section
    bad = tmp_path / "bad.yaml"
    bad.write_text("ray: {replica: 2}\n")
    with pytest.raises(ValueError, match="unknown keys \\['replica'\\]"):
        load_settings(bad)


def test_kuberay_manifest_args_build_the_same_configs():
    import yaml

    root = Path(__file__).resolve().parents[1]
    docs = list(yaml.safe_load_all((root / "deploy" / "kuberay-rayservice.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "RayService")
    serve_cfg = yaml.safe_load(service["spec"]["serveConfigV2"])
    app = serve_cfg["applications"][0]
    assert app["import_path"] == "boundgen.serve_ray:app_builder"
    settings = builder_settings(app["args"])
    server, engine, ray_cfg = settings.server, settings.engine, settings.ray
    assert server.model and engine.device == "cuda" and ray_cfg.autoscaling
    opts = deployment_options(server, engine, ray_cfg)
    assert opts["ray_actor_options"]["num_gpus"] == 1
    auto = opts["autoscaling_config"]
    max_gpus = sum(
        int(g["maxReplicas"])
        * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    )
    assert auto["min_replicas"] <= auto["max_replicas"] <= max_gpus


def test_flags_and_when_ray_is_used(tmp_path):
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)

    def ray(*argv: str) -> bool:
        args = parser.parse_args(argv)
        return wants_ray(args, settings_from_args(args))

    args = parser.parse_args(["--replicas", "3", "--max-replicas", "5"])
    assert settings_from_args(args).ray == RayServeConfig(replicas=3, max_replicas=5)
    assert ray("--replicas", "3") and not ray()
    assert ray("--ray")
    assert not ray("--replicas", "2", "--no-ray")
    path = tmp_path / "c.toml"
    path.write_text("port = 8001\n[ray]\nreplicas = 2\n")
    assert ray("--config", str(path))
    path.write_text("port = 8001\ntarget_ongoing_requests = 16\n")  # a ray key, no ray section
    assert not ray("--config", str(path))


def test_without_ray_the_error_says_how_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError("No module named 'ray'", name="ray")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(RayNotInstalled, match=re.escape(RAY_INSTALL_HINT)):
        require_ray()
    assert issubclass(RayNotInstalled, RuntimeError)  # the CLI prints it as one line
    from boundgen.serve_ray import build_app

    with pytest.raises(RayNotInstalled, match=re.escape(RAY_INSTALL_HINT)):
        build_app("/nonexistent")


# ---------------------------------------------------------------------------------- live, with Ray

N_CONCURRENT = 32


def _requests(vocab: int) -> list[tuple[str, dict]]:
    out = []
    for i in range(N_CONCURRENT):
        q = [(7 * i + k) % (vocab - 1) + 1 for k in range(5 + i % 4)]
        items = [
            [(3 * i + 11 * j + k) % (vocab - 1) + 1 for k in range(2 + j % 3)] for j in range(3)
        ]
        kind = i % 4
        if kind == 0:
            out.append(
                (
                    "/v1/score",
                    {
                        "query": q,
                        "items": items,
                        "label_token_ids": [1, 2, 3],
                        "apply_softmax": bool(i % 8),
                    },
                )
            )
        elif kind == 1:
            out.append(("/v1/beam", {"prompt": q, "beam_width": 4, "steps": 3}))
        elif kind == 2:
            out.append(("/v1/embeddings", {"input": items}))
        else:
            out.append(
                (
                    "/v1/score",
                    {
                        "query": f"user {i} likes",
                        "items": [" shoes", " hats"],
                        "label_token_ids": [1, 2],
                    },
                )
            )
    return out


def _close(a, b, tol=1e-4) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a if k != "id")
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= tol * max(1.0, abs(a), abs(b))
    return a == b


def _spray(url: str, reqs: list[tuple[str, dict]], timeout_s: float = 60.0):
    """Send `reqs` concurrently (16 at a time) until two replicas have answered; the proxy picks
    replicas by load, so one concurrent round nearly always reaches both."""

    def send(req):
        path, body = req
        r = httpx.post(url + path, json=body, timeout=60)
        return r.status_code, r.headers.get(REPLICA_HEADER), r.json()

    seen: set = set()
    deadline = time.monotonic() + timeout_s
    while True:
        with cf.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(send, reqs))
        seen |= {rid for _, rid, _ in results}
        if len(seen) >= 2 or time.monotonic() > deadline:
            return results, seen


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory):
    pytest.importorskip("ray.serve", reason=f"Ray Serve not installed ({RAY_INSTALL_HINT})")
    import ray

    from boundgen.serve_ray import shutdown, start
    from boundgen.server.testing import free_port, tiny_model_dir

    model = tiny_model_dir(tmp_path_factory.mktemp("ray"))
    server = ServerConfig(host="127.0.0.1", port=free_port(), drain_timeout_s=5)
    engine = EngineConfig(device="cpu", dtype="float32")
    metrics_base = free_port()
    ray_cfg = RayServeConfig(
        replicas=2, num_cpus=0.5, replica_metrics_port=metrics_base, health_check_period_s=2.0
    )
    try:
        # Lean: 2 logical CPUs, the smallest object store, no dashboard, replica logs not forwarded.
        ray.init(
            num_cpus=2,
            object_store_memory=80 * 2**20,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        url = start(model, server, engine, ray_cfg, timeout_s=150)
        yield {
            "url": url,
            "model": model,
            "server": server,
            "engine": engine,
            "metrics_base": metrics_base,
        }
    finally:
        shutdown()


@pytest.mark.slow
def test_two_replicas_same_answers_as_single_process_server(ray_server):
    from fastapi.testclient import TestClient

    from boundgen.engine import Engine
    from boundgen.server.app import create_app

    url = ray_server["url"]
    vocab = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["vocab_size"]
    reqs = _requests(vocab)

    results, seen = _spray(url, reqs)
    assert all(status == 200 for status, _, _ in results), [r for r in results if r[0] != 200][:2]
    assert None not in seen and len(seen) == 2, f"replicas that answered: {seen}"

    engine = Engine.from_pretrained(
        ray_server["model"], device="cpu", dtype="float32", config=ray_server["engine"]
    )
    with TestClient(create_app(engine, ray_server["server"])) as local:
        for (path, body), (_, _rid, got) in zip(reqs, results):
            want = local.post(path, json=body)
            assert want.status_code == 200, want.text
            assert REPLICA_HEADER not in want.headers  # only the Ray replicas add it
            assert _close(want.json(), got), (path, body, want.json(), got)
        # Errors are the server's own JSON, through the proxy too.
        bad = {"query": [1], "items": [[2]], "label_token_ids": []}
        r = httpx.post(url + "/v1/score", json=bad, timeout=30)
        assert r.status_code == local.post("/v1/score", json=bad).status_code == 400
        assert r.json()["type"] == "BadRequestError"  # SGLang's flat error body


@pytest.mark.slow
def test_health_and_metrics_per_replica(ray_server):
    from ray import serve

    url = ray_server["url"]
    vocab = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["vocab_size"]
    _, seen = _spray(url, [r for r in _requests(vocab) if r[0] == "/v1/score"])
    assert len(seen) == 2, seen
    r = httpx.get(url + "/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"} and r.headers.get(REPLICA_HEADER)
    # the replica's Server-Timing comes through the proxy (client latency minus `app` = the proxy
    # hop)
    r = httpx.post(
        url + "/v1/score", json={"query": [1], "items": [[2]], "label_token_ids": [3]}, timeout=30
    )
    assert (
        r.headers["server-timing"].startswith("app;dur=")
        and "forward;dur=" in r.headers["server-timing"]
    )
    status = serve.status().applications["boundgen"]
    assert str(status.status).endswith("RUNNING")
    dep = status.deployments["boundgen"]
    assert str(dep.status).endswith("HEALTHY")
    assert {str(k).split(".")[-1]: v for k, v in dep.replica_states.items()} == {"RUNNING": 2}

    # Each replica serves its own registry on its own port (first free from the base).
    per_replica = {}
    base = ray_server["metrics_base"]
    for port in range(base, base + 8):
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        m = re.search(r'boundgen_replica_info\{[^}]*replica_id="([^"]+)"', text)
        if m:
            ok = sum(
                float(v)
                for v in re.findall(
                    r'boundgen_requests_total\{endpoint="(?:score|beam|embeddings)",status="200"\} '
                    r"(\S+)",
                    text,
                )
            )
            per_replica[m.group(1)] = ok
    assert len(per_replica) == 2, per_replica
    # Both replicas answered score requests above, and each counted its own.
    assert all(n > 0 for n in per_replica.values()), per_replica
    # Through the proxy, /metrics answers from one replica, which names itself.
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] in per_replica
    assert "boundgen_request_seconds_bucket" in r.text
