"""Every command answers --help; the command set is what README documents."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from specrt.cli import cli

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize("name", sorted(cli.commands))
def test_help(name):
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output and name in result.output


def test_group_help_lists_every_command():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for name in cli.commands:
        assert name in result.output


def test_readme_documents_every_command():
    text = README.read_text()
    documented = set(re.findall(r"specrt ([\w-]+)", text))
    missing = set(cli.commands) - documented
    assert not missing, f"README does not mention: {sorted(missing)}"


def test_doctor_reports_tensorrt_state():
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "onnxruntime" in result.output and "tensorrt" in result.output


@pytest.mark.parametrize("name", ["generate", "serve", "bench", "bench-serve", "validate"])
def test_commands_that_load_a_bundle_offer_verify(name):
    result = CliRunner().invoke(cli, [name, "--help"])
    assert "--verify" in result.output and "SHA-256" in result.output, result.output
