"""Issue 18, "the default server answers like the demo model was trained": `boundgen serve` with no
`--model`, the load generator and the command line as a new user meets them.

The documented commands themselves run in `test_docs.py`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from boundgen.demo import default_model_path

REPO = Path(__file__).resolve().parents[2]
QUERY = "best red sneakers by Astora"
RIGHT = "Astora Core sneakers, red, $999, Vienna"
WRONG = "Soldal Neo sneakers, red, $249, Rome"
OTHER = "Nimtra Max sofa, red, $1290, Madrid"


def boundgen(
    *args: str, blocked: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`boundgen ARGS` in a fresh interpreter; `blocked`: a module that cannot be imported there
    (as if its extra were not installed)."""
    prelude = f"import sys; sys.modules[{blocked!r}] = None; " if blocked else "import sys; "
    code = prelude + "from boundgen.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout
    )


def test_default_rerank_ranks_like_the_demo_was_trained(demo_http):
    body = {"query": QUERY, "documents": [WRONG, OTHER, RIGHT], "return_documents": True}
    results = demo_http.post("/v1/rerank", json=body).json()["results"]
    assert results[0]["document"]["text"] == RIGHT
    assert results[0]["relevance_score"] >= 0.9
    assert all(r["relevance_score"] <= 0.01 for r in results[1:])


def test_default_server_serves_the_demo_with_its_catalog_trie(demo_http):
    card = demo_http.get("/v1/models").json()["data"][0]
    assert card["tries"] == ["catalog"]
    assert (
        card["rerank_label_token_ids"]
        == json.loads((default_model_path() / "demo.json").read_text())["label_token_ids"]
    )


# -------------------------------------------------------------------------- boundgen loadtest


def loadtest(server, *args: str, blocked: str | None = None) -> subprocess.CompletedProcess:
    short = ("--qps", "2", "--duration", "2", "--warmup", "1", "--distinct", "2")
    return boundgen("loadtest", "--url", server.url, *short, *args, blocked=blocked)


def test_loadtest_defaults_fit_the_default_server(demo_server):
    run = loadtest(demo_server, "--workload", "score")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "errors 0" in run.stdout


def test_loadtest_prints_the_servers_error(demo_server):
    run = loadtest(demo_server, "--workload", "score", "--query-tokens", "300")
    # the server's own message (413: a query over the token limit, which the context caps)
    assert "query has 300 tokens; the limit is 256" in run.stdout + run.stderr


def test_loadtest_beam_defaults_fit_the_catalog_trie(demo_server):
    run = loadtest(demo_server, "--workload", "beam", "--trie", "catalog")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "errors 0" in run.stdout


def test_loadtest_plot_without_matplotlib_names_the_extra(demo_server, tmp_path):
    run = loadtest(
        demo_server,
        "--workload",
        "score",
        "--plot",
        str(tmp_path / "p.png"),
        blocked="matplotlib",
    )
    assert "pip install 'boundgen[bench]'" in run.stderr
    assert "Traceback" not in run.stderr


# --------------------------------------------------------------------------- the command line


def test_serve_without_fastapi_names_the_extra():
    run = boundgen("serve", "--port", "1", blocked="fastapi", timeout=120)
    assert run.returncode != 0
    assert "pip install 'boundgen[server]'" in run.stderr
    assert "Traceback" not in run.stderr


def test_beam_width_flag_is_named_as_everywhere_else():
    assert "--beam-width" in boundgen("beam", "--help").stdout


def test_unknown_flag_prints_the_commands_usage():
    run = boundgen("serve", "--bogus")
    assert run.returncode == 2
    assert run.stderr.startswith("usage: boundgen serve")
    assert "--bogus" in run.stderr


# -------------------------------------------------------------------------------- the docs


def test_docs_cite_only_files_in_the_repo():
    cited = [
        f"{path.name}: {m.group(0)}"
        for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
        for m in re.finditer(r"DESIGN(\.md| §)", path.read_text())
    ]
    assert not cited or (REPO / "DESIGN.md").exists(), cited


def test_deploy_doc_says_what_a_ray_section_does(tmp_path):
    from boundgen.server.config import load_settings, wants_ray

    config = tmp_path / "serve.yaml"
    config.write_text("ray:\n  replicas: 2\n")
    # the code: a `ray:` section turns Ray on (unless --no-ray)
    assert wants_ray(argparse.Namespace(ray=None), load_settings(str(config)))
    assert "ignores the `ray:`" not in " ".join((REPO / "docs" / "deploy.md").read_text().split())


def catalog_titles() -> list[set[str]]:
    items = json.loads((default_model_path() / "catalog.json").read_text())["items"]
    return [set(re.findall(r"[a-z0-9]+", item["title"].lower())) for item in items]


def test_demo_doc_example_query_matches_an_item():
    queries = re.findall(
        r'boundgen demo --query "([^"]+)"', (REPO / "docs" / "demo.md").read_text()
    )
    assert queries
    titles = catalog_titles()
    for query in queries:
        words = set(re.findall(r"[a-z0-9]+", query.lower()))
        assert any(words <= title for title in titles), query
