"""Pushing a memory folder to the Hub, through the real `huggingface_hub` client and a loopback server.

The server speaks the part of the Hub's HTTP API that `HfApi.create_repo` + `create_commit` use:
repo creation, README metadata validation, preupload (which files go through LFS), the LFS batch
API with a basic-transfer PUT, and the ndjson commit. It decides upload modes like the Hub's
default .gitattributes (safetensors through LFS, JSON and Markdown inline) and stores what each
commit makes of the repository, so the tests compare received bytes with the files on disk.
The Xet transfer path is switched off here (it needs Hugging Face's storage service); the
client falls back to the LFS protocol, which the Hub still serves.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import transformers.utils.hub
import yaml
from huggingface_hub import ModelCard, constants
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from transformers import AutoTokenizer

from titans_hf.commands import main as cli_main
from titans_hf.hub import push_memory_folder, render_memory_card
from titans_hf.modeling.configuration_titans_qwen import TitansMemoryConfig

MEMORY_CONFIG = TitansMemoryConfig(
    chunk_size=64, memory_layers=[1], memory_num_heads=2, memory_head_dim=8, memory_depth=2, memory_chunk_size=16,
    update_rule="gradient",
    base_model_name_or_path="Qwen/Qwen3-0.6B",
    base_shape={"hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 512, "model_type": "qwen3"},
)
RESULTS = {
    "accuracy": {
        "qa1": {"32k": {"memory": 0.9, "no_memory": 0.35}, "1k": {"memory": 1.0, "no_memory": 0.5}},
        "qa2": {"32k": {"memory": 0.25, "no_memory": 0.3}},
    }
}
REPO_ID = "someone/qwen3-titans-memory"
HUB_FILES = {"memory_model.safetensors", "memory_config.json", "config.json", "README.md"}


class HubStub:
    """What the loopback Hub has seen and holds."""

    def __init__(self, token: str):
        self.token = token
        self.endpoint = ""
        self.requests: list[tuple[str, str]] = []
        self.unknown_requests: list[tuple[str, str]] = []
        self.authorizations: list[str | None] = []
        self.repos: dict[str, dict] = {}
        self.files: dict[str, dict[str, bytes]] = {}
        self.commits: list[dict] = []
        self.heads: dict[str, str] = {}
        self.lfs_storage: dict[str, bytes] = {}


def _make_handler(hub: HubStub) -> type[BaseHTTPRequestHandler]:
    repo_route = r"/api/models/(?P<repo>[^/]+/[^/]+|[^/]+)"
    model_route = repo_route + r"/(?P<action>preupload|commit)/(?P<revision>[^/?]+)"
    tree_route = repo_route + r"/tree/(?P<revision>[^/]+)(?:/(?P<path>.*))?"
    resolve_route = r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<path>.+)"

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # the tests read `hub.requests` instead of a stderr log
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                body = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    if size == 0:
                        self.rfile.readline()
                        return body
                    body += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def _reply(self, status: int, payload: dict | list | None = None, error_code: str | None = None) -> None:
            data = json.dumps(payload if payload is not None else {}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if error_code:
                self.send_header("X-Error-Code", error_code)
            self.end_headers()
            if self.command != "HEAD":  # a HEAD reply has headers only
                self.wfile.write(data)

        def _authorized(self) -> bool:
            hub.authorizations.append(self.headers.get("Authorization"))
            if self.headers.get("Authorization") != f"Bearer {hub.token}":
                self._reply(401, {"error": "Invalid credentials"})
                return False
            return True

        def do_PUT(self):
            body = self._body()
            hub.requests.append(("PUT", self.path))
            storage = re.fullmatch(r"/lfs-storage/(?P<oid>[0-9a-f]{64})", self.path)
            if storage is None:
                hub.unknown_requests.append(("PUT", self.path))
                return self._reply(404, {"error": "unknown route"})
            if hashlib.sha256(body).hexdigest() != storage["oid"]:
                return self._reply(400, {"error": "content does not match its sha256"})
            hub.lfs_storage[storage["oid"]] = body
            self._reply(200)

        def do_POST(self):
            body = self._body()
            path = self.path.split("?")[0]
            hub.requests.append(("POST", path))
            if path == "/api/repos/create":
                return self._create_repo(json.loads(body))
            if path == "/api/validate-yaml":
                return self._validate_yaml(json.loads(body))
            batch = re.fullmatch(r"/(?P<repo>.+)\.git/info/lfs/objects/batch", path)
            if batch is not None:
                return self._lfs_batch(batch["repo"], json.loads(body))
            route = re.fullmatch(model_route, path)
            if route is not None and route["action"] == "preupload":
                return self._preupload(route["repo"], json.loads(body))
            if route is not None and route["action"] == "commit":
                return self._commit(route["repo"], route["revision"], body)
            hub.unknown_requests.append(("POST", path))
            self._reply(404, {"error": "unknown route"})

        def do_GET(self):
            path = self.path.split("?")[0]
            if path == "/api/agent-harnesses":  # the client's once-a-day registry fetch, not part of any upload
                return self._reply(200, {"standardEnvVars": [], "harnesses": {}})
            hub.requests.append(("GET", self.path))
            resolve = re.fullmatch(resolve_route, path)
            if resolve is not None:
                return self._resolve(resolve["repo"], resolve["revision"], resolve["path"], send_body=True)
            tree = re.fullmatch(tree_route, path)
            if tree is not None:
                return self._tree(tree["repo"], tree["revision"], tree["path"] or "")
            info = re.fullmatch(repo_route + r"(?:/revision/(?P<revision>[^/]+))?", path)
            if info is not None:
                # create_repo(exist_ok=True) asks for the repo's info after a 401: that asks for a token too
                if info["repo"] not in hub.repos and not self._authorized():
                    return
                return self._model_info(info["repo"], info["revision"] or "main")
            hub.unknown_requests.append(("GET", self.path))
            self._reply(404, {"error": "unknown route"})

        def do_HEAD(self):
            hub.requests.append(("HEAD", self.path))
            resolve = re.fullmatch(resolve_route, self.path.split("?")[0])
            if resolve is None:
                hub.unknown_requests.append(("HEAD", self.path))
                return self._reply(404, {"error": "unknown route"})
            self._resolve(resolve["repo"], resolve["revision"], resolve["path"], send_body=False)

        def _missing(self, repo_id: str, revision: str, path: str | None = None) -> bool:
            """Reply the Hub's error for an unknown repository, revision or file; False when all exist."""
            if repo_id not in hub.repos:
                self._reply(404, {"error": "Repository not found"}, error_code="RepoNotFound")
            elif revision not in ("main", hub.heads.get(repo_id)):
                self._reply(404, {"error": "Invalid rev id"}, error_code="RevisionNotFound")
            elif path is not None and path not in hub.files[repo_id]:
                self._reply(404, {"error": "Entry not found"}, error_code="EntryNotFound")
            else:
                return False
            return True

        def _resolve(self, repo_id: str, revision: str, path: str, send_body: bool) -> None:
            if self._missing(repo_id, revision, path):
                return
            content = hub.files[repo_id][path]
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(content)))
            self.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
            self.send_header("X-Repo-Commit", hub.heads[repo_id])
            self.end_headers()
            if send_body:
                self.wfile.write(content)

        def _tree(self, repo_id: str, revision: str, folder: str) -> None:
            if self._missing(repo_id, revision):
                return
            prefix = folder.rstrip("/") + "/" if folder else ""
            entries = [{"type": "file", "path": name, "size": len(content), "oid": hashlib.sha1(content).hexdigest()}
                       for name, content in sorted(hub.files[repo_id].items()) if name.startswith(prefix)]
            if folder and not entries:
                return self._reply(404, {"error": "Entry not found"}, error_code="EntryNotFound")
            self._reply(200, entries)

        def _model_info(self, repo_id: str, revision: str) -> None:
            if self._missing(repo_id, revision):
                return
            self._reply(200, {"id": repo_id, "modelId": repo_id, "sha": hub.heads.get(repo_id), "private": False,
                              "siblings": [{"rfilename": name} for name in sorted(hub.files[repo_id])]})

        def _create_repo(self, payload: dict) -> None:
            if not self._authorized():
                return
            repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
            url = f"{hub.endpoint}/{repo_id}"
            if repo_id in hub.repos:
                return self._reply(409, {"error": "You already created this model repo", "url": url})
            hub.repos[repo_id] = {"visibility": payload.get("visibility"), "type": payload.get("type")}
            hub.files[repo_id] = {}
            self._reply(200, {"url": url})

        def _validate_yaml(self, payload: dict) -> None:
            if not self._authorized():
                return
            match = re.match(r"---\n(.*?)\n---\n", payload["content"], re.DOTALL)
            if match is None or not isinstance(yaml.safe_load(match[1]), dict):
                return self._reply(400, {"errors": [{"message": "README.md has no YAML metadata header"}]})
            self._reply(200, {"errors": [], "warnings": []})

        def _preupload(self, repo_id: str, payload: dict) -> None:
            if not self._authorized():
                return
            if repo_id not in hub.repos:
                return self._reply(404, {"error": "Repository not found"}, error_code="RepoNotFound")
            files = [
                {
                    "path": entry["path"],
                    "uploadMode": "lfs" if entry["path"].endswith(".safetensors") else "regular",
                    "shouldIgnore": False,
                    "oid": None,
                }
                for entry in payload["files"]
            ]
            self._reply(200, {"files": files})

        def _lfs_batch(self, repo_id: str, payload: dict) -> None:
            if not self._authorized():
                return
            assert payload["operation"] == "upload" and "basic" in payload["transfers"]
            objects = [
                {
                    "oid": item["oid"],
                    "size": item["size"],
                    "authenticated": True,
                    "actions": {"upload": {"href": f"{hub.endpoint}/lfs-storage/{item['oid']}"}},
                }
                for item in payload["objects"]
            ]
            self._reply(200, {"transfer": "basic", "objects": objects})

        def _commit(self, repo_id: str, revision: str, body: bytes) -> None:
            if not self._authorized():
                return
            if repo_id not in hub.repos:
                return self._reply(404, {"error": "Repository not found"}, error_code="RepoNotFound")
            lines = [json.loads(line) for line in body.decode().splitlines() if line]
            header, operations = lines[0], lines[1:]
            assert header["key"] == "header"
            received: dict[str, bytes] = {}
            kinds: dict[str, str] = {}
            for operation in operations:
                value = operation["value"]
                if operation["key"] == "file":
                    received[value["path"]] = base64.b64decode(value["content"])
                elif operation["key"] == "lfsFile":
                    content = hub.lfs_storage.get(value["oid"])
                    if content is None or len(content) != value["size"]:
                        return self._reply(400, {"error": f"LFS object of {value['path']} was never uploaded"})
                    received[value["path"]] = content
                else:
                    return self._reply(400, {"error": f"unsupported commit operation {operation['key']}"})
                kinds[value["path"]] = operation["key"]
            hub.files[repo_id].update(received)
            commit_oid = hashlib.sha1(body).hexdigest()
            hub.heads[repo_id] = commit_oid
            hub.commits.append({"repo_id": repo_id, "revision": revision, "summary": header["value"]["summary"],
                                "files": received, "kinds": kinds})
            self._reply(200, {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{commit_oid}", "commitOid": commit_oid})

    return Handler


@pytest.fixture
def hub_token() -> str:
    return "hf_" + secrets.token_hex(16)


@pytest.fixture
def hub(monkeypatch, hub_token):
    """A loopback Hub; the client is let online for it and uses the LFS protocol instead of Xet."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    stub = HubStub(hub_token)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(stub))
    stub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    # in-process clients (HfApi without endpoint=, downloads) reach the stub too
    monkeypatch.setattr(constants, "ENDPOINT", stub.endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        stub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    # the Trainer's pushes go through one HfApi that transformers makes once, with the endpoint of that moment
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", None)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield stub
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def memory_folder(tmp_path) -> Path:
    """A memory folder of MEMORY_CONFIG (the weights of a model built from it, on a base of its shape), plus what a
    training output folder also holds and must stay local."""
    folder = tmp_path / "memory"
    memory_model(MEMORY_CONFIG).save_pretrained(folder)
    assert MEMORY_CONFIG == TitansMemoryConfig.from_pretrained(folder)
    (folder / "README.md").write_text("---\nlibrary_name: transformers\n---\nA stale generic card.\n")
    (folder / "training_args.json").write_text("{}")
    (folder / "checkpoint-8").mkdir()
    (folder / "checkpoint-8" / "optimizer.pt").write_bytes(b"\x00" * 32)
    return folder


def memory_model(config: TitansMemoryConfig):
    """A TitansQwen of `config` on a random base of the config's base shape (nothing is loaded)."""
    import torch
    from transformers import Qwen3Config

    from titans_hf.modeling import TitansQwenConfig, TitansQwenForCausalLM

    shape = config.base_shape
    text = Qwen3Config(hidden_size=shape["hidden_size"], num_hidden_layers=shape["num_hidden_layers"],
                       vocab_size=shape["vocab_size"], num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=64)
    torch.manual_seed(0)
    return TitansQwenForCausalLM(TitansQwenConfig(text_config=text, memory_config=config))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_push_uploads_exactly_the_memory_files_and_the_rendered_card(hub, hub_token, memory_folder):
    before = _snapshot(memory_folder)
    commit_url = push_memory_folder(memory_folder, REPO_ID, token=hub_token, endpoint=hub.endpoint,
                                    private=True, results=RESULTS)

    assert hub.unknown_requests == []
    assert hub.repos == {REPO_ID: {"visibility": "private", "type": None}}
    assert len(hub.commits) == 1
    commit = hub.commits[0]
    assert commit_url.startswith(f"{hub.endpoint}/{REPO_ID}/commit/") and commit["revision"] == "main"
    assert set(commit["files"]) == HUB_FILES
    assert commit["files"]["memory_model.safetensors"] == before["memory_model.safetensors"]
    assert commit["files"]["memory_config.json"] == before["memory_config.json"]
    assert commit["files"]["README.md"].decode() == render_memory_card(MEMORY_CONFIG, RESULTS, repo_id=REPO_ID)
    # The weights travelled through LFS (as on the Hub), the small text files inline.
    assert commit["kinds"] == {"memory_model.safetensors": "lfsFile", "memory_config.json": "file",
                               "config.json": "file", "README.md": "file"}
    # the Auto classes' config.json: the model type, the base's config, the same memory settings
    pushed_config = json.loads(commit["files"]["config.json"])
    assert pushed_config["model_type"] == "titans_qwen" and pushed_config["memory_config"] == MEMORY_CONFIG.to_dict()
    assert list(hub.lfs_storage.values()) == [before["memory_model.safetensors"]]
    assert hub.authorizations and set(hub.authorizations) == {f"Bearer {hub_token}"}
    assert _snapshot(memory_folder) == before


def test_push_to_an_existing_repository_adds_a_commit(hub, hub_token, memory_folder):
    first = push_memory_folder(memory_folder, REPO_ID, token=hub_token, endpoint=hub.endpoint)
    second = push_memory_folder(memory_folder, REPO_ID, token=hub_token, endpoint=hub.endpoint,
                                results=RESULTS, commit_message="Add evaluation")

    assert first != second
    assert [commit["summary"] for commit in hub.commits][1] == "Add evaluation"
    assert hub.repos[REPO_ID]["visibility"] == "public"
    assert "Not evaluated yet." in hub.commits[0]["files"]["README.md"].decode()
    assert hub.files[REPO_ID]["README.md"].decode() == render_memory_card(MEMORY_CONFIG, RESULTS, repo_id=REPO_ID)
    assert hub.unknown_requests == []


@pytest.mark.parametrize("missing", ["memory_model.safetensors", "memory_config.json"])
def test_push_names_the_missing_file(hub, hub_token, memory_folder, missing):
    (memory_folder / missing).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(memory_folder / missing))):
        push_memory_folder(memory_folder, REPO_ID, token=hub_token, endpoint=hub.endpoint)
    assert hub.requests == []


