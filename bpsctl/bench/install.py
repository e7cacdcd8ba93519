"""`bpsctl install horovod`: build the baselines the benchmarks compare against.

Mount in bpsctl/cli.py with ``app.add_typer(install_app, name="install")``.
"""
from __future__ import annotations

import sys

import typer

from bpsctl.cliutil import cli_errors, err_console

from .horovod import HOROVOD_VERSION, install, nccl_built

install_app = typer.Typer(no_args_is_help=True, add_completion=False,
                          help="Build the baselines that `bpsctl bench --compare` runs.")


@install_app.command()
def horovod(version: str = typer.Option(HOROVOD_VERSION, "--version",
                                        help="Horovod release to build from its sdist."),
            force: bool = typer.Option(False, "--force",
                                       help="Rebuild even if this version already loads."),
            ) -> None:
    """Horovod with PyTorch and Gloo (no MPI, TensorFlow or MXNet), and NCCL for CUDA tensors
    where a CUDA toolkit and NCCL are found, built from its sdist with CMAKE_CXX_STANDARD raised
    to 17 for torch 2.13's headers (about 150 s)."""
    with cli_errors():
        installed = install(version, output=sys.stderr, force=force)
        ops = "PyTorch + Gloo + NCCL" if nccl_built() else "PyTorch + Gloo"
        err_console.print(f"horovod {installed} is installed ({ops})", highlight=False)
