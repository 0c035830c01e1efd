"""The parser every command uses (lockstep_common/argparsing.py): whole flag names only, and two-line errors."""

from __future__ import annotations

import pytest
from lockstep_common.argparsing import ArgumentParser


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="lockstep demo")
    parser.add_argument("--api-key-file")
    parser.add_argument("--metrics-port", type=int, default=8080)
    return parser


def test_a_prefix_of_a_flag_is_not_taken_for_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["--api-key", "k"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --api-key k" in capsys.readouterr().err


def test_a_mistyped_flag_gets_a_did_you_mean_in_two_lines(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--metric-port", "9"])
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["lockstep demo: error: unrecognized arguments: --metric-port 9",
                     "did you mean --metrics-port? (`lockstep demo --help` lists every flag)"]


def test_the_operator_parses_its_flags_with_it(capsys):
    from lockstep_operator.main import parse_args

    assert parse_args(["--metrics-port", "0"]).metrics_port == 0
    with pytest.raises(SystemExit):
        parse_args(["--metrics-prot", "0"])
    assert "did you mean --metrics-port" in capsys.readouterr().err
