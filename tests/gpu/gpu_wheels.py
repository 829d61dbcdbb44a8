"""`make gpu-wheels`: the wheels an offline GPU machine's Python lacks for the GPU check, fetched here beforehand.

Such a machine (a lab or cluster node) already has torch, triton and transformers, and the packages they require
directly (numpy, huggingface-hub, tokenizers, safetensors, typing-extensions, ...), at versions that work together;
it has no network. kvscope needs more: textual, fastapi, sqlite-utils, msgspec, pyzmq, platformdirs, gguf and what
those need. The list is computed from lock/kvscope.txt, not written by hand: every package that pyproject.toml's
runtime dependencies reach through the lock's "# via" graph without passing through that stack. A package reached
only through the stack is left to the machine: a second copy ahead of its own on the path could break torch or
transformers, and its version there follows the machine's transformers, not the lock's (the lock's hub 2.x pulls
httpx2 and typer pulls pydantic; an older transformers pulls neither, so pydantic, which kvscope serve needs
itself, is shipped). The test tools are not. The versions are the lock's, so the check runs what `make test`
tests. The wheels are for one Python (``--python-version``) on manylinux x86-64; `make gpu-check`
installs them with ``--no-deps`` into a private folder put on PYTHONPATH, so nothing of that Python changes.

    python tests/gpu/gpu_wheels.py [--python-version 3.12] [--dest .gpu-wheels] [--list]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "lock" / "kvscope.txt"
PYPROJECT = ROOT / "pyproject.toml"
# What the GPU machine's Python brings: these and what they require directly (read from the lock's graph).
GPU_STACK = ("torch", "triton", "transformers")
# CUDA's own wheels travel with torch; a CPU lock names none, a CUDA one would.
GPU_STACK_PREFIXES = ("nvidia-",)
# Brought by the stack, shipped all the same: the lock's pydantic, anyio and pydantic-core need
# typing-extensions >= 4.16, which an older torch's machine may predate, and typing-extensions only ever adds
# (a newer copy ahead of the machine's breaks nothing that ran on the older one).
SHIPPED_ANYWAY = ("typing-extensions",)
SELF = "kvscope"
REQUIREMENTS = "requirements.txt"
# pip matches a manylinux tag exactly: the tags the wheels of the lock's packages are published under, newest
# first (README of the device tool: "pip matches N exactly").
PLATFORMS = ("manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")

_PINNED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
_VIA_ONE = re.compile(r"^\s+# via (.+)$")
_VIA_ITEM = re.compile(r"^\s+#\s{3}(.+)$")
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalise(name: str) -> str:
    """A distribution name as the lock and pip compare them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(text: str) -> dict[str, tuple[str, set[str]]]:
    """``name -> (version, the names that require it)`` from a uv-compiled lock with its "# via" lines.
    A requirer is a package name, or ``kvscope`` for "kvscope (pyproject.toml)", or the ``-r FILE`` line."""
    packages: dict[str, tuple[str, set[str]]] = {}
    current = None
    for line in text.splitlines():
        if match := _PINNED.match(line):
            current = normalise(match.group(1))
            packages[current] = (match.group(2), set())
        elif current is not None and (match := _VIA_ONE.match(line) or _VIA_ITEM.match(line)):
            packages[current][1].add(_requirer(match.group(1).strip()))
    return packages


def _requirer(text: str) -> str:
    if text.startswith("-r "):
        return text
    return normalise(_NAME.match(text).group(1))


def runtime_requirements(pyproject_text: str) -> set[str]:
    """The names in pyproject.toml's [project].dependencies (what a user's install pulls, no test extra)."""
    import tomllib  # Python 3.11: `make gpu-wheels` runs in the lock's venv; the GPU check never calls this

    dependencies = tomllib.loads(pyproject_text)["project"]["dependencies"]
    return {normalise(_NAME.match(spec).group(1)) for spec in dependencies}


def closure(roots, packages: dict[str, tuple[str, set[str]]], avoiding=frozenset()) -> set[str]:
    """``roots`` and everything they need, following the lock's graph downwards, never into ``avoiding``."""
    needs: dict[str, set[str]] = {}
    for name, (_version, requirers) in packages.items():
        for requirer in requirers:
            needs.setdefault(requirer, set()).add(name)
    seen, stack = set(), [name for name in roots if name in packages]
    while stack:
        name = stack.pop()
        if name not in seen and name not in avoiding:
            seen.add(name)
            stack.extend(needs.get(name, ()))
    return seen


def wheel_list(lock_text: str, pyproject_text: str) -> dict[str, str]:
    """``name -> version``: what kvscope runs on that the GPU machine's stack does not bring, sorted by name."""
    packages = read_lock(lock_text)
    brought = set(GPU_STACK) | {name for name, (_version, requirers) in packages.items()
                                if requirers & set(GPU_STACK)}
    brought |= {name for name in packages if name.startswith(GPU_STACK_PREFIXES)}
    brought -= set(SHIPPED_ANYWAY)
    wanted = closure(runtime_requirements(pyproject_text), packages, avoiding=brought) - {SELF}
    return {name: packages[name][0] for name in sorted(wanted)}


def unmet_requirements(site: Path) -> list[str]:
    """What the wheels installed in ``site`` require that the running Python lacks, or has at a version outside
    the range asked for: one line each, none when all is met (the GPU machine's own packages are read as found)."""
    from importlib.metadata import PackageNotFoundError, distributions, version

    from packaging.requirements import Requirement

    lines = set()
    for distribution in distributions(path=[str(site)]):
        for text in distribution.requires or ():
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            try:
                found = version(requirement.name)
            except PackageNotFoundError:
                found = None
            if found is None or not requirement.specifier.contains(found, prereleases=True):
                lines.add(f"{distribution.metadata['Name']} needs {requirement}, "
                          f"{'missing' if found is None else f'found {found}'}")
    return sorted(lines)


def download_command(pins: dict[str, str], python_version: str, dest: Path) -> list[str]:
    """pip's download of exactly these wheels for that CPython on manylinux x86-64, without their dependencies
    (the list is already the closure)."""
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    return [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--python-version", python_version, "--implementation", "cp", *platforms, "--dest", str(dest),
            *(f"{name}=={version}" for name, version in pins.items())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python, as 3.12")
    parser.add_argument("--dest", type=Path, default=ROOT / ".gpu-wheels", help="the folder for the wheels")
    parser.add_argument("--list", action="store_true", help="print the list and download nothing")
    args = parser.parse_args(argv)
    pins = wheel_list(LOCK.read_text(), PYPROJECT.read_text())
    lines = "".join(f"{name}=={version}\n" for name, version in pins.items())
    if args.list:
        print(lines, end="")
        return 0
    args.dest.mkdir(parents=True, exist_ok=True)
    for stale in args.dest.glob("*.whl"):     # one version of each: two would stop the whole install
        stale.unlink()
    result = subprocess.run(download_command(pins, args.python_version, args.dest), check=False)
    if result.returncode:
        return result.returncode
    (args.dest / REQUIREMENTS).write_text(lines)
    size = sum(path.stat().st_size for path in args.dest.iterdir())
    print(f"{len(pins)} wheels for CPython {args.python_version} in {args.dest}: {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
