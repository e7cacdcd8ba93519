"""The agent ``bpsctl up --hosts`` runs on each host over SSH:
``python -m bpsctl.launch.remote CMD``.

It reads one JSON line on stdin (so secrets never appear in a command line) and answers one
JSON line on stdout, except ``listen`` (a first line, then waits for stdin to close) and
``exec`` (a first line with the worker's pid, then the worker's output; it stops the worker's
process group when stdin closes, i.e. when the launcher hangs up or goes away).

Commands: ``check`` (version, interface/address, ports free), ``listen`` (hold ports open for
the reachability check), ``connect`` (open TCP connections), ``start`` (a detached scheduler or
server), ``ps``, ``stop``, ``scheduler`` (ask the local scheduler, optionally waiting for
servers), ``exec`` (one worker).
"""
from __future__ import annotations

import fcntl
import importlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import bpsctl

PROTOCOL = 1
_SIOCGIFADDR = 0x8915


def _reply(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


def _interface_address(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def _bind_problem(address: str, port: int) -> str | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # as ZeroMQ binds: connections of an earlier cluster in TIME_WAIT do not block the port
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        return None
    except OSError as exc:
        if port and exc.errno == 98:
            return f"port {port} is in use on {address}"
        return f"cannot bind {address}:{port} ({exc.strerror})"
    finally:
        sock.close()


#: what the scheduler, the servers and the agent's own commands import: all of bpsctl's
#: dependencies they need (the agent itself imports no more than it must, to start quickly)
_ROLE_MODULES = ("bpsctl.engine.scheduler", "bpsctl.engine.server", "bpsctl.launch.processes")


def _import_error() -> dict[str, Any] | None:
    """Why this Python cannot import what the roles run (a missing numpy or pyzmq), if so."""
    for module in _ROLE_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "module": exc.name}
    return None


def cmd_check(spec: dict[str, Any]) -> dict[str, Any]:
    """Version, whether the roles' modules import, the address to bind (from an interface),
    and whether ports are free."""
    problems = []
    address = spec.get("address")
    interface = spec.get("interface")
    if interface:
        found = _interface_address(interface)
        if found is None:
            problems.append(f"interface {interface} does not exist or has no IPv4 address "
                            f"(interfaces: {', '.join(_interfaces())})")
        else:
            address = found
    if address and not problems:
        try:
            resolved = socket.gethostbyname(address)
        except OSError:
            resolved = None
            problems.append(f"cannot resolve {address}")
        if resolved:
            problem = _bind_problem(resolved, 0)
            if problem:
                problems.append(f"address {address} is not on this host ({problem})")
            address = resolved
    if address and not problems:
        for port in spec.get("ports", []):
            problem = _bind_problem(address, int(port))
            if problem:
                problems.append(problem)
    return {"version": bpsctl.__version__, "protocol": PROTOCOL, "python": sys.executable,
            "hostname": socket.gethostname(), "address": address, "problems": problems,
            "import_error": _import_error()}


def cmd_listen(spec: dict[str, Any]) -> None:
    """Bind every port, say so, accept connections until stdin closes (or ``hold_s``)."""
    sockets = []
    problems = []
    for port in spec["ports"]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((spec["address"], int(port)))
            sock.listen(64)
            sockets.append(sock)
        except OSError as exc:
            sock.close()
            problems.append(f"port {port} is in use on {spec['address']}" if exc.errno == 98
                            else f"cannot listen on {spec['address']}:{port} ({exc.strerror})")
    _reply({"problems": problems})
    stop = threading.Event()

    def accept(sock: socket.socket) -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            # let the peer close first, so no TIME_WAIT is left on the port the scheduler or
            # a server binds next
            threading.Thread(target=drain, args=(conn,), daemon=True).start()

    def drain(conn: socket.socket) -> None:
        conn.settimeout(2.0)
        try:
            while conn.recv(4096):
                pass
        except OSError:
            pass
        finally:
            conn.close()

    threads = [threading.Thread(target=accept, args=(s,), daemon=True) for s in sockets]
    for thread in threads:
        thread.start()
    done = threading.Thread(target=sys.stdin.read, daemon=True)
    done.start()
    done.join(float(spec.get("hold_s", 60)))
    stop.set()
    for sock in sockets:
        sock.close()


def cmd_connect(spec: dict[str, Any]) -> dict[str, Any]:
    """Open (and close) a TCP connection to each ``[address, port, what]``."""
    timeout_s = float(spec.get("timeout_s", 3))
    problems = []
    for address, port, what in spec["targets"]:
        try:
            sock = socket.create_connection((address, int(port)), timeout=timeout_s)
        except OSError as exc:
            reason = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc))
            problems.append(f"cannot open a TCP connection to {what} at {address}:{port} "
                            f"({reason})")
            continue
        sock.close()
    return {"problems": problems}


