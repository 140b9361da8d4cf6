"""A real Triton Inference Server over a specrt model repository: the `tritonserver` nvidia-pytriton ships.

    find_tritonserver()   where the nvidia-pytriton wheel keeps tritonserver, the Python backend, the
                          backend stubs (one per Python 3.8-3.13) and the shared libraries
    build_stub_env()      the Python the Python-backend stub runs, built once and cached
    TritonServer          start (explicit model control: only the Python models), wait for READY, stop

The stub's environment. Triton runs each Python-model instance in a separate process, the backend
stub, which embeds libpythonX.Y. That interpreter ignores PYTHONPATH and the virtual environment
tritonserver was started from: it finds its prefix from the first `python3` on PATH, and a
`pyvenv.cfg` beside that `python3` makes the prefix a virtual environment. Its numpy must be < 2: the
stub of Triton 2.51 reads TYPE_STRING (BYTES) tensors wrongly under numpy 2 and dies (`unpack_from
requires a buffer of at least 488447265 bytes`). So `build_stub_env` writes a minimal virtual
environment and tritonserver runs with its `bin` first on PATH:

    ENV/                             cache_dir()/triton-env/py3.11-<key> unless given
      pyvenv.cfg                     home = this interpreter's base; no system site-packages
      bin/python3, bin/python        symlinks to this interpreter's base executable
      lib/python3.11/site-packages/  numpy>=1.26,<2 and specrt's runtime dependencies (their whole
                                     closure) pinned to the versions installed here; specrt's own
                                     installed files (its RECORD: the package, or for an editable
                                     install the finder that maps to the source tree)
      backends/python/               the wheel's Python backend + the stub for Python 3.11
      env.json                       what went in (its key); written last, so ENV is complete

`key` hashes the Python, nvidia-pytriton's version, the pinned requirements and specrt's RECORD: the
same inputs give the same ENV, reused; other inputs build another one. ENV is built in a temporary
folder beside it and renamed into place. tritonserver then runs with PATH=ENV/bin:..., LD_LIBRARY_PATH=
the wheel's libraries + the directory of libpythonX.Y (the stub links it), --backend-directory
ENV/backends.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.paths import cache_dir

INSTALL_HINT = ("pip install 'specrt[triton-server]' (or `pip install --no-deps nvidia-pytriton` to keep this "
                "environment's numpy: specrt runs only the tritonserver binary it ships)")
STUB_NUMPY = "numpy>=1.26,<2"  # the stub's pybind11 (Triton 2.51) reads BYTES tensors wrongly under numpy 2
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
CHECK = ("import numpy, specrt.runtime.generate; "
         "assert int(numpy.__version__.split('.')[0]) < 2, 'numpy ' + numpy.__version__; print(numpy.__version__)")


@dataclass(frozen=True)
class TritonDist:
    """The tritonserver distribution inside the nvidia-pytriton wheel."""

    root: Path  # site-packages/pytriton/tritonserver
    libs: Path  # site-packages/nvidia_pytriton.libs (what the binaries link)
    version: str  # nvidia-pytriton's

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def python_backend(self) -> Path:
        return self.root / "backends" / "python"

    def stub(self, python: str = PYTHON) -> Path:
        return self.root / "python_backend_stubs" / python / "triton_python_backend_stub"

    def pythons(self) -> list[str]:
        found = [p.name for p in (self.root / "python_backend_stubs").glob("*") if (p / "triton_python_backend_stub").is_file()]
        return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


def find_tritonserver(package: str = "pytriton") -> TritonDist:
    """nvidia-pytriton's tritonserver (the package is located, not imported); SpecrtError when absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SpecrtError(f"tritonserver not found: nvidia-pytriton is not installed; {INSTALL_HINT}")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    dist = TritonDist(root, root.parent.parent / "nvidia_pytriton.libs", _version("nvidia-pytriton"))
    for need in (dist.binary, dist.python_backend / "libtriton_python.so"):
        if not need.is_file():
            raise SpecrtError(f"{need} is missing: the nvidia-pytriton install is incomplete; reinstall it "
                              f"({INSTALL_HINT})")
    return dist


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def libpython_dir() -> Path:
    """The folder holding this interpreter's shared libpythonX.Y, which the backend stub links."""
    name = sysconfig.get_config_var("INSTSONAME") or f"libpython{PYTHON}.so.1.0"
    folder = Path(sysconfig.get_config_var("LIBDIR") or sys.base_prefix + "/lib")
    if not name.endswith(".a") and (folder / name).is_file():
        return folder
    raise SpecrtError(f"{folder / name} is missing: Triton's Python backend stub links libpython{PYTHON}.so, and "
                      f"{sys.executable} was built without it; run specrt with a Python built with "
                      "--enable-shared (python.org, Debian/Ubuntu, conda and uv builds are)")


