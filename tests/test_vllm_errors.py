"""The vLLM backend's errors that need no vLLM: bad arguments name themselves, a server that
exits at once or never answers raises ServerError naming it with its log's tail, and a
generator without a server to reach fails at connect. (Against a real server: test_vllm.py.)"""

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentrl_fast.config import ConfigError, RunConfig, apply_overrides, validate
from agentrl_fast.config.generator import GeneratorConfig
from agentrl_fast.generators import ServerError, VLLMGenerator, VLLMServer
from agentrl_fast.generators.vllm_server import free_port


@pytest.mark.parametrize("fields, message", [
    (dict(backend="sglang"), "backend must be one of torch, vllm"),
    (dict(backend="vllm"), "needs url .* or python"),
    (dict(url="http://127.0.0.1:1"), "url and python are for backend='vllm'"),
    (dict(backend="vllm", url="127.0.0.1:8000"), "url must be http"),
    (dict(backend="vllm", url="http://a", max_concurrency=0), "max_concurrency must be"),
    (dict(backend="vllm", url="http://a", retries=-1), "retries must be"),
    (dict(backend="vllm", url="http://a", timeout=0), "timeout must be > 0"),
])
def test_generator_config_names_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=message):
        GeneratorConfig(**fields)


def test_overrides_apply_at_once_and_vllm_refuses_top_p():
    config = apply_overrides(RunConfig(), ["generator.backend=vllm",
                                           "generator.url=http://127.0.0.1:8000,http://h:1"])
    assert config.generator.urls == ["http://127.0.0.1:8000", "http://h:1"]
    config = apply_overrides(config, ["train.rollout.sampling.top_p=0.9"])
    with pytest.raises(ConfigError, match="top_k/top_p must be off"):
        validate(config)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def fake_python(tmp_path, body: str):
    """An executable standing in for the vLLM interpreter."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_server_arguments_are_checked(tmp_path, model_dir):
    with pytest.raises(ValueError, match="model_dir must be a model folder"):
        VLLMServer(tmp_path / "nothing", python="/bin/sh")
    with pytest.raises(ValueError, match="python must be the vLLM environment's interpreter"):
        VLLMServer(model_dir, python=tmp_path / "missing")
    with pytest.raises(ValueError, match="port must be an int"):
        VLLMServer(model_dir, python="/bin/sh", port=70000)


def test_a_server_that_exits_is_named_with_its_log(tmp_path, model_dir):
    python = fake_python(tmp_path, 'echo "no module named vllm: $*"; exit 3')
    server = VLLMServer(model_dir, python=python, log_path=tmp_path / "server.log")
    with pytest.raises(ServerError, match=r"vLLM server http://127\.0\.0\.1:\d+ .*exited with "
                                          r"code 3; log tail:\n.*no module named vllm"):
        server.start()
    assert server.process is None  # stopped


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path, model_dir):
    python = fake_python(tmp_path, "exec sleep 60")
    server = VLLMServer(model_dir, python=python, startup_timeout=1.5)
    start = time.monotonic()
    with pytest.raises(ServerError, match="did not become healthy within 1.5 s"):
        server.start()
    assert time.monotonic() - start < 20
    assert server.process is None


def test_a_generator_with_no_server_fails_at_connect():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match=f"vLLM server {url} stopped answering"):
        VLLMGenerator(url, connect_timeout=1.0)
    with pytest.raises(ValueError, match="base_url: expected http"):
        VLLMGenerator(["localhost:8000"])
    with pytest.raises(ValueError, match="max_concurrency must be an int >= 1"):
        VLLMGenerator(url, max_concurrency=0)


def test_a_bad_weights_dir_is_named_before_anything_starts(tmp_path):
    """generator.weights_dir missing, a file or not writable: a ValueError naming it, from the
    generator before it connects and from the run before it starts a server (a ConfigError)."""
    from agentrl_fast.train.serving import run_generator

    url = f"http://127.0.0.1:{free_port()}"  # never reached
    (tmp_path / "file").write_text("")
    unwritable = tmp_path / "read-only"
    unwritable.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes in any folder it owns
        unwritable = Path("/proc")
    for folder, message in ((tmp_path / "missing", "is not an existing folder"),
                            (tmp_path / "file", "is not an existing folder"),
                            (unwritable, "cannot write in")):
        with pytest.raises(ValueError, match=rf"generator\.weights_dir: .*{message}"):
            VLLMGenerator(url, weights_dir=folder, connect_timeout=1.0)
        config = RunConfig()
        config.generator = GeneratorConfig(backend="vllm", url=url, weights_dir=str(folder))
        with pytest.raises(ConfigError, match=rf"generator\.weights_dir: .*{message}"):
            with run_generator(config, None, None, tmp_path / "run", False):
                pass
    with pytest.raises(ValueError, match="weights_dir must be a folder path or None"):
        GeneratorConfig(backend="vllm", url=url, weights_dir="")


def test_a_server_does_not_outlive_a_killed_trainer(tmp_path, model_dir):
    """SIGKILL to the process that started a server: the server gets SIGTERM (no orphan)."""
    pid_file = tmp_path / "server.pid"
    python = fake_python(tmp_path, f'echo $$ > {pid_file}; exec sleep 120')
    code = (f"from agentrl_fast.generators import VLLMServer\n"
            f"VLLMServer({str(model_dir)!r}, python={str(python)!r}, startup_timeout=120).start()")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.1)
        server_pid = int(pid_file.read_text())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(server_pid):
            assert time.monotonic() < deadline, "the server outlived the killed trainer"
            time.sleep(0.1)
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}").exists() else "X"
    return state != "Z"  # a zombie has exited (its parent may not have reaped it yet)


class _BadStreams:
    """An HTTP server speaking just enough of vLLM's API to connect, whose streamed
    completions go wrong by prompt: ``[1]`` streams two ids and a finish, ``[2]`` an error
    event after one id, ``[3]`` ends without a finish reason, ``[4]`` sends a line that is not
    JSON. (vLLM sends an error event when its engine fails mid-request.)"""

    def __init__(self):
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        def event(ids, finish=None) -> bytes:
            choice = {"token_ids": ids, "finish_reason": finish,
                      "logprobs": {"token_logprobs": [-0.5] * len(ids)}}
            return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()

        streams = {1: [event([7]), event([8], "length"), b"data: [DONE]\n\n"],
                   2: [event([7]), b'data: {"error": {"message": "engine died"}}\n\n'],
                   3: [event([7]), b"data: [DONE]\n\n"],
                   4: [event([7]), b"data: {not json\n\n"]}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, body: bytes, kind="application/json"):
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path.startswith("/server_info"):
                    self.reply(json.dumps({"vllm_config": {"model_config": {
                        "logprobs_mode": "processed_logprobs"}}}).encode())
                elif self.path == "/v1/models":
                    self.reply(json.dumps({"data": [{"id": "m"}]}).encode())
                else:
                    self.reply(b"")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.reply(b"".join(streams[body["prompt"][0]]), "text/event-stream")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def test_a_stream_that_goes_wrong_fails_only_its_sequence():
    from agentrl_fast.config.sampling import SamplingParams
    fake = _BadStreams()
    try:
        with VLLMGenerator(fake.url, retries=0) as generator:
            heard = {}
            out = generator.generate([[1], [2], [3], [4]], SamplingParams(max_new_tokens=2),
                                     on_tokens=lambda i, ids: heard.setdefault(i, []).extend(ids))
    finally:
        fake.server.shutdown()
    assert out[0].ids == [7, 8] and out[0].finish_reason == "length" and heard[0] == [7, 8]
    assert [g.finish_reason for g in out[1:]] == ["error"] * 3
    assert "engine died" in out[1].error and "without a finish reason" in out[2].error
    assert "not JSON" in out[3].error
    assert generator.stats["failed"] == 3


def _model_dir(tmp_path: Path, max_positions: int | None) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"model_type": "qwen3"}
    if max_positions is not None:
        config["max_position_embeddings"] = max_positions
    (folder / "config.json").write_text(__import__("json").dumps(config))
    return folder


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize("max_positions, given, batched, want", [
    (1024, None, None, ("1024", "16384")),       # the model's length when it is below 2048
    (40960, None, None, ("2048", "16384")),      # else 2048 (the CPU server's KV cache)
    (None, 200, None, ("200", "16384")),         # a run's context budget
    (40960, 32768, None, ("32768", "32768")),    # whole prefills: the step budget follows
    (40960, 4096, 8192, ("4096", "8192")),
])
def test_the_server_length_follows_the_run_and_the_model(tmp_path, max_positions, given,
                                                         batched, want):
    """A checkpoint with max_position_embeddings=1024 used to fail to start (2048 was
    hard-coded); a run's context budget sets the length; the batch budget is never below it."""
    server = VLLMServer(_model_dir(tmp_path, max_positions), python=sys.executable,
                        max_model_len=given, max_num_batched_tokens=batched)
    command = server.command()
    assert (_flag(command, "--max-model-len"), _flag(command, "--max-num-batched-tokens")) == want


