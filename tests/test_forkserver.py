"""benchmarks/forkserver.py, which runs the Python commands of gpu_check.sh's dry run forked from
one interpreter: each command sees what ``python ARGS`` would give it (arguments, ``sys.path[0]``,
``__main__``, environment, stdin / stdout, exit status or signal), a command whose start-up
variables differ starts a fresh interpreter, and a stopped caller stops its command's processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.trainer_utils import ROOT

FS = os.path.join(ROOT, "benchmarks", "forkserver.py")
PRELOADED = "wave"  # a module the interpreter does not import by itself: in sys.modules = forked
REPORT = ("import json, os, sys\n"
          f"forked = {PRELOADED!r} in sys.modules\n"
          "print(json.dumps({'argv': sys.argv, 'path0': sys.path[0], 'name': __name__, 'forked': forked,"
          " 'foo': os.environ.get('FOO')}))\n")


@pytest.fixture
def server(tmp_path):
    sock = str(tmp_path / "fs.sock")
    proc = subprocess.Popen([sys.executable, FS, "serve", sock, PRELOADED], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    yield sock, proc
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=10)


def _module():
    """benchmarks/forkserver.py imported as a module (it is a script, not a package's)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("forkserver_under_test", FS)
    forkserver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(forkserver)
    return forkserver


def _run(sock, *args, env=None, stdin=None, cwd=None):
    return subprocess.run([sys.executable, FS, "run", sock, *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **(env or {})), input=stdin, cwd=cwd)


def test_commands_run_as_python_would_run_them(server, tmp_path):
    sock, _ = server
    (tmp_path / "pkg").mkdir()
    script = tmp_path / "pkg" / "report.py"
    script.write_text(REPORT + "sys.exit(int(sys.argv[-1]))\n")
    res = _run(sock, str(script), "a", "3", env={"FOO": "bar"}, cwd=tmp_path)
    assert res.returncode == 3, res.stderr
    out = json.loads(res.stdout)
    assert out == {"argv": [str(script), "a", "3"], "path0": str(tmp_path / "pkg"), "name": "__main__",
                   "forked": True, "foo": "bar"}
    res = _run(sock, "-m", "pkg.report", "0", cwd=tmp_path)
    assert res.returncode == 0 and json.loads(res.stdout) == {
        "argv": [str(script), "0"], "path0": str(tmp_path), "name": "__main__", "forked": True, "foo": None}
    res = _run(sock, "-c", REPORT, "x", cwd=tmp_path)
    assert json.loads(res.stdout)["argv"] == ["-c", "x"] and json.loads(res.stdout)["path0"] == ""
    res = _run(sock, "-", "y", stdin=REPORT, cwd=tmp_path)
    assert res.returncode == 0 and json.loads(res.stdout)["argv"] == ["-", "y"], res.stderr
    # a start-up variable that differs from the server's: a fresh interpreter, the same command
    res = _run(sock, "-c", REPORT, "z", env={"PYTHONHASHSEED": "7", "FOO": "baz"}, cwd=tmp_path)
    assert json.loads(res.stdout) == {"argv": ["-c", "z"], "path0": "", "name": "__main__", "forked": False,
                                      "foo": "baz"}
    # ... but one of SETTINGS (torch reads it into one setting as it imports one module): forked
    res = _run(sock, "-c", REPORT, "w", env={"TORCH_COMPILE_DISABLE": "1", "TORCHINDUCTOR_MAX_AUTOTUNE": "1"})
    assert json.loads(res.stdout)["forked"] is True, res.stderr
    # the server's imports are frozen (gc.freeze): a forked command's collections skip them
    freeze = "import gc; print(gc.get_freeze_count())"
    assert int(_run(sock, "-c", freeze).stdout) > 0
    assert int(_run(sock, "-c", freeze, env={"PYTHONHASHSEED": "7"}).stdout) == 0  # a fresh interpreter
    # an uncaught exception and a signal, as the interpreter reports them
    res = _run(sock, "-c", "raise ValueError('boom')")
    assert res.returncode == 1 and "ValueError: boom" in res.stderr
    res = _run(sock, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert res.returncode == -signal.SIGKILL


def test_a_stopped_caller_stops_its_command_and_a_gone_server_is_named(server, tmp_path):
    sock, proc = server
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen(['sleep', '60'])\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(60)\n")
    caller = subprocess.Popen([sys.executable, FS, "run", sock, "-c", code], stdout=subprocess.PIPE, text=True)
    grandchild = int(caller.stdout.readline())
    caller.terminate()  # what gpu_check.sh's `timeout` does at a stage's limit
    caller.wait(timeout=10)
    deadline = time.monotonic() + 3  # SIGTERM at once (SIGKILL follows 5 s later)
    while time.monotonic() < deadline and _alive(grandchild):
        time.sleep(0.05)
    assert not _alive(grandchild), "the stopped caller's command group was left running"
    caller = subprocess.Popen([sys.executable, FS, "run", sock, "-c", "import time; print(1, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert caller.stdout.readline() == "1\n"
    proc.terminate()
    assert caller.wait(timeout=20) == 1 and "went away before the command finished" in caller.stderr.read()


def test_the_socket_listens_before_its_path_exists(tmp_path, monkeypatch):
    """A caller that finds the socket's path connects (it took a refused connection, bound but
    not yet listening, for a server that has exited: the suite's "has exited" failure)."""
    import socket

    forkserver = _module()
    path = str(tmp_path / "fs.sock")
    seen = []

    class Watched(socket.socket):  # the path at the moment the socket starts listening
        def listen(self, *args):
            seen.append(os.path.exists(path))
            return super().listen(*args)
    monkeypatch.setattr(forkserver.socket, "socket", Watched)
    (tmp_path / "fs.sock~").write_text("")  # a stale name of its own
    srv = forkserver.listening(path)
    try:
        assert seen == [False] and sorted(os.listdir(tmp_path)) == ["fs.sock"]
        caller = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        caller.connect(path)
        caller.close()
    finally:
        srv.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_settings_are_set_in_the_fork_as_torch_sets_them_on_import(monkeypatch):
    """SETTINGS' variables are forked (gpu_check's compiled and max-autotune stages) because torch
    reads each in one config module only, once, as ``os.environ.get(NAME) == "1"``: the source of
    this torch says so (a torch that reads them otherwise fails here, naming the variable), and
    apply_settings gives an imported module's setting the value a fresh import would (a module not
    imported is left to read the command's environment itself)."""
    import importlib
    import importlib.util
    import re
    import types

    forkserver = _module()
    torch_dir = os.path.dirname(importlib.util.find_spec("torch").origin)
    assert set(forkserver.SETTINGS) == {"TORCH_COMPILE_DISABLE", "TORCHINDUCTOR_MAX_AUTOTUNE"}
    # (sys.modules' entries back before torch's config modules are imported below: importing one
    # while its entry is out would make a second module object, bound to torch._dynamo.config
    # for the rest of the process while dynamo's own code and mock.patch use the first)
    with monkeypatch.context() as m:
        for name, (module, setting) in forkserver.SETTINGS.items():
            src = open(os.path.join(torch_dir, *module.split(".")[1:]) + ".py").read()
            assert src.count(f'"{name}"') == 1, (name, module)
            assert re.search(rf'^{setting} = os\.environ\.get\("{name}"(, "0")?\) == "1"$', src, re.MULTILINE), \
                (name, module)
            fake = types.SimpleNamespace(**{setting: False})
            m.setitem(sys.modules, module, fake)
            forkserver.apply_settings({name: "1"})
            assert getattr(fake, setting) is True, name
            forkserver.apply_settings({name: "0"})
            assert getattr(fake, setting) is False, name
            setattr(fake, setting, True)
            forkserver.apply_settings({})
            assert getattr(fake, setting) is False, name
            m.delitem(sys.modules, module)
            forkserver.apply_settings({name: "1"})  # not imported: nothing to set
    # torch's own config modules: the setting reaches every thread (an assignment there holds in the
    # assigning thread only; inductor compiles in threads of its own), then back to this process's
    import threading

    import torch._dynamo.config
    import torch._inductor.config
    mods = [importlib.import_module(module) for module, _ in forkserver.SETTINGS.values()]
    try:
        forkserver.apply_settings(dict.fromkeys(forkserver.SETTINGS, "1"))
        seen = []
        thread = threading.Thread(target=lambda: seen.extend(getattr(m, s) for m, (_, s) in
                                                             zip(mods, forkserver.SETTINGS.values())))
        thread.start()
        thread.join()
        assert seen == [True, True] and [getattr(m, s) for m, (_, s) in zip(mods, forkserver.SETTINGS.values())] \
            == [True, True], seen
    finally:
        forkserver.apply_settings(os.environ)
    assert torch._dynamo.config.disable is (os.environ.get("TORCH_COMPILE_DISABLE") == "1")
    assert torch._inductor.config.max_autotune is (os.environ.get("TORCHINDUCTOR_MAX_AUTOTUNE") == "1")
