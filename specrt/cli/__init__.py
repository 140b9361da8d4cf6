"""The `specrt` command line: one module per command, registered here."""

from __future__ import annotations

import sys

import click

from specrt import __version__
from specrt.errors import SpecrtError

COMMAND_MODULES = ("export_cmd", "train_cmd", "build_cmd", "generate_cmd", "bench_cmd", "tune_cmd", "validate_cmd",
                   "doctor_cmd")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specrt")
def cli() -> None:
    """specrt: speculative decoding, exported to ONNX / TensorRT and served losslessly."""


def _register() -> None:
    import importlib

    for name in COMMAND_MODULES:
        module = importlib.import_module(f"specrt.cli.{name}")
        cli.add_command(module.command)


_register()


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except SpecrtError as e:
        click.echo(f"specrt: error: {e}", err=True)
        sys.exit(1)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
