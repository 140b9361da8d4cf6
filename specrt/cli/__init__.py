"""The `specrt` command line: one module per command, registered here."""

from __future__ import annotations

import sys

import click

from specrt import __version__
from specrt.errors import SpecrtError
from specrt.paths import HOME_HELP

COMMAND_MODULES = ("export_cmd", "distill_cmd", "train_cmd", "build_cmd", "generate_cmd", "bench_cmd", "tune_cmd", "validate_cmd",
                   "doctor_cmd", "serve_cmd", "export_triton_cmd", "bench_serve_cmd", "serve_triton_cmd",
                   "prompts_cmd", "code_prompts_cmd", "text_prompts_cmd", "answers_cmd")


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=HOME_HELP)
@click.version_option(__version__, prog_name="specrt")
def cli() -> None:
    """specrt: speculative decoding, exported to ONNX / TensorRT and served losslessly."""


def register(group: click.Group, modules: tuple[str, ...]) -> None:
    """Add the `command` of each `specrt.cli.<module>` to `group`."""
    import importlib

    for name in modules:
        group.add_command(importlib.import_module(f"specrt.cli.{name}").command)


register(cli, COMMAND_MODULES)


def run(group: click.Group, prog: str) -> None:
    """Run a click `group` as a program: a `SpecrtError` is one line `PROG: error: ...` and exit 1, Ctrl-C
    exits 130, click's usage errors keep their own message and code. `specrt` and `specrt-run` share it."""
    try:
        group.main(prog_name=prog, standalone_mode=False)
    except SpecrtError as e:
        click.echo(f"{prog}: error: {e}", err=True)
        sys.exit(1)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)


def main() -> None:
    run(cli, "specrt")
