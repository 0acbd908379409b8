"""The torch and Triton versions the serving image ships, read from deploy/Dockerfile's build args.

The Dockerfile's ``ARG TORCH_VERSION=...`` and ``ARG TRITON_VERSION=...`` defaults are the one place that
names them: ``docker build`` uses them (and ``--build-arg`` overrides them the usual way), and CI reads them
here to run part of the test suite on the same versions, so that changing the image's torch changes what CI
tests with no second edit.

    python .ci/image_versions.py [DOCKERFILE]          prints the pip requirements: torch==X triton==Y
    python .ci/image_versions.py --check [DOCKERFILE]  exits 1 unless this interpreter has exactly those

Standard library only: CI runs it with whatever python3 is at hand, before or inside a venv.
"""
from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parent.parent / "deploy" / "Dockerfile"
# distribution name -> the Dockerfile ARG whose default is its version
PINNED = {"torch": "TORCH_VERSION", "triton": "TRITON_VERSION"}

_ARG = re.compile(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(\S*))?\s*$", re.IGNORECASE)
_VERSION = re.compile(r"^[0-9]+(\.[0-9]+)*([a-z0-9.+-]*)$")  # a literal version, no ${...} reference


def read_versions(dockerfile: Path = DOCKERFILE) -> dict[str, str]:
    """{distribution: version} from the ARG defaults; ValueError naming the ARG if one is missing or odd."""
    defaults: dict[str, set[str]] = {}
    for line in dockerfile.read_text().splitlines():
        m = _ARG.match(line)
        if m:
            defaults.setdefault(m.group(1), set()).add((m.group(2) or "").strip("'\""))
    out = {}
    for dist, arg in PINNED.items():
        values = defaults.get(arg)
        if not values:
            raise ValueError(f"{dockerfile}: no 'ARG {arg}=<version>' line")
        if len(values) > 1:  # an ARG repeated after a second FROM with another default: which one ships?
            raise ValueError(f"{dockerfile}: ARG {arg} has several defaults {sorted(values)}")
        (value,) = values
        if not _VERSION.match(value):
            raise ValueError(f"{dockerfile}: ARG {arg} needs a literal version as its default, not {value!r}")
        out[dist] = value
    return out


def requirements(versions: dict[str, str]) -> str:
    """pip's form, one argument each: 'torch==2.10.0 triton==3.6.0'."""
    return " ".join(f"{dist}=={v}" for dist, v in versions.items())


def mismatches(versions: dict[str, str]) -> list[str]:
    """What the running interpreter has that differs (a local build tag such as +cu126 is not a difference)."""
    bad = []
    for dist, want in versions.items():
        try:
            have = metadata.version(dist)
        except metadata.PackageNotFoundError:
            have = "not installed"
        if have.split("+")[0] != want.split("+")[0]:
            bad.append(f"{dist}: have {have}, deploy/Dockerfile pins {want}")
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dockerfile", nargs="?", type=Path, default=DOCKERFILE)
    p.add_argument("--check", action="store_true", help="check the installed versions instead of printing")
    args = p.parse_args(argv)
    try:
        versions = read_versions(args.dockerfile)
    except (OSError, ValueError) as e:
        print(f"image_versions: {e}", file=sys.stderr)
        return 2
    if args.check:
        bad = mismatches(versions)
        for line in bad:
            print(f"image_versions: {line}", file=sys.stderr)
        if bad:
            return 1
        print(f"image versions installed: {requirements(versions)}")
        return 0
    print(requirements(versions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
