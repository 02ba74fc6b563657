"""Which tritonserver `serve` runs and what its Python backend needs here (serving/tritonserver.py,
serving/triton_install.py), each missing piece one line with its fix.

The install `make setup` made is the real one (tritonserver 2.51 from nvidia-pytriton 0.7.0) and is
checked as it is. What cannot be made true on this machine without breaking it (a Python without a
shared libpython, numpy 2 in the stub's environment, a stub built for another Python) is given to
`stub_problems` as the facts it would read there (StubFacts), which is all the decision reads.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from dflash_trt.errors import DFlashError
from dflash_trt.serving.triton_install import SERVER_ROOT, STUB, install, install_root, is_installed, python_tag
from dflash_trt.serving.tritonserver import (ENV_BINARY, StubFacts, TritonInstall, find_tritonserver,
                                             require_tritonserver, server_environment, stub_problems)

HERE = StubFacts.here()


@pytest.fixture(scope="module")
def installed() -> TritonInstall:
    found = find_tritonserver()
    assert found is not None, "make setup installs tritonserver; run it"
    return found


def test_the_install_found_is_complete_for_this_python(installed):
    assert stub_problems(installed) == []
    assert installed.binary.is_file() and os.access(installed.binary, os.X_OK)
    assert (installed.backends / "python" / "libtriton_python.so").is_file()
    assert installed.stub.is_file()
    if "dflash-trt's install" in installed.origin:
        assert is_installed(install_root()) and installed.binary.is_relative_to(install_root())
        # the stub is the one built for this Python (the wheel ships one per minor version)
        assert installed.stub.read_bytes() == (install_root() / SERVER_ROOT / "python_backend_stubs" / python_tag()
                                               / STUB).read_bytes()


def _fake_install(root: Path, stub_links: bytes | None) -> TritonInstall:
    (root / "bin").mkdir(parents=True)
    binary = root / "bin" / "tritonserver"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    if stub_links is not None:
        (root / "backends" / "python").mkdir(parents=True)
        (root / "backends" / "python" / STUB).write_bytes(b"\x7fELF..." + stub_links + b"\0")
    return TritonInstall(binary, root / "backends", (), "a test install")


@pytest.mark.parametrize("case, facts, stub, fragment", [
    ("no stub", HERE, None, "no Python backend stub in"),
    ("another Python's stub", HERE, b"libpython3.9.so.1.0", "is built for Python 3.9"),
    ("static libpython", StubFacts(HERE.python, None, "1.26.4", "/venv"), b"", "has no shared libpython"),
    ("numpy 2", StubFacts(HERE.python, HERE.libdir, "2.4.6", "/venv"), b"", "numpy 2.4.6 in /venv"),
    ("no numpy", StubFacts(HERE.python, HERE.libdir, None, "/venv"), b"", "numpy is not installed"),
])
def test_each_missing_piece_is_one_line_with_its_fix(tmp_path, case, facts, stub, fragment):
    if stub == b"":
        stub = f"libpython{facts.python}.so.1.0".encode()
    problems = stub_problems(_fake_install(tmp_path, stub), facts)
    assert len(problems) == 1 and fragment in problems[0], (case, problems)
    assert "\n" not in problems[0] and ("make setup" in problems[0] or "pip install" in problems[0]
                                       or "--enable-shared" in problems[0] or "virtualenv" in problems[0])


def test_no_tritonserver_at_all_says_where_it_looked():
    (line,) = stub_problems(None)
    assert "not on PATH" in line and "/opt/tritonserver" in line and "make setup" in line


def test_the_environment_variable_names_the_binary(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_BINARY, str(tmp_path / "nowhere" / "tritonserver"))
    found = find_tritonserver()
    assert found is not None and found.origin == f"${ENV_BINARY}"
    with pytest.raises(DFlashError, match=r"is not an executable file; run `make setup`"):
        require_tritonserver()


def test_the_stub_runs_with_this_environment(installed):
    env = server_environment(installed, base={"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/opt/x"})
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.prefix) / "bin")  # its python3 is this venv's
    libs = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert libs[0] == str(HERE.libdir) and libs[-1] == "/opt/x"  # this interpreter's libpython first
    assert all(str(d) in libs for d in installed.lib_dirs)
    import dflash_trt

    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(dflash_trt.__file__).parents[1])


def test_a_wheel_that_is_not_the_recorded_one_installs_nothing(tmp_path):
    wheel = tmp_path / "nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl"
    wheel.write_bytes(b"not the wheel")
    with pytest.raises(DFlashError, match=r"has sha256 [0-9a-f]{64}, not .*; download the wheel again"):
        install(cache=tmp_path / "cache", wheel=wheel)
    assert not (tmp_path / "cache" / "tritonserver").exists() or not any((tmp_path / "cache" / "tritonserver").iterdir())
