"""Runs `python setup.py build_ext ARGS` and prints one line per compile step instead of the
compiler command lines ninja echoes: `[3/16] csrc/ops/cpu/isa_avx2.cpp  (at 31 s)`. What the
compilers say (warnings, errors) is kept: a failed step is printed whole, with its cause, and the
build's own messages (which library is built, and why CUDA is not) pass through.

    python scripts/build_native.py --inplace          # what `make build` runs
    ROPE_EXT_BUILD_VERBOSE=1 ...                      # everything, as setup.py prints it
"""

import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from build_config import envs, library  # noqa: E402  (rope_ext/envs.py, loaded without torch)

STEP = re.compile(r"^\[(\d+)/(\d+)\] (.*)$")
SOURCES = (".cpp", ".cu", ".cc", ".c")


def _what(command):
    """The source a compile command reads, relative to the root, else the command's program."""
    path = next((t for t in command.split() if t.endswith(SOURCES)), None)
    if path:
        return os.path.relpath(path, ROOT) if os.path.isabs(path) else path
    return "linking " + os.path.basename(command.split()[-1]) if " -shared " in command else command[:80]


def _library_of(source):
    """Which library (csrc/build.json) compiles `source`, in words, else "a library"."""
    for name, words in (("cpu", "the CPU library"), ("cuda", "the CUDA library")):
        module, init, sources = library(name)
        if source in (init, *sources):
            return f"{words}, {module}"
    return "a library"


def main(argv):
    cmd = [sys.executable, os.path.join(ROOT, "setup.py"), "--quiet", "build_ext", *argv]
    if envs.BUILD_VERBOSE == "1":
        return subprocess.call(cmd, cwd=ROOT)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    log = []
    for line in proc.stdout:
        log.append(line)
        m = STEP.match(line.rstrip("\n"))
        if m and m.group(1) == "1":  # ninja runs once per library with anything to compile
            print(f"  {m.group(2)} file(s) of {_library_of(_what(m.group(3)))} to compile",
                  flush=True)
        if m:
            print(f"  [{m.group(1)}/{m.group(2)}] {_what(m.group(3))}  "
                  f"(at {time.monotonic() - start:.0f} s)", flush=True)
            continue
        text = line.strip()
        # Compiler diagnostics and the build's own notes pass through; setuptools' chatter not.
        if (": warning:" in text or ": error" in text or text.startswith(("rope_ext:", "FAILED:"))
                or "error:" in text.lower()):
            print("  " + text, flush=True)
    code = proc.wait()
    took = time.monotonic() - start
    if code:
        failed = next((i for i, line in enumerate(log) if line.startswith("FAILED:")), None)
        shown = log[failed:failed + 60] if failed is not None else log[-80:]
        print(f"\nrope_ext: the native build failed after {took:.0f} s; "
              f"{'the step that failed' if failed is not None else 'the end of its output'}:\n",
              file=sys.stderr)
        sys.stderr.write("".join(shown))
        print("\n(ROPE_EXT_BUILD_VERBOSE=1 prints every command as it runs)", file=sys.stderr)
        return code
    print(f"  built in {took:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