# ── the stub's environment ────────────────────────────────────────────────────────────────────────
@dataclass(frozen=True)
class StubEnv:
    path: Path
    python: str = PYTHON

    @property
    def bin(self) -> Path:
        return self.path / "bin"

    @property
    def backends(self) -> Path:
        return self.path / "backends"

    @property
    def site_packages(self) -> Path:
        return self.path / "lib" / f"python{self.python}" / "site-packages"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def stub_requirements(distribution: str = "specrt") -> list[str]:
    """`distribution`'s runtime dependencies and theirs (extras and other platforms' left out), each pinned
    to the version installed here, numpy replaced by STUB_NUMPY."""
    from packaging.requirements import Requirement  # onnxruntime's dependency, so always here

    pins: dict[str, str] = {}
    todo = [distribution]
    while todo:
        current = todo.pop()
        requires = _installed(current).requires if current == distribution else importlib.metadata.requires(current)
        for text in requires or []:
            req = Requirement(text)
            name = _canonical(req.name)
            if name in pins or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
                continue
            try:
                pins[name] = importlib.metadata.version(req.name)
            except importlib.metadata.PackageNotFoundError:
                raise SpecrtError(f"{req.name} (required by {distribution}'s dependencies) is not installed "
                                  f"here: pip install -e . again") from None
            todo.append(req.name)
    return sorted(STUB_NUMPY if name == "numpy" else f"{name}=={version}" for name, version in pins.items())


def _installed(name: str = "specrt") -> importlib.metadata.Distribution:
    """`name` as pip installed it (a dist-info with a RECORD), not a source tree's egg-info that happens
    to be on sys.path (the current folder, in a checkout)."""
    for dist in importlib.metadata.distributions(name=name):
        if dist.read_text("RECORD") is not None:
            return dist
    raise SpecrtError(f"{name} is not installed by pip (the stub imports it from its own environment): "
                      "pip install -e .")


def _specrt_files() -> tuple[importlib.metadata.Distribution, list]:
    dist = _installed()
    files = [f for f in dist.files or [] if f.parts[0] != ".." and "__pycache__" not in f.parts]
    return dist, files