def _expand(path: str) -> Path:
    return Path(os.path.expanduser(path))


def cmd_start(spec: dict[str, Any]) -> dict[str, Any]:
    """Start one scheduler or server detached, in its own process group, output to its log."""
    import psutil
    log = _expand(spec["log"])
    log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    env = {**os.environ, **spec["env"]}
    env["BPSCTL_STATE_DIR"] = str(_expand(env.get("BPSCTL_STATE_DIR", "~/.bpsctl")))
    with open(log, "wb") as out:
        process = subprocess.Popen(spec["argv"], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   cwd=str(log.parent))
    create_time = psutil.Process(process.pid).create_time()
    record = {"pid": process.pid, "pgid": process.pid, "create_time": create_time,
              "log": str(log)}
    pidfile = log.with_suffix(".pid")
    pidfile.write_text(json.dumps(record))
    return record


def _identity(record: dict[str, Any]):
    from bpsctl.launch.processes import ProcessIdentity
    return ProcessIdentity(pid=int(record["pid"]), pgid=int(record["pgid"]),
                           create_time=float(record["create_time"]))


def cmd_ps(spec: dict[str, Any]) -> dict[str, Any]:
    from bpsctl.launch.processes import is_running
    return {"running": [is_running(_identity(r)) for r in spec["records"]]}


def _marked(secret: str) -> list[int]:
    """Processes whose environment carries this cluster's secret: everything it started."""
    if not secret:
        return []
    marker = f"BPSCTL_SECRET={secret}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def cmd_stop(spec: dict[str, Any]) -> dict[str, Any]:
    """Stop the recorded process groups, then anything else carrying the cluster's secret."""
    from bpsctl.launch.processes import stop_groups
    grace_s = float(spec.get("grace_s", 5))
    survivors = stop_groups([_identity(r) for r in spec["records"]], grace_s)
    left = [i.pid for i in survivors]
    stray = _marked(spec.get("secret", ""))
    for pid in stray:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    while stray and time.monotonic() < deadline:
        stray = _marked(spec.get("secret", ""))
        time.sleep(0.05)
    for record in spec["records"]:
        if record.get("log"):
            _expand(record["log"]).with_suffix(".pid").unlink(missing_ok=True)
    return {"survivors": left, "stray": stray}


def cmd_scheduler(spec: dict[str, Any]) -> dict[str, Any]:
    """The scheduler's view, waiting up to ``timeout_s`` for ``servers`` to have registered."""
    deadline = time.monotonic() + float(spec.get("timeout_s", 2))
    wanted = int(spec.get("servers", 0))
    supervision = None          # the scheduler's supervisor's record (engine/supervise.py)
    if spec.get("record"):
        try:
            supervision = json.loads(_expand(spec["record"]).read_text())
        except (OSError, ValueError):
            pass
    answer = _scheduler_view(spec, deadline, wanted)
    return {**answer, "supervision": supervision} if supervision is not None else answer