def test_push_refuses_a_config_the_card_cannot_describe(hub, hub_token, memory_folder):
    config = json.loads((memory_folder / "memory_config.json").read_text())
    (memory_folder / "memory_config.json").write_text(json.dumps({**config, "memory_depth": "two"}))
    with pytest.raises(ValueError, match=r"memory_config\.json: memory_depth='two' must be an integer >= 1"):
        push_memory_folder(memory_folder, REPO_ID, token=hub_token, endpoint=hub.endpoint)
    (memory_folder / "memory_config.json").write_text(json.dumps({**config, "load_kwargs": {"trust_remote_code": True}}))
    with pytest.raises(ValueError, match=r"memory_config\.json: unknown memory setting\(s\) \['load_kwargs'\]"):
        push_memory_folder(memory_folder, REPO_ID, token=hub_token, endpoint=hub.endpoint)
    (memory_folder / "memory_config.json").write_text(json.dumps(config))
    (memory_folder / "memory_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"memory_model\.safetensors: not a readable safetensors file"):
        push_memory_folder(memory_folder, REPO_ID, token=hub_token, endpoint=hub.endpoint)
    assert hub.requests == []


def test_push_without_a_token_says_how_to_provide_one(hub, memory_folder, monkeypatch, tmp_path):
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no_token_here"))
    with pytest.raises(ValueError, match="no Hugging Face token; set HF_TOKEN or run `hf auth login`"):
        push_memory_folder(memory_folder, REPO_ID, endpoint=hub.endpoint)
    assert hub.requests == []


def test_push_in_offline_mode_fails_before_any_request(hub, hub_token, memory_folder, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OfflineModeIsEnabled, match=r"offline mode is on \(HF_HUB_OFFLINE=1\)"):
        push_memory_folder(memory_folder, REPO_ID, token=hub_token, endpoint=hub.endpoint)
    assert hub.requests == []


def test_cli_push_with_hf_hub_offline_set_fails_clearly(hub, hub_token, memory_folder):
    """The environment variable itself, read by a fresh process, as a user would set it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_TOKEN": hub_token}
    completed = subprocess.run(
        [sys.executable, "-m", "titans_hf.commands", "push", str(memory_folder), REPO_ID, "--endpoint", hub.endpoint],
        env=env, capture_output=True, text=True, check=False,
    )
    assert completed.returncode != 0
    assert f"Cannot push {memory_folder} to {REPO_ID}: offline mode is on (HF_HUB_OFFLINE=1)" in completed.stderr
    assert hub_token not in completed.stdout + completed.stderr
    assert hub.requests == []


def test_cli_push_reads_the_token_from_the_environment_and_never_prints_it(
    hub, hub_token, memory_folder, tmp_path, monkeypatch, capfd, caplog
):
    results_path = tmp_path / "results.json"
    results_path.write_text(json.dumps(RESULTS))
    monkeypatch.setenv("HF_TOKEN", hub_token)
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="huggingface_hub")

    exit_code = cli_main(["push", str(memory_folder), REPO_ID, "--endpoint", hub.endpoint, "--private",
                          "--results", str(results_path)])

    out, err = capfd.readouterr()
    assert exit_code == 0
    assert out.strip().startswith(f"{hub.endpoint}/{REPO_ID}/commit/")
    assert set(hub.authorizations) == {f"Bearer {hub_token}"}
    assert hub.repos[REPO_ID]["visibility"] == "private"
    assert "| qa1 | 32k | 0.900 | 0.350 | +0.550 |" in hub.files[REPO_ID]["README.md"].decode()
    # The client did log every request at debug level, and none of it holds the token.
    assert any("/api/repos/create" in record.getMessage() for record in caplog.records)
    assert hub_token not in out + err + caplog.text


def test_a_rejected_token_is_not_echoed_in_the_error(hub, memory_folder):
    wrong_token = "hf_" + secrets.token_hex(16)
    with pytest.raises(HfHubHTTPError) as raised:
        push_memory_folder(memory_folder, REPO_ID, token=wrong_token, endpoint=hub.endpoint)
    assert raised.value.response.status_code == 401
    assert wrong_token not in str(raised.value) + repr(raised.value)
    assert hub.unknown_requests == [] and hub.repos == {}
    assert hub.authorizations == [f"Bearer {wrong_token}"] * 2  # repo creation, then the repo-info fallback


def test_card_metadata_table_and_loading_snippet():
    card_text = render_memory_card(MEMORY_CONFIG, RESULTS, repo_id=REPO_ID, datasets=["RMT-team/babilong"])
    card = ModelCard(card_text)

    assert card.data.base_model == "Qwen/Qwen3-0.6B"
    assert card.data.base_model_relation == "adapter"
    assert card.data.library_name == "titans_hf"
    assert card.data.pipeline_tag == "text-generation"
    assert card.data.datasets == ["RMT-team/babilong"]
    assert {"titans", "qwen3", "mag"} <= set(card.data.tags)
    # the model-index holds every cell of results.json, with the memory and without
    results = {(r.dataset_config, r.dataset_split, r.metric_name): r.metric_value for r in card.data.eval_results}
    assert results == {
        ("qa1", "32k", "exact match, memory"): 0.9, ("qa1", "32k", "exact match, no memory"): 0.35,
        ("qa1", "1k", "exact match, memory"): 1.0, ("qa1", "1k", "exact match, no memory"): 0.5,
        ("qa2", "32k", "exact match, memory"): 0.25, ("qa2", "32k", "exact match, no memory"): 0.3,
    }
    rows = [line for line in card_text.splitlines() if line.startswith("| qa")]
    assert rows == [  # the evaluator's order, difference = memory - no_memory
        "| qa1 | 32k | 0.900 | 0.350 | +0.550 |",
        "| qa1 | 1k | 1.000 | 0.500 | +0.500 |",
        "| qa2 | 32k | 0.250 | 0.300 | -0.050 |",
    ]
    assert "Not evaluated yet." not in card_text
    assert 'TitansQwenForCausalLM.from_pretrained("someone/qwen3-titans-memory")' in card_text
    assert "| `memory_layers` | `[1]` |" in card_text
    assert "The base model stayed frozen" in card_text
    assert "[RMT-team/babilong](https://huggingface.co/datasets/RMT-team/babilong)" in card_text


def test_card_without_results_and_a_local_base_is_refused():
    config = dataclasses.replace(MEMORY_CONFIG, variant="mac", num_persistent_tokens=4, num_memory_tokens=8,
                                 bptt_chunks=2, revision="abc123")
    card_text = render_memory_card(config, repo_id=REPO_ID)
    card = ModelCard(card_text)
    assert card.data.eval_results is None and card.data.datasets is None
    assert "## Evaluation\n\nNot evaluated yet.\n" in card_text
    assert "| task |" not in card_text
    assert "Each chunk is prefixed with 4 learned\npersistent tokens and 8 tokens read from the memory" in card_text
    assert "Gradients flowed back through 2 chunks" in card_text
    assert 'AutoTokenizer.from_pretrained("Qwen/Qwen3-0.6B", revision="abc123")' in card_text
    # a local path never goes into a public card: the base's Hub id is asked for
    for local in ("/data/models/qwen3-local", "./base"):
        with pytest.raises(ValueError, match="not a Hub id: a local path never goes into a public card"):
            render_memory_card(dataclasses.replace(MEMORY_CONFIG, base_model_name_or_path=local), repo_id=REPO_ID)


def card_section(card_text: str, title: str) -> str:
    """The text of a card's section, up to the next one."""
    start = card_text.index(f"## {title}\n")
    end = card_text.find("\n## ", start + 1)
    return " ".join(card_text[start:end].split())  # Markdown joins the lines of a paragraph


def test_the_cards_prose_follows_the_update_rule_forgetting_and_attention():
    """The card once told every memory's story as a gradient rule with momentum and decay under chunk-local
    attention, whatever its settings table said: now each of those sentences comes from the settings."""
    delta = dataclasses.replace(MEMORY_CONFIG, update_rule="delta", memory_depth=1, max_lr=0.5, theta_bias_init=-6.0,
                                forget_bias_init=-30.0, write_cost=1.0, attend_previous_chunk=True)
    text = card_section(render_memory_card(delta, repo_id=REPO_ID), "What the memory is")
    assert "with ordinary attention over each chunk and the chunk before it (a sliding window of two chunks)" in text
    assert "a linear map per head (`M_W(k) = k + k W`), 2 heads of 8 dimensions" in text
    assert "below `max_lr` = 0.5 (it starts near 0.0012)" in text  # 0.5 sigmoid(-6)
    assert "It writes by the **delta rule**: every token takes its own step" in text
    assert "There is no momentum, and each head's weights are rescaled to a Frobenius norm of 11.31" in text  # 4 √8
    assert "It does not forget: its forget gate `α` starts at 9.4e-14 per update (bias -30.0)" in text
    assert not any(word in text for word in ("gradient rule", "S ← η S", "It forgets", "chunk-local"))
    assert "plus a write cost: 1.0 × the mean of `θ_t / max_lr`" in card_section(
        render_memory_card(delta, repo_id=REPO_ID), "How it was trained")

    gradient = dataclasses.replace(MEMORY_CONFIG, forget_bias_init=-4.0, memory_batch_size=32,
                                   attend_previous_chunk=False)
    card_text = render_memory_card(gradient, repo_id=REPO_ID)
    text = card_section(card_text, "What the memory is")
    assert "with ordinary attention inside each chunk only (chunk-local attention)" in text
    assert "an MLP per head (depth 2, hidden width 4 × the head size, with a residual)" in text
    assert ("It writes by Titans' **gradient rule**: every 16 tokens, the gradient of the associative-recall loss "
            "`Σ_t θ_t ‖M_W(k_t) − v_t‖²` (the \"surprise\") at the weights its memory batch of 32 tokens started "
            "with, clipped, enters a momentum `S ← η S − G`") in text
    assert "It forgets: each update keeps `1 − α` of the weights, with a learned forget gate `α` per update chunk " \
           "that starts near 0.018 (bias -4.0)" in text  # sigmoid(-4)
    assert not any(word in text for word in ("delta rule", "no momentum", "does not forget", "the chunk before it"))
    assert "write cost" not in card_text  # the gradient rule's default weight is 0


@pytest.mark.parametrize(
    ("results", "message"),
    [
        ({"acc": {}}, "results: expected {'accuracy'"),
        ({"accuracy": {"qa1": {"32k": {"memory": 0.9}}}}, r"results\['accuracy'\]\['qa1'\]\['32k'\]\['no_memory'\]"),
        (
            {"accuracy": {"qa1": {"32k": {"memory": 90, "no_memory": 0.3}}}},
            r"\['memory'\]: expected an accuracy in \[0, 1\], got 90",
        ),
    ],
)
def test_card_refuses_malformed_results(results, message):
    with pytest.raises(ValueError, match=message):
        render_memory_card(MEMORY_CONFIG, results, repo_id=REPO_ID)


# ---- loading by Hub id ----

BASE_REPO_ID = "someone/tiny-qwen3"
LOAD_AND_RUN = """
import json, sys
import torch
{snippet}
ids = torch.tensor([json.loads(sys.argv[1])])
with torch.no_grad():
    logits = model.eval()(ids).logits
print(json.dumps({{"logits": logits.tolist(), "tokens": tokenizer(" kitchen")["input_ids"]}}))
"""


def _card_snippet(card: str) -> str:
    """The model card's usage block, exactly as a user would copy it."""
    return re.search(r"## Use\n\n```python\n(.*?)```", card, re.DOTALL)[1]


def _run_fresh(script: str, ids: list[int], hub: HubStub, hf_home: Path, offline: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(hf_home), "HF_HUB_DISABLE_XET": "1",
           "HF_HUB_OFFLINE": "1" if offline else "0"}
    env.pop("HF_TOKEN", None)
    return subprocess.run([sys.executable, "-c", script, json.dumps(ids)], env=env, capture_output=True, text=True)


def test_a_pushed_memory_loads_by_repo_id_in_a_fresh_process(hub, hub_token, tiny_qwen3_dir, tmp_path, monkeypatch):
    import torch
    from huggingface_hub import HfApi

    from titans_hf.modeling import TitansQwenForCausalLM

    api = HfApi(endpoint=hub.endpoint, token=hub_token)
    api.create_repo(BASE_REPO_ID)
    api.upload_folder(folder_path=str(tiny_qwen3_dir), repo_id=BASE_REPO_ID)  # the base, as a user's base is
    torch.manual_seed(0)
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=8, memory_chunk_size=4, memory_head_dim=16)
    with torch.no_grad():  # a trained memory: W_O and the gates off their (zero) init, so the memory shows
        for name, param in model.named_parameters():
            if name.startswith("model.memory."):
                param.add_(0.1 * torch.randn_like(param))
    ids = list(range(5, 25))
    with torch.no_grad():
        expected = model.eval()(torch.tensor([ids])).logits
    with pytest.raises(ValueError, match="not a Hub id: a local path never goes into a public card"):
        model.push_to_hub(REPO_ID, token=hub_token)  # trained on a local folder: the base's Hub id is needed
    model.push_to_hub(REPO_ID, token=hub_token, base_model=BASE_REPO_ID)
    assert set(hub.files[REPO_ID]) == HUB_FILES
    assert json.loads(hub.files[REPO_ID]["memory_config.json"])["base_model_name_or_path"] == BASE_REPO_ID
    pushed_config = json.loads(hub.files[REPO_ID]["config.json"])
    assert pushed_config["memory_config"]["base_model_name_or_path"] == BASE_REPO_ID
    assert str(tiny_qwen3_dir) not in hub.files[REPO_ID]["config.json"].decode()  # no local path goes public
    # the Auto class loads the repository as the model class does: the base it names, then the memory
    from transformers import AutoModelForCausalLM

    auto = AutoModelForCausalLM.from_pretrained(REPO_ID)
    assert type(auto) is TitansQwenForCausalLM and auto.config.name_or_path == BASE_REPO_ID
    with torch.no_grad():
        assert torch.equal(auto.eval()(torch.tensor([ids])).logits, expected)

    script = LOAD_AND_RUN.format(snippet=_card_snippet(hub.files[REPO_ID]["README.md"].decode()))
    online = _run_fresh(script, ids, hub, tmp_path / "hf_home", offline=False)
    assert online.returncode == 0, online.stderr[-3000:]
    result = json.loads(online.stdout.splitlines()[-1])
    assert torch.equal(torch.tensor(result["logits"]), expected)
    assert result["tokens"] == AutoTokenizer.from_pretrained(tiny_qwen3_dir)(" kitchen")["input_ids"]

    # offline, the same lines load from the cache the first run filled
    requests = len(hub.requests)
    cached = _run_fresh(script, ids, hub, tmp_path / "hf_home", offline=True)
    assert cached.returncode == 0, cached.stderr[-3000:]
    assert torch.equal(torch.tensor(json.loads(cached.stdout.splitlines()[-1])["logits"]), expected)
    assert len(hub.requests) == requests
    # offline with nothing cached: an error that says so, not a traceback from deep inside
    empty = _run_fresh(script, ids, hub, tmp_path / "empty_home", offline=True)
    assert empty.returncode != 0
    assert f"memory_config.json of {REPO_ID} is not in the local Hugging Face cache" in empty.stderr


