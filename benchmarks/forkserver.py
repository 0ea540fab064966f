#!/usr/bin/env python3
"""Python commands forked from one interpreter that has imported torch once (the dry run of
benchmarks/gpu_check.sh).

    python benchmarks/forkserver.py serve SOCKET [MODULE...]  # imports torch (or MODULEs), serves
                                                              # until its parent process exits
    python benchmarks/forkserver.py run SOCKET ARGS...   # `python ARGS...`, forked from the server

Why: the dry run runs about 30 Python commands on the CPU, and on the 2-core CPU machine each
spent ~1.5 s importing torch and, where it trains (its optimizer imports it), ~1.3 s more
importing ``torch._dynamo``: more than half of the dry run. The server imports both once; each
command is a fork of it that runs the same script as ``__main__`` with the same arguments,
environment, working directory and stdin / stdout / stderr (passed over the socket), and
``run`` exits with the command's status (a command killed by a signal kills ``run`` with it).
When ``run`` is stopped (``timeout`` in gpu_check.sh), the server stops the command's process
group: SIGTERM, SIGKILL 5 s later. The server freezes what it imported (``gc.freeze``): a
command's garbage collections leave those objects alone (a fork copies the pages they touch).

``ARGS`` is what ``python`` would be given: ``SCRIPT [ARG...]``, ``-m MODULE [ARG...]``,
``-c CODE [ARG...]`` or ``- [ARG...]`` (the code on stdin). The command is started as a fresh
interpreter instead (``execve`` of the same command line, nothing forked) where a fork would not
run it the same way: another form of arguments (interpreter options), an environment that
differs from the server's in a variable that the interpreter, torch or the numerical libraries
read when they start (the prefixes in STARTUP_PREFIXES), or a Python thread in the server (a fork
keeps only the calling thread). The exceptions are the variables of SETTINGS, each of which torch
reads once, when one of its config modules is imported, into one setting (gpu_check's
``TORCH_COMPILE_DISABLE=1`` and ``TORCHINDUCTOR_MAX_AUTOTUNE=1`` stages): such a command is forked
and that setting set as the import would have set it from the command's environment.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

PRELOAD = ("torch", "torch._dynamo")
# variables read at start-up by the interpreter, torch (and its compiler's configs), OpenMP/BLAS
STARTUP_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "TRITON", "CUDA", "NCCL", "OMP_", "KMP_", "GOMP_", "MKL_",
                    "OPENBLAS_", "LD_", "MALLOC_")
IGNORED = {"_"}  # bash's last argument of the previous command
# variable -> (module, setting): torch (2.13) reads each of these variables in that module only,
# once, as `setting = os.environ.get(VARIABLE) == "1"` (tests/test_forkserver.py checks the
# source); a forked command gets the setting its environment gives (a module not imported in the
# server reads the command's environment when the command imports it)
SETTINGS = {"TORCH_COMPILE_DISABLE": ("torch._dynamo.config", "disable"),
            "TORCHINDUCTOR_MAX_AUTOTUNE": ("torch._inductor.config", "max_autotune")}
GRACE_S = 5.0


def startup_differences(env: dict, base: dict) -> list[str]:
    """The variables read at start-up whose values differ between ``env`` and ``base``."""
    keys = {k for k in set(env) | set(base) if env.get(k) != base.get(k)} - IGNORED
    return sorted(k for k in keys if k.startswith(STARTUP_PREFIXES))


def apply_settings(env: dict) -> None:
    """Each setting of SETTINGS whose module is imported: as that import would set it from ``env``,
    for every thread. In torch's config modules an assignment holds in the assigning thread only
    (a ContextVar: threads started later, such as inductor's compile workers, would see the
    server's value), so there the setting's default is what changes, as the import sets it."""
    for name, (module, setting) in SETTINGS.items():
        mod = sys.modules.get(module)
        if mod is None:
            continue
        value = env.get(name) == "1"
        entry = getattr(mod, "_config", {}).get(setting)
        if entry is None:  # a plain module
            setattr(mod, setting, value)
            continue
        entry.default = value
        _mark_changed(mod)


def _mark_changed(mod) -> None:
    """Tells torch's config module ``mod`` that a setting changed (its cached hash, part of
    compiled code's cache keys, is recomputed): torch 2.12 and later keep that flag in a
    ContextVar, torch 2.11 (the GPU machines') in a plain attribute."""
    if hasattr(mod, "_hash_dirty_var"):
        mod._hash_dirty_var.set(True)
    elif hasattr(mod, "_is_dirty"):
        mod._is_dirty = True
    else:
        raise RuntimeError(f"forkserver: {mod.__name__} has neither _hash_dirty_var nor _is_dirty (torch changed: "
                           "benchmarks/forkserver.py, apply_settings)")


def _exit_status(code) -> int:
    """``SystemExit.code`` as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_as_main(argv: list[str]) -> int:
    """``python ARGV`` in this process, from the point where the interpreter runs ``__main__``."""
    import builtins
    import runpy
    import types

    first, rest = argv[0], argv[1:]
    try:
        if first == "-m":
            sys.argv = [first, *rest[1:]]  # run_module puts the module's file in argv[0]
            sys.path[0] = os.getcwd()
            runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
        elif first in ("-c", "-"):
            code = rest[0] if first == "-c" else sys.stdin.read()
            sys.argv = [first, *(rest[1:] if first == "-c" else rest)]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = builtins
            sys.modules["__main__"] = main
            exec(compile(code, "<string>" if first == "-c" else "<stdin>", "exec"), main.__dict__)
        else:
            sys.argv = [first, *rest]
            sys.path[0] = os.path.dirname(os.path.realpath(first))
            runpy.run_path(first, run_name="__main__")
        status = 0
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 130
    except BaseException:  # noqa: BLE001 - the interpreter's own report of an uncaught exception
        sys.excepthook(*sys.exc_info())
        status = 1
    # the interpreter's exit: wait for non-daemon threads, run the atexit functions, flush
    import atexit
    import threading
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    return status


def _valid_form(argv: list[str]) -> bool:
    if not argv:
        return False
    if argv[0] in ("-m", "-c"):
        return len(argv) >= 2
    return argv[0] == "-" or not argv[0].startswith("-")


def _child(req: dict, fds: list[int], base: dict, preset: dict) -> int:
    """The forked command: its stdio, directory and environment, then exec or run in place.
    ``base``: the server's environment before its imports; ``preset``: what they set in it."""
    os.setpgid(0, 0)  # its own process group, stopped as a whole when its caller goes
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a background server ignores it
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server's own handler
    os.chdir(req["cwd"])
    argv, env = req["argv"], req["env"]
    import threading
    differs = [k for k in startup_differences(env, base) if k not in SETTINGS]
    if not _valid_form(argv) or differs or threading.active_count() > 1:
        os.execve(sys.executable, [sys.executable, *argv], env)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(preset)  # as the imports would set them in a fresh interpreter
    apply_settings(env)
    return _run_as_main(argv)


def listening(path: str) -> socket.socket:
    """The server's socket, listening before ``path`` names it: bound at a name of its own, then
    renamed. A caller that finds ``path`` can connect; a socket bound at ``path`` and listening
    only after refuses a caller that comes between the two, which :func:`run` must take for a
    server that has exited."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    tmp = path + "~"
    if os.path.exists(tmp):  # (left by a server killed between the two)
        os.unlink(tmp)
    srv.bind(tmp)
    srv.listen(64)
    os.rename(tmp, path)
    return srv


def serve(path: str, preload: tuple[str, ...] = PRELOAD) -> int:
    """Import ``preload``, then fork a child per request until the parent process is gone."""
    import gc
    import importlib
    import select

    parent = os.getppid()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stopped: its commands are stopped too
    srv = listening(path)  # before the imports: the first callers wait in the backlog
    base = dict(os.environ)
    for name in preload:
        importlib.import_module(name)
    # what the imports set (torch._inductor: TORCHINDUCTOR_CACHE_DIR), set again in each command
    preset = {k: v for k, v in os.environ.items() if base.get(k) != v}
    # the imports' objects out of the collector's reach (the permanent generation): a command's
    # collections then skip them instead of touching, and so copying, every page of torch's heap
    # (a pytest run collects twice as it ends: ~0.6 s of the 2-core machine a run, otherwise)
    gc.collect()
    gc.freeze()
    open(path + ".ready", "w").close()  # for a caller that waits for the imports before its clock starts
    jobs: dict[int, list] = {}  # pidfd -> [pid, conn or None, kill deadline or None]
    try:
        while os.getppid() == parent:
            waiting = [job[1] for job in jobs.values() if job[1] is not None]
            ready, _, _ = select.select([srv, *jobs, *waiting], [], [], 1.0)
            for x in ready:
                if x is srv:
                    conn, _ = srv.accept()
                    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        status = 1
                        try:
                            srv.close()
                            conn.close()
                            for job in jobs.values():
                                if job[1] is not None:
                                    job[1].close()
                            status = _child(json.loads(msg), fds, base, preset)
                        finally:
                            os._exit(status)
                    for fd in fds:
                        os.close(fd)
                    try:
                        os.setpgid(pid, pid)
                    except OSError:
                        pass  # the child has already set it (or exec'd)
                    jobs[os.pidfd_open(pid)] = [pid, conn, None]
                elif isinstance(x, int):  # a command has finished
                    pid, conn, _ = jobs.pop(x)
                    os.close(x)
                    _, st = os.waitpid(pid, 0)
                    if conn is not None:
                        reply = {"signal": os.WTERMSIG(st)} if os.WIFSIGNALED(st) else {"exit": os.WEXITSTATUS(st)}
                        try:
                            conn.send(json.dumps(reply).encode())
                        except OSError:
                            pass
                        conn.close()
                else:  # the caller is gone (stopped): stop its command
                    for job in jobs.values():
                        if job[1] is x:
                            x.close()
                            job[1] = None
                            job[2] = time.monotonic() + GRACE_S
                            _kill(job[0], signal.SIGTERM)
            now = time.monotonic()
            for job in jobs.values():
                if job[2] is not None and now > job[2]:
                    _kill(job[0], signal.SIGKILL)
                    job[2] = None
    finally:
        for job in jobs.values():
            _kill(job[0], signal.SIGKILL)
        srv.close()
        for name in (path, path + ".ready"):
            try:
                os.unlink(name)
            except OSError:
                pass
    return 0


def _kill(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except OSError:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def run(path: str, argv: list[str], wait_s: float = 60.0) -> int:
    """``python ARGV`` forked from the server at ``path``; its exit status (or its signal)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            sock.connect(path)
            break
        except FileNotFoundError:  # the server has not bound its socket yet
            if time.monotonic() > deadline:
                print(f"forkserver: no server at {path} after {wait_s:.0f} s", file=sys.stderr)
                return 1
            time.sleep(0.02)
        except ConnectionRefusedError:
            print(f"forkserver: the server at {path} has exited", file=sys.stderr)
            return 1
    req = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(sock, [json.dumps(req).encode()], [0, 1, 2])
    msg = sock.recv(4096)
    if not msg:
        print(f"forkserver: the server at {path} went away before the command finished", file=sys.stderr)
        return 1
    reply = json.loads(msg)
    if "signal" in reply:
        try:
            signal.signal(reply["signal"], signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL, SIGSTOP: always their default
        os.kill(os.getpid(), reply["signal"])
        return 128 + reply["signal"]
    return reply["exit"]


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "serve":
        return serve(argv[1], tuple(argv[2:]) or PRELOAD)
    if len(argv) >= 3 and argv[0] == "run":
        return run(argv[1], argv[2:])
    print("usage:\n" + __doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