def _scheduler_view(spec: dict[str, Any], deadline: float, wanted: int) -> dict[str, Any]:
    from bpsctl.config import DEFAULT_SECURITY
    from bpsctl.engine import EngineError
    from bpsctl.engine.client import scheduler_status
    from bpsctl.launch.processes import is_running
    watch = [(r["name"], _identity(r), r.get("log")) for r in spec.get("watch", [])]
    error = ""
    while True:
        for name, identity, log in watch:
            if not is_running(identity):
                return {"error": f"{name} (pid {identity.pid}) exited while starting",
                        "exited": name, "log_tail": _tail(log)}
        try:
            view = scheduler_status(spec["address"], spec["secret"],
                                    timeout_s=max(0.2, min(1.0, deadline - time.monotonic())),
                                    security=spec.get("security", DEFAULT_SECURITY))
            registered = sum(1 for s in view["servers"] if s["state"] in ("running", "spare"))
            if registered >= wanted:
                return {"view": view}
            error = f"{registered} of {wanted} servers registered"
        except EngineError as exc:
            error = str(exc)
        if time.monotonic() > deadline:
            return {"error": error}
        time.sleep(0.05)


def _tail(log: str | None, lines: int = 15) -> str:
    if not log:
        return ""
    try:
        with open(_expand(log), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def cmd_exec(spec: dict[str, Any]) -> int:
    """Run one worker in its own process group; relay its output; stop it when stdin closes."""
    from bpsctl.launch.processes import identify, stop_groups
    env = {**os.environ, **spec["env"]}
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")    # `python` is the configured one
    cwd = spec.get("cwd")
    if not cwd or not os.path.isdir(cwd):
        cwd = os.path.expanduser("~")
    try:
        process = subprocess.Popen(spec["argv"], env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                                   start_new_session=True)
    except OSError as exc:
        _reply({"error": f"cannot start {spec['argv'][0]}: {exc.strerror}"})
        return 127
    identity = identify(process.pid)
    _reply({"pid": process.pid})

    def relay(pipe: Any, out: Any) -> None:
        for line in iter(pipe.readline, b""):
            out.write(line)
            out.flush()

    relays = [threading.Thread(target=relay, args=(process.stdout, sys.stdout.buffer), daemon=True),
              threading.Thread(target=relay, args=(process.stderr, sys.stderr.buffer), daemon=True)]
    for thread in relays:
        thread.start()
    hangup = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.buffer.read()
        hangup.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    while process.poll() is None and not hangup.wait(0.05):
        pass
    stop_groups([identity], float(spec.get("grace_s", 5)))
    code = process.wait()
    for thread in relays:
        thread.join(2)
    return code if code >= 0 else 128 - code


COMMANDS = {"check": cmd_check, "connect": cmd_connect, "start": cmd_start, "ps": cmd_ps,
            "stop": cmd_stop, "scheduler": cmd_scheduler}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in (*COMMANDS, "listen", "exec", "version"):
        print(f"usage: python -m bpsctl.launch.remote "
              f"{{{'|'.join((*COMMANDS, 'listen', 'exec', 'version'))}}} < spec.json",
              file=sys.stderr)
        return 2
    if argv[0] == "version":
        _reply({"version": bpsctl.__version__, "protocol": PROTOCOL, "python": sys.executable})
        return 0
    line = sys.stdin.readline()
    try:
        spec = json.loads(line)
    except ValueError:
        print("bpsctl agent: expected one JSON line on stdin", file=sys.stderr)
        return 2
    if argv[0] in ("listen", "exec"):
        # a daemon thread is still blocked reading stdin: leave without the interpreter's
        # shutdown, which would wait on that stdin's lock
        if argv[0] == "exec":
            code = cmd_exec(spec)
        else:
            cmd_listen(spec)
            code = 0
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _reply(COMMANDS[argv[0]](spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
