"""`python -m fusedrl.trainer ARGS` for the tests that run the trainer's command line.

`TrainerCLI(env, with_vllm)` answers `run(*args)` with a `subprocess.CompletedProcess`, as
`subprocess.run([python, "-m", "fusedrl.trainer", *args], env=env, capture_output=True)` would.
Each run is forked from a server process that imported torch, transformers and (with_vllm) vLLM
once (tests/trainer_fork_server.py says what it keeps faithful): ~10 s less per run on the 2-core
machine, where a short run takes 15-20 s. A verbose run (`--verbose`, FUSEDRL_VERBOSE) is a plain
subprocess, as is every run where the server cannot serve (it would fork a process with threads,
or it failed to start); `forked` says which.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = Path(__file__).with_name("trainer_fork_server.py")


class TrainerCLI:
    def __init__(self, env: dict[str, str], *, with_vllm: bool) -> None:
        self.env = dict(env)
        self.server: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, str(SERVER), *(["--with-vllm"] if with_vllm else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
            cwd=ROOT,
        )
        hello = self._reply(timeout=600)
        self.forked = bool(hello and hello.get("ready"))
        if not self.forked:
            self.close()

    def _reply(self, timeout: float) -> dict | None:
        """The server's next line, or None if it ends or says nothing within `timeout` seconds."""
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.server.stdout.readline()))
        reader.daemon = True
        reader.start()
        reader.join(timeout)
        return json.loads(line[0]) if line and line[0] else None

    def run(
        self, *args: str, cwd: Path = ROOT, timeout: float = 900
    ) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "fusedrl.trainer", *args]
        verbose = "--verbose" in args or self.env.get("FUSEDRL_VERBOSE", "") not in ("", "0")
        if verbose or not self.forked:
            return subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, env=self.env, cwd=cwd
            )
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"args": list(args), "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            started = self._reply(timeout=60)
            if started is None:
                raise RuntimeError("the trainer's fork server did not start the run")
            ended = self._reply(timeout)
            if ended is None:  # the run is over its time: end it, and the server with it
                os.kill(started["pid"], signal.SIGKILL)
                self.close()
                raise subprocess.TimeoutExpired(command, timeout)
            return subprocess.CompletedProcess(
                command, ended["returncode"], out.read_text(), err.read_text()
            )

    def close(self) -> None:
        if self.server is None:
            return
        self.server.stdin.close()
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        self.server = None
        self.forked = False