def env_key(dist: TritonDist, requirements: Sequence[str]) -> str:
    _, files = _specrt_files()
    record = [str(f) + ":" + (f.hash.value if f.hash else "") for f in files]
    # where this specrt imports from: an editable install's env points there, and RECORD's hashes are pip's
    # word at install time (a checkout copied or moved keeps them)
    source = os.path.realpath(Path(importlib.util.find_spec("specrt").origin).parent)
    payload = {"python": sys.version, "base": os.path.realpath(getattr(sys, "_base_executable", sys.executable)),
               "pytriton": dist.version, "requirements": list(requirements), "specrt": record, "source": source}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def build_stub_env(dist: TritonDist, env_dir: Path | None = None,
                   log: Callable[[str], None] = lambda _: None) -> StubEnv:
    """The stub's environment for `dist` (see the module docstring), built unless a complete one with the
    same key is at `env_dir` (default: specrt's cache folder)."""
    if not dist.stub().is_file():
        raise SpecrtError(f"nvidia-pytriton {dist.version} has no Python backend stub for Python {PYTHON} (it has "
                          f"{', '.join(dist.pythons())}): run specrt with one of those")
    requirements = stub_requirements()
    key = env_key(dist, requirements)
    default = env_dir is None
    path = Path(cache_dir() / "triton-env" / f"py{PYTHON}-{key}" if default else env_dir).resolve()
    if _env_key(path) == key:
        return StubEnv(path)
    if path.exists() and not default and _env_key(path) is None:
        raise SpecrtError(f"{path} exists and is not a specrt stub environment (no env.json): choose another "
                          "--env-dir or remove it")
    log(f"building the Python backend stub's environment at {path} (numpy<2, {len(requirements)} pinned "
        "packages; once)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from a server run as another user
        env = StubEnv(tmp)
        _write_venv(env)
        _pip_install(env, requirements)
        _copy_specrt(env)
        env.backends.mkdir()
        shutil.copytree(dist.python_backend, env.backends / "python", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(dist.stub(), env.backends / "python" / "triton_python_backend_stub")
        numpy = _check(env)
        (tmp / "env.json").write_text(json.dumps({"key": key, "python": sys.version, "pytriton": dist.version,
                                                  "numpy": numpy, "requirements": requirements}, indent=1))
        _rename_into_place(tmp, path, key)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return StubEnv(path)


def _env_key(path: Path) -> str | None:
    try:
        return json.loads((path / "env.json").read_text())["key"]
    except (OSError, ValueError, KeyError):
        return None


def _write_venv(env: StubEnv) -> None:
    """pyvenv.cfg + bin/python3: enough for an interpreter started from there (or finding `python3` on
    PATH, as the stub does) to take ENV as its prefix and ENV's site-packages as its only one."""
    base = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    env.bin.mkdir(parents=True)
    env.site_packages.mkdir(parents=True)
    (env.path / "pyvenv.cfg").write_text(f"home = {base.parent}\ninclude-system-site-packages = false\n"
                                         f"version = {sys.version.split()[0]}\n")
    for name in ("python3", "python", f"python{PYTHON}"):
        (env.bin / name).symlink_to(base)


def _clean_environ() -> dict:
    """os.environ without what would point a Python elsewhere than its own prefix."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP",
                                                             "VIRTUAL_ENV", "PYTHONNOUSERSITE")}


def _pip_install(env: StubEnv, requirements: Sequence[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "--python", str(env.bin / "python3"), "install", "--quiet",
           "--disable-pip-version-check", "--no-warn-script-location", *requirements]
    done = subprocess.run(cmd, env=_clean_environ(), capture_output=True, text=True)
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-4:])
        raise SpecrtError(f"pip (>= 22.3, for --python) could not install the stub's environment "
                          f"({' '.join(requirements[:3])} ...): {tail}")


def _copy_specrt(env: StubEnv) -> None:
    """specrt's installed files (RECORD) into ENV's site-packages: the same code the CLI runs."""
    dist, files = _specrt_files()
    for f in files:
        src = Path(dist.locate_file(f))
        if src.is_file():
            dst = env.site_packages / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def _check(env: StubEnv) -> str:
    """ENV's Python imports specrt's runtime with numpy < 2; returns numpy's version."""
    done = subprocess.run([str(env.bin / "python3"), "-c", CHECK], env=_clean_environ(), capture_output=True,
                          text=True, cwd=env.path)
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise SpecrtError(f"the stub's environment {env.path} does not import specrt's runtime with numpy<2: {tail}")
    return done.stdout.strip()


def _rename_into_place(tmp: Path, path: Path, key: str) -> None:
    """Rename `tmp` to `path`; an existing `path` is replaced, or kept when another process just
    completed the same environment."""
    if path.exists():
        if _env_key(path) == key:  # built meanwhile by another process
            shutil.rmtree(tmp, ignore_errors=True)
            return
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
        return
    tmp.rename(path)


# ── the server process ────────────────────────────────────────────────────────────────────────────
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _terminate_with_parent() -> None:
    """In the child before exec: Linux sends it SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass  # not Linux: stop() is then the only way it ends


@dataclass
class TritonServer:
    """One tritonserver process serving `models` of `repo` (nothing else is loaded); a context manager
    that always stops it. `log_file`: where its output goes (default: this process's stdout/stderr)."""

    repo: Path
    dist: TritonDist
    env: StubEnv
    models: Sequence[str]
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_verbose: int = 0
    log_file: Path | None = None
    exit_timeout_s: int = 10
    process: subprocess.Popen | None = field(default=None, init=False)
    _log: object = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def command(self) -> list[str]:
        cmd = [str(self.dist.binary), "--model-repository", str(Path(self.repo).resolve()),
               "--backend-directory", str(self.env.backends), "--model-control-mode", "explicit",
               "--http-address", self.host, "--http-port", str(self.http_port),
               "--grpc-address", self.host, "--grpc-port", str(self.grpc_port),
               "--metrics-address", self.host, "--metrics-port", str(self.metrics_port),
               "--allow-gpu-metrics", "false", "--log-verbose", str(self.log_verbose),
               "--exit-timeout-secs", str(self.exit_timeout_s)]
        for model in self.models:
            cmd += ["--load-model", model]
        return cmd

    def environment(self) -> dict:
        environ = _clean_environ()
        environ["PATH"] = os.pathsep.join([str(self.env.bin), environ.get("PATH", "")])
        libs = [str(self.dist.libs), str(libpython_dir()), environ.get("LD_LIBRARY_PATH", "")]
        environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libs if p)
        return environ

    def start(self) -> TritonServer:
        for port in (self.http_port, self.grpc_port, self.metrics_port):
            if _port_in_use(self.host, port):
                raise SpecrtError(f"port {port} on {self.host} is in use: choose other --http-port / --grpc-port / "
                                  "--metrics-port")
        if self.log_file is not None:
            Path(self.log_file).parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_file, "ab")  # closed in stop()
        # its own process group: stop() can end the stubs with it, and a terminal's Ctrl-C reaches only us;
        # and SIGTERM when this process dies without stop() (killed), so it never outlives us
        self.process = subprocess.Popen(self.command(), env=self.environment(), stdin=subprocess.DEVNULL,
                                        stdout=self._log, stderr=subprocess.STDOUT if self._log else None,
                                        start_new_session=True, preexec_fn=_terminate_with_parent)
        return self

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """(HTTP status, body) of GET `path` on the server."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def wait_ready(self, timeout: float = 300.0) -> dict:
        """Block until the server and every model are READY; returns the server metadata (name, version).
        SpecrtError when the process exits first or `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        pending = ["/v2/health/ready"] + [f"/v2/models/{m}/ready" for m in self.models]
        while pending:
            code = self.process.poll()
            if code is not None:
                raise SpecrtError(f"tritonserver exited with code {code} before it was ready: {self.log_tail()}")
            try:
                if self.get(pending[0], timeout=2.0)[0] == 200:
                    pending.pop(0)
                    continue
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise SpecrtError(f"tritonserver was not ready after {timeout:.0f} s ({pending[0]} not 200): "
                                  f"{self.log_tail()}")
            time.sleep(0.2)
        return json.loads(self.get("/v2")[1])

    def log_tail(self, lines: int = 6) -> str:
        if self.log_file is None:
            return "see its log above"
        try:
            text = Path(self.log_file).read_text(errors="replace").strip().splitlines()
        except OSError:
            return f"no log at {self.log_file}"
        return f"{self.log_file}: " + " | ".join(text[-lines:])

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM, then (after the exit timeout and a margin) SIGKILL to its process group; the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout if timeout is not None else self.exit_timeout_s + 10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        try:  # stubs left behind by a killed server: same process group
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.process.returncode

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
