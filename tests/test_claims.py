"""make test's split (tests/conftest.py --claim-dir): two pytest processes sharing a claim
directory run every test of the files given, each test in exactly one of them, whole files
apiece. If the split broke, `make test` could pass having run nothing, so it is checked here."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Three quick files (each process pays for its own torch import; the split is what is tested).
FILES = ["tests/test_docs.py", "tests/test_multi_axis.py", "tests/test_errors.py"]


def _outcomes(text):
    """{node id: outcome} of a `pytest -v -rN` report."""
    return dict(re.findall(r"^(tests/\S+::\S+) (PASSED|SKIPPED|FAILED|ERROR|XFAIL|XPASS)", text, re.M))


def _pytest(*args):
    return [sys.executable, "-m", "pytest", *FILES, "-p", "no:cacheprovider", *args]


def test_two_processes_run_each_test_once(tmp_path):
    claims = tmp_path / "claims"
    claims.mkdir()
    split = ["--claim-dir", str(claims)]
    runs = [subprocess.Popen(_pytest("-v", "-rN", *split), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=600)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    parts = [_outcomes(out) for out in outputs]
    whole = subprocess.run(_pytest("--collect-only", "-q"), cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout
    collected = set(re.findall(r"^(tests/\S+::\S+)$", whole, re.M))
    assert collected, whole
    assert not parts[0].keys() & parts[1].keys()
    assert parts[0].keys() | parts[1].keys() == collected
    files = [{node.split("::")[0] for node in part} for part in parts]
    assert not files[0] & files[1]  # whole files: none has tests in both processes
    assert sorted(os.listdir(claims)) == sorted(f.replace("/", "--") for f in FILES)
