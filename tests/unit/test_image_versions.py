"""CI tests the image's torch and Triton: `.ci/image_versions.py` reads them from deploy/Dockerfile's ARGs.

The script is run as CI runs it (a subprocess, its stdout). Checked: it prints the ARG defaults the image's
pip install really uses; it follows an edited Dockerfile (no copy of the numbers anywhere else); it refuses
a Dockerfile it cannot read a literal version from; ``--check`` compares the installed distributions; the
test extra's Triton pin (the AOT/interpreter tests of the main suite) admits the image's Triton; .ci/run
runs the README's test command and then the image-version step.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "image_versions.py"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True,
                          timeout=60)


def _pins(stdout: str) -> dict[str, str]:
    return dict(tok.split("==", 1) for tok in stdout.split())


def test_prints_the_versions_the_images_pip_install_uses():
    out = _run()
    assert out.returncode == 0, out.stderr
    pins = _pins(out.stdout)
    assert set(pins) == {"torch", "triton"}
    text = DOCKERFILE.read_text()
    # The image installs through these ARGs, so the printed defaults are what `docker build` installs.
    installs = [ln for ln in text.replace("\\\n", " ").splitlines() if "pip install" in ln]
    assert any('"torch==${TORCH_VERSION}"' in ln for ln in installs), installs
    assert any('"triton==${TRITON_VERSION}"' in ln for ln in installs), installs
    for dist, arg in (("torch", "TORCH_VERSION"), ("triton", "TRITON_VERSION")):
        assert re.search(rf"^ARG {arg}={re.escape(pins[dist])}$", text, re.MULTILINE), (arg, pins[dist])


def test_follows_an_edited_dockerfile(tmp_path):
    text = DOCKERFILE.read_text()
    text = re.sub(r"^ARG TORCH_VERSION=.*$", "ARG TORCH_VERSION=2.9.1", text, flags=re.MULTILINE)
    text = re.sub(r"^ARG TRITON_VERSION=.*$", "ARG TRITON_VERSION=3.5.1", text, flags=re.MULTILINE)
    (tmp_path / "Dockerfile").write_text(text)
    out = _run(str(tmp_path / "Dockerfile"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch==2.9.1", "triton==3.5.1"]


@pytest.mark.parametrize("edit, named", [
    (("ARG TORCH_VERSION=", "ARG TORCH_RELEASE="), "TORCH_VERSION"),        # the ARG is gone
    (("ARG TRITON_VERSION=3.6.0", "ARG TRITON_VERSION"), "TRITON_VERSION"),  # no default
    (("ARG TORCH_VERSION=2.10.0", "ARG TORCH_VERSION=${BASE_TORCH}"), "TORCH_VERSION"),
    (("ARG TRITON_VERSION=3.6.0", "ARG TRITON_VERSION=3.6.0\nFROM x\nARG TRITON_VERSION=3.5.0"), "TRITON_VERSION"),
])
def test_refuses_a_dockerfile_without_one_literal_default(tmp_path, edit, named):
    text = DOCKERFILE.read_text()
    assert edit[0] in text
    (tmp_path / "Dockerfile").write_text(text.replace(edit[0], edit[1]))
    out = _run(str(tmp_path / "Dockerfile"))
    assert out.returncode == 2 and out.stdout == ""
    assert named in out.stderr


def test_check_compares_the_installed_distributions(tmp_path):
    torch_v, triton_v = metadata.version("torch"), metadata.version("triton")
    df = tmp_path / "Dockerfile"
    df.write_text(f"FROM x\nARG TORCH_VERSION={torch_v.split('+')[0]}\nARG TRITON_VERSION={triton_v}\n")
    ok = _run("--check", str(df))
    assert ok.returncode == 0, ok.stderr
    df.write_text(f"FROM x\nARG TORCH_VERSION=1.0.0\nARG TRITON_VERSION={triton_v}\n")
    bad = _run("--check", str(df))
    assert bad.returncode == 1
    assert f"torch: have {torch_v}, deploy/Dockerfile pins 1.0.0" in bad.stderr
    assert "triton" not in bad.stderr


def test_the_main_suites_pins_admit_the_images_versions():
    pins = _pins(_run().stdout)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    for dist in ("torch", "triton"):
        for r in (r for r in reqs if r.name == dist):
            assert r.specifier.contains(pins[dist], prereleases=True), (str(r), pins[dist])


def test_ci_runs_the_readme_command_then_the_image_versions():
    readme = (ROOT / "README.md").read_text()
    (readme_cmd,) = re.findall(r"^    (pip install .* && python -m pytest .*)$", readme, re.MULTILINE)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_cmd in ci
    after = "\n".join(ci[ci.index(readme_cmd) + 1:])
    assert "python3 .ci/image_versions.py)" in after and "python .ci/image_versions.py --check" in after
