"""The ``process`` mark's guard (tests/lanes.py), run on small test files in a pytest of their own:
a test without the mark that starts a process is refused and fails, whatever way it starts one,
and no process is started; one that uses a fixture which started a process fails; a marked test
that starts none fails."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

# Each starts a process that would touch the file named by STARTED, were it started.
WAYS = {
    "subprocess": "subprocess.run(['touch', STARTED])",
    "popen": "subprocess.Popen(['touch', STARTED]).wait()",
    "os.system": "os.system(f'touch {STARTED}')",
    "os.posix_spawn": "os.waitpid(os.posix_spawn('/usr/bin/touch', ['touch', STARTED], dict(os.environ)), 0)",
    "os.fork": ("pid = os.fork()\nif pid == 0:\n    open(STARTED, 'w').close()\n    os._exit(0)\nos.waitpid(pid, 0)"),
    "multiprocessing": (
        "process = multiprocessing.get_context('spawn').Process(target=os.getpid)\n"
        "process.start()\n"
        "process.join()\n"
        "open(STARTED, 'w').close()"
    ),
    "asyncio": (
        "async def touch():\n"
        "    await (await asyncio.create_subprocess_exec('touch', STARTED)).wait()\n"
        "asyncio.run(touch())"
    ),
}


def run(pytester: pytest.Pytester, body: str, started: Path) -> pytest.RunResult:
    header = f"import asyncio, multiprocessing, os, subprocess\nimport pytest\nSTARTED = {str(started)!r}\n"
    pytester.makepyfile(test_it=header + textwrap.dedent(body))
    return pytester.runpytest_inprocess("-p", "tests.lanes", "-p", "no:cacheprovider", "-p", "no:asyncio")


def indented(code: str) -> str:
    return textwrap.indent(code, "    ")


CAUGHT = f"try:\n{indented(WAYS['subprocess'])}\nexcept Exception:\n    pass\n"
# A test file, what pytest makes of it, and a line it says.
REFUSED = {
    **{way: (f"def test_starts():\n{indented(code)}\n", {"failed": 1}, "*test_starts: ") for way, code in WAYS.items()},
    "caught by the test": (f"def test_catches():\n{indented(CAUGHT)}", {"passed": 1, "errors": 1}, "*test_catches: "),
    "while collecting": (f"{WAYS['subprocess']}\ndef test_nothing():\n    pass\n", {"errors": 1}, "*collecting: "),
}


@pytest.mark.parametrize(("body", "outcomes", "said"), REFUSED.values(), ids=REFUSED.keys())
def test_a_process_without_the_mark_is_refused_and_never_starts(
    pytester: pytest.Pytester, tmp_path: Path, body: str, outcomes: dict[str, int], said: str
):
    started = tmp_path / "started"
    result = run(pytester, body, started)
    result.assert_outcomes(**outcomes)
    result.stdout.fnmatch_lines([f"{said}started a process (*) without the `process` mark*"])
    assert not started.exists()


def test_a_marked_test_that_starts_nothing_fails(pytester: pytest.Pytester, tmp_path: Path):
    result = run(pytester, "@pytest.mark.process\ndef test_pure():\n    assert True\n", tmp_path / "started")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_pure is marked `process` and started none*take the mark off*"])


@pytest.mark.process
def test_marked_tests_start_processes_and_a_test_using_their_fixture_must_be_marked(
    pytester: pytest.Pytester, tmp_path: Path
):
    started = tmp_path / "started"
    body = f"""
        @pytest.fixture(scope="module")
        def server():
            {WAYS["subprocess"]}

        @pytest.mark.process
        def test_starts():
            {WAYS["popen"]}

        @pytest.mark.process
        def test_starts_the_fixture(server):
            pass

        @pytest.mark.process
        def test_uses_it_once_started(server):
            pass

        def test_uses_it_unmarked(server):
            pass
    """
    result = run(pytester, body, started)
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(["*test_uses_it_unmarked uses fixtures that start processes (server)*"])
    assert started.exists()


def test_a_process_started_around_the_wrappers_is_seen_while_it_lives(pytester: pytest.Pytester, tmp_path: Path):
    """The C library's fork, as a native extension would call it: the child is left unreaped."""
    child = tmp_path / "child"
    body = f"""
        import ctypes

        def test_forks_in_c():
            pid = ctypes.CDLL(None).fork()
            if pid == 0:
                os._exit(0)
            open({str(child)!r}, "w").write(str(pid))
    """
    result = run(pytester, body, tmp_path / "started")
    os.waitpid(int(child.read_text()), 0)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_forks_in_c left processes running (*) without the `process` mark*"])
