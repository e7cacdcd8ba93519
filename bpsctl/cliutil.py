"""Pieces every bpsctl command group shares: config from flags, error reporting, the console."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import signal
import sys
import threading
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import typer
from rich.console import Console
from rich.markup import escape

from bpsctl.config import (
    CONFIG_FILE_ENV,
    Config,
    ConfigError,
    default_config_file,
    find_config_file,
)
from bpsctl.errors import BpsctlError

err_console = Console(stderr=True)

_KNOBS = {f.name: f for f in dataclasses.fields(Config)}

#: libraries whose log records would otherwise reach the terminal through logging's "last
#: resort" (a paramiko transport thread's traceback for a host that does not speak SSH, say),
#: ahead of bpsctl's own one-line error that already names the cause
LIBRARY_LOGGERS = ("paramiko", "fabric", "invoke", "kubernetes", "urllib3")

#: the file in the state dir that library log records go to (see :func:`route_library_logs`)
LIBRARY_LOG = "bpsctl-libraries.log"


class _StateDirLog(logging.FileHandler):
    """Appends to a file in the state dir, made on the first record (most commands log none);
    a record that cannot be written is dropped rather than disturb the command."""

    def _open(self) -> Any:
        Path(self.baseFilename).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        return super()._open()

    def handleError(self, record: logging.LogRecord) -> None:
        pass


def route_library_logs(state_dir: Path | None, debug: bool) -> Path:
    """Send the records of :data:`LIBRARY_LOGGERS` to ``state_dir`` (None: the default
    one)/:data:`LIBRARY_LOG` (and, with ``debug``, to stderr as well) instead of the
    terminal; return that file's path."""
    directory = Path(str(_KNOBS["state_dir"].default)) if state_dir is None else state_dir
    path = Path(directory).expanduser() / LIBRARY_LOG
    handlers: list[logging.Handler] = [_StateDirLog(path, delay=True)]
    if debug:
        handlers.append(logging.StreamHandler())
    for handler in handlers:
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            if isinstance(old, _StateDirLog) or getattr(old, "_bpsctl", False):
                logger.removeHandler(old)
        for handler in handlers:
            handler._bpsctl = True      # type: ignore[attr-defined]
            logger.addHandler(handler)
        logger.propagate = False
        if debug:
            logger.setLevel(logging.DEBUG)
    return path


def knob_option(knob_name: str, *flags: str, **option_kwargs: Any) -> Any:
    """A ``typer.Option`` for the Config knob ``knob_name``: its env var and help, default None
    so that an unset flag leaves the knob to the environment or Config's default."""
    knob = _KNOBS[knob_name]
    help_text = knob.metadata["help"]
    # an empty default (e.g. --nic: unshaped) is said by the help text, not as "()"
    return typer.Option(None, *flags, envvar=knob.metadata["env"], show_envvar=True,
                        show_default=str(knob.default) if knob.default != "" else False,
                        help=help_text[0].upper() + help_text[1:],
                        **option_kwargs)


def config_file_option() -> Any:
    """``--config FILE``: the tuned config file a command reads (see :func:`build_config`)."""
    return typer.Option(None, "--config", metavar="FILE",
                        help=f"Tuned config file (`bpsctl tune` writes one). Default: "
                             f"${CONFIG_FILE_ENV}, else {default_config_file()} if it exists. "
                             "Flags and BPSCTL_* variables override its values.")


def build_config(ctx: typer.Context, flags: dict[str, tuple[Any, str]],
                 config_file: Path | None = None, read_file: bool = False) -> Config:
    """Config from the flags given, over the environment, over a tuned config file.

    ``flags`` maps a knob to (value or None, the flag that sets it), so that an invalid value
    is reported under the flag's name as well as the env var's. With ``read_file`` (the
    commands that start engine processes: up, run, bench, tune) the config file is
    ``config_file`` (``--config``), else the default location if a file is there.
    """
    overrides = {name: value for name, (value, _) in flags.items() if value is not None}
    state_dir = ctx.obj.get("state_dir") if ctx.obj else None
    if state_dir is not None:
        overrides["state_dir"] = Path(state_dir).expanduser()
    file = find_config_file(config_file) if read_file or config_file is not None else None
    try:
        return Config.from_env(file=file, **overrides)
    except ConfigError as exc:
        message = str(exc)
        for name, (_, flag) in {**flags, "state_dir": (None, "--state-dir")}.items():
            env = _KNOBS[name].metadata["env"]
            if message.startswith(f"{env}:"):
                message = f"{flag} / {message}"
        raise ConfigError(message) from None