@pytest.mark.parametrize("given, batched, message", [
    (4096, None, r"max_model_len \(4096.*\) exceeds the model's max_position_embeddings \(1024"),
    (1000, 512, r"max_num_batched_tokens \(512\) must be at least max_model_len \(1000\)"),
    (0, None, r"max_model_len must be an int >= 1 or None, got 0"),
])
def test_server_lengths_the_model_cannot_serve_are_refused(tmp_path, given, batched, message):
    with pytest.raises(ValueError, match=message):
        VLLMServer(_model_dir(tmp_path, 1024), python=sys.executable, max_model_len=given,
                   max_num_batched_tokens=batched)


def test_banned_ids_go_to_the_server_as_the_strongest_logit_bias():
    """vLLM applies ``logit_bias`` before its processed log-probs (the recorded ones), so they
    are renormalized without the banned ids; it clamps a bias to -100, the value sent."""
    from types import SimpleNamespace

    from agentrl_fast.config import SamplingParams

    body = VLLMGenerator._body(SimpleNamespace(model="m"), [1, 2],
                               SamplingParams(banned_ids=(7, 5)), seed=3)
    assert body["logit_bias"] == {"5": -100.0, "7": -100.0}
    assert "logit_bias" not in VLLMGenerator._body(SimpleNamespace(model="m"), [1, 2],
                                                   SamplingParams(), seed=3)
