"""`python -m fusedrl.trainer ARGS` for the tests that run the trainer's command line.

`TrainerCLI(env, with_vllm)` answers `run(*args)` with a `subprocess.CompletedProcess`, as
`subprocess.run([python, "-m", "fusedrl.trainer", *args], env=env, capture_output=True)` would,
and `start(*args)` with a `Run`: the process (Popen's `pid`, `poll`, `wait`, `send_signal`,
`kill`, `returncode`) and its output so far. Each run is forked from a server process that
imported torch, transformers and (with_vllm) vLLM once (tests/trainer_fork_server.py says what it
keeps faithful): ~10 s less per run on the 2-core machine, where a short run takes 15-20 s. A
verbose run (`--verbose`, FUSEDRL_VERBOSE) is a plain subprocess, as is every run where the
server cannot serve (it would fork a process with threads, or it failed to start); `forked`
says which. One run at a time: the server waits for a run before it starts the next.
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


class _ForkedProcess:
    """A run forked by the server, with the Popen methods the tests use: its exit status comes
    as the server's next line, read by a thread."""

    def __init__(self, pid: int, replies, command: list[str]) -> None:
        self.pid, self.args, self.returncode = pid, command, None
        self._ended = threading.Event()

        def read_exit() -> None:
            line = replies.readline()
            self.returncode = json.loads(line)["returncode"] if line else -signal.SIGKILL
            self._ended.set()

        threading.Thread(target=read_exit, daemon=True).start()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Run:
    """A started run: `process` (a subprocess.Popen or a forked process: the same methods) and
    what it has written so far to its stdout and stderr."""

    def __init__(self, process, folder: tempfile.TemporaryDirectory) -> None:
        self.process, self._folder = process, folder
        self.pid = process.pid

    def stdout(self) -> str:
        return (Path(self._folder.name) / "stdout").read_text()

    def stderr(self) -> str:
        return (Path(self._folder.name) / "stderr").read_text()

    def close(self) -> None:
        self._folder.cleanup()


class TrainerCLI:
    def __init__(self, env: dict[str, str], *, with_vllm: bool) -> None:
        self.env = dict(env)
        self.active: _ForkedProcess | None = None
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

    def start(self, *args: str, cwd: Path = ROOT) -> Run:
        command = [sys.executable, "-m", "fusedrl.trainer", *args]
        folder = tempfile.TemporaryDirectory()
        out, err = Path(folder.name) / "stdout", Path(folder.name) / "stderr"
        verbose = "--verbose" in args or self.env.get("FUSEDRL_VERBOSE", "") not in ("", "0")
        if verbose or not self.forked:
            with open(out, "w") as stdout, open(err, "w") as stderr:
                process = subprocess.Popen(
                    command, stdout=stdout, stderr=stderr, env=self.env, cwd=cwd
                )
            return Run(process, folder)
        if self.active is not None and self.active.poll() is None:
            raise RuntimeError("the trainer's fork server runs one run at a time")
        request = {"args": list(args), "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        started = self._reply(timeout=60)
        if started is None:
            raise RuntimeError("the trainer's fork server did not start the run")
        self.active = _ForkedProcess(started["pid"], self.server.stdout, command)
        return Run(self.active, folder)

    def run(
        self, *args: str, cwd: Path = ROOT, timeout: float = 900
    ) -> subprocess.CompletedProcess:
        run = self.start(*args, cwd=cwd)
        try:
            try:
                code = run.process.wait(timeout)
            except subprocess.TimeoutExpired:  # the run is over its time: end it
                run.process.kill()
                run.process.wait(60)
                raise
            return subprocess.CompletedProcess(run.process.args, code, run.stdout(), run.stderr())
        finally:
            run.close()

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
