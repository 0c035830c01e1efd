"""Every program's log on stderr (lockstep_common/logs.py), read from real interpreters as a user sees it."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stderr(code: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stderr.splitlines()


def test_configuring_twice_writes_each_line_once_in_the_format_given():
    lines = _stderr("import logging; from lockstep_common.logs import configure_logging\n"
                    "configure_logging('[demo] %(levelname)s %(message)s', 'info')\n"
                    "configure_logging('[demo] %(levelname)s %(message)s', 'info')\n"
                    "logging.getLogger('demo.part').info('ready'); logging.getLogger().debug('hidden')")
    assert lines == ["[demo] INFO ready"]


def test_a_named_logger_is_not_repeated_by_a_configured_root_logger():
    lines = _stderr("import logging; from lockstep_common.logs import configure_logging\n"
                    "logging.basicConfig(format='root: %(message)s')\n"
                    "configure_logging('[mine] %(message)s', logging.INFO, 'mine').info('once')")
    assert lines == ["[mine] once"]


def test_the_engine_writes_lockstep_prefixed_lines_and_errors_at_error_level():
    lines = _stderr("import logging; from lockstep_engine.log import log, logger\n"
                    "seen = []; logger.addHandler(type('H', (logging.Handler,), {'emit': lambda self, r: seen.append(r.levelname)})())\n"
                    "log('loading weights'); log('error: rank 1 is gone'); print(seen, file=__import__('sys').stderr)")
    assert lines == ["[lockstep] loading weights", "[lockstep] error: rank 1 is gone", "['INFO', 'ERROR']"]


def test_lines_go_to_the_stderr_of_the_moment(capsys):
    from lockstep_engine.log import log

    log("start-up: 1.0 s")
    assert capsys.readouterr().err == "[lockstep] start-up: 1.0 s\n"