def _print_error(exc: Exception) -> None:
    # soft_wrap: long paths and quoted log lines stay whole, to copy and paste
    err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Report bpsctl's own errors in one line and exit with the error's code: 2 for usage or
    configuration, 1 at run time (:mod:`bpsctl.errors`)."""
    try:
        yield
    except BpsctlError as exc:
        _print_error(exc)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt as exc:     # launch.Interrupted carries SIGINT or SIGTERM
        signum = getattr(exc, "signum", signal.SIGINT)
        err_console.print(f"interrupted ({signal.Signals(signum).name}); stopped what was started")
        raise typer.Exit(128 + signum) from None


#: python's options that take a value as the next word (python -X dev script.py)
_PYTHON_VALUE_OPTIONS = frozenset({"-W", "-X", "--check-hash-based-pycs"})


def missing_python_script(cmd: list[str], cwd: Path) -> str | None:
    """The script of a ``python SCRIPT ...`` worker command when it does not exist (relative
    to ``cwd``), else None: checked before anything starts, so a typo is a usage error of
    `run` rather than every worker's own exit 2 after a cluster came up. Commands that are not
    python, and ``-m``/``-c``/stdin ones, are left to run."""
    if not cmd or not Path(cmd[0]).name.startswith("python"):
        return None
    words = iter(cmd[1:])
    for word in words:
        if word in _PYTHON_VALUE_OPTIONS:
            next(words, None)
        elif word == "-" or word.startswith(("-c", "-m")):
            return None
        elif not word.startswith("-"):
            return None if (cwd / word).exists() else word
    return None


#: what a value option's value is, by flag, where its type alone would say little
_METAVARS = {
    **dict.fromkeys(("--size", "--partition-bytes", "--credit-bytes", "--worker-memory",
                     "--server-memory"), "SIZE"),
    **dict.fromkeys(("--worker-cpu", "--server-cpu"), "CPUS"),
    **dict.fromkeys(("--image", "--server-image"), "IMAGE"),
    **dict.fromkeys(("--name", "--namespace"), "NAME"),
    **dict.fromkeys(("--worker-hostfile", "--server-hostfile"), "FILE"),
    "--nic": "RATE", "--cpu-share": "SHARE", "--straggler": "RANK:FACTOR",
    "--security": "MODE", "--compare": "SYSTEMS", "--hosts": "HOSTS", "--port": "PORT",
    "--state-dir": "DIR", "--start-timeout": "SECONDS", "--seed": "N",
}


def _metavar(flag: str, kind: Any) -> str:
    """A value option's metavar: :data:`_METAVARS`, else N for whole numbers, X for other
    numbers, PATH for paths and TEXT otherwise (typer's default, ``<int range>``, reads as if
    the option took a range)."""
    if flag in _METAVARS:
        return _METAVARS[flag]
    kinds = set(typing.get_args(kind)) - {type(None)} or {kind}
    if kinds <= {int}:
        return "N"
    if kinds <= {int, float}:
        return "X"
    return "PATH" if kinds <= {Path} else "TEXT"


def name_metavars(apps: list[typer.Typer]) -> None:
    """Give every value option of ``apps``' commands without a metavar one that says what it
    takes (:func:`_metavar`); switches stay switches."""
    for each in apps:
        callbacks = [c.callback for c in each.registered_commands]
        if each.registered_callback is not None:
            callbacks.append(each.registered_callback.callback)
        for callback in filter(None, callbacks):
            hints = typing.get_type_hints(callback)
            for name, param in inspect.signature(callback).parameters.items():
                info = param.default
                kind = hints.get(name)
                if not isinstance(info, typer.models.OptionInfo) or info.metavar is not None \
                        or kind in (bool, bool | None):
                    continue
                flags = [d for d in info.param_decls or () if d.startswith("--")]
                info.metavar = _metavar(flags[0] if flags else "", kind)


class _StopOnWrite:
    """A text stream that calls ``stop`` before each write (``stop`` acts once)."""

    def __init__(self, stream: IO[str], stop: Callable[[], None]):
        self._stream, self._stop = stream, stop

    def write(self, text: str) -> int:
        self._stop()
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def status_until_output(text: str) -> Iterator[tuple[IO[str], IO[str]]]:
    """A transient status line on stderr (on a terminal; nothing otherwise) until the first
    write to the yielded (stdout, stderr): a command whose output comes from its workers says
    what it is doing while they start, then gets out of their way. The streams are the real
    ones, taken before the status line starts (rich would send stdout to stderr meanwhile)."""
    out, err = sys.stdout, sys.stderr
    status = err_console.status(text)
    status.start()
    lock = threading.Lock()
    stopped = False

    def stop() -> None:
        nonlocal stopped
        with lock:
            if not stopped:
                stopped = True
                status.stop()

    try:
        yield _StopOnWrite(out, stop), _StopOnWrite(err, stop)  # type: ignore[misc]
    finally:
        stop()