def test_trainer_push_to_hub_pushes_the_memory_only(hub, hub_token, tiny_qwen3_dir, tmp_path):
    """Trainer(push_to_hub=True): every checkpoint's memory during training, then the final one; never the base,
    the tokenizer, the optimizer or the training arguments."""
    import datasets
    import torch
    from safetensors.torch import load as load_bytes

    from titans_hf.modeling import TitansQwenForCausalLM
    from titans_hf.training import TitansTrainer, TitansTrainingArguments

    torch.manual_seed(0)
    model = TitansQwenForCausalLM.from_base(tiny_qwen3_dir, chunk_size=16, memory_chunk_size=8, memory_head_dim=16,
                                            checkpoint_chunks=False)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 200, (4, 32), generator=generator).tolist()
    rows = datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 32] * 4, "labels": ids})
    args = TitansTrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
        save_strategy="steps", save_steps=1, report_to="none", use_cpu=True, disable_tqdm=True,
        push_to_hub=True, hub_model_id=REPO_ID, hub_token=hub_token, hub_base_model="someone/tiny-qwen3",
        hub_dataset_ids=["someone/long-documents"],
    )
    trainer = TitansTrainer(model=model, args=args, train_dataset=rows,
                            processing_class=AutoTokenizer.from_pretrained(tiny_qwen3_dir))
    trainer.train()
    assert [commit["summary"] for commit in hub.commits] == ["Training in progress, step 1",
                                                             "Training in progress, step 2"]
    url = trainer.push_to_hub()
    assert url.startswith(f"{hub.endpoint}/{REPO_ID}/commit/")
    assert all(set(commit["files"]) == HUB_FILES for commit in hub.commits) and len(hub.commits) == 3
    pushed = load_bytes(hub.files[REPO_ID]["memory_model.safetensors"])
    assert pushed.keys() == model.memory_state_dict().keys()
    assert all(torch.equal(pushed[name], tensor) for name, tensor in model.memory_state_dict().items())
    card = ModelCard(hub.files[REPO_ID]["README.md"].decode())
    assert card.data.base_model == "someone/tiny-qwen3" and card.data.datasets == ["someone/long-documents"]
    assert json.loads(hub.files[REPO_ID]["memory_config.json"])["base_model_name_or_path"] == "someone/tiny-qwen3"


def test_attend_previous_chunk_is_on_for_new_memories_and_a_memory_saved_before_it_is_refused():
    """The window is the default for new memories; a config that predates the setting predates titans_hf's first
    release (it has no format_version), and is refused rather than read with the setting off."""
    assert TitansMemoryConfig().attend_previous_chunk is True
    assert TitansMemoryConfig.from_dict({"chunk_size": 32}).attend_previous_chunk is True  # settings, not a file
    # a file of that time: no format_version, and none of the settings added after attend_previous_chunk
    later = ("format_version", "attend_previous_chunk", "theta_bias_init", "forget_bias_init", "update_rule",
             "max_memory_norm", "write_cost")
    saved = {name: value for name, value in MEMORY_CONFIG.to_dict().items() if name not in later}
    with pytest.raises(ValueError, match=r"no format_version: the memory config is from before titans_hf's first "
                                         r"release \(0\.3\.0\)"):
        TitansMemoryConfig.from_dict(saved)
