"""`lockstep operator` flags: parsed into the one settings dataclass, bad values refused by name."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lockstep_operator.config import OperatorConfig
from lockstep_operator.main import parse_args


def test_flags_fill_the_operator_config():
    config = parse_args(
        ["-n", "team-a", "--namespace", "team-b", "--engine-image", "r/lockstep:1.2.3", "--metrics-port", "0"]
    )
    assert config == OperatorConfig(
        namespaces=("team-a", "team-b"), engine_image="r/lockstep:1.2.3", metrics_port=0
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine-image", "r/lockstep:latest"], "engine_image must be a pinned image reference"),
        (["--metrics-port", "70000"], "metrics_port must be in 0..65535, got 70000"),
        (["--resync-seconds", "0"], "resync_seconds must be > 0"),
    ],
)
def test_bad_flags_exit_with_the_reason(capsys, argv, message):
    with pytest.raises(SystemExit) as caught:
        parse_args(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_the_lockstep_cli_dispatches_to_the_operator():
    result = subprocess.run(
        [sys.executable, "-m", "lockstep.cli", "operator", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    assert "--engine-image" in result.stdout and "--resync-seconds" in result.stdout


def test_network_policy_flags_fill_the_operator_config():
    config = parse_args(
        ["--engine-client-namespace", "lockstep-system", "--monitoring-namespace", "monitoring",
         "--monitoring-namespace", "obs"]
    )  # fmt: skip
    assert config.network_policy is True
    assert config.engine_client_namespaces == ("lockstep-system",)
    assert config.monitoring_namespaces == ("monitoring", "obs")
    assert parse_args(["--no-network-policy"]).network_policy is False
