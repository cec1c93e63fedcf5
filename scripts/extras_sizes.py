"""What each extra of pyproject.toml adds to a fresh virtualenv, on disk: docs/install.md's table.

    python3 scripts/extras_sizes.py                      # every extra but test
    python3 scripts/extras_sizes.py torch s3             # some
    python3 scripts/extras_sizes.py --torch 2.13.0 torch  # pin torch (a CPU wheel at hand, say)

For each extra: a fresh venv in a temporary directory, ``pip install '.[EXTRA]'`` from this clone
(pip's own cache and configuration, so it downloads what the machine does not hold), then the
venv's size (``du``) less the size of a venv holding trainjob alone, and the packages the extra
added. One markdown row per extra on stdout; each venv is removed once measured. Which torch
wheel pip picks decides the torch-bearing extras' size: on Linux x86_64 PyPI's default wheel is
the CUDA build, which brings NVIDIA's libraries; a CPU wheel (PyTorch's own index, or one pinned
from a local wheel house with ``--torch``) is far smaller.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def du_mib(path: Path) -> float:
    return int(subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True)
               .stdout.split()[0]) / 1024


def venv_with(requirements: list[str], where: Path) -> tuple[float, set[str]]:
    """A fresh venv at ``where`` holding ``requirements`` (none: pip alone): its size in MiB and its packages."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    pip = [str(where / "bin" / "python"), "-m", "pip"]
    if requirements:
        subprocess.run([*pip, "install", "-q", "--disable-pip-version-check", *requirements], check=True, cwd=ROOT)
    listed = subprocess.run([*pip, "list", "--format", "json", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True).stdout
    return du_mib(where), {p["name"].lower() for p in json.loads(listed)}


def main() -> None:
    offered = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    extras = list(offered)
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("extras", nargs="*", help=f"default: all but test ({', '.join(e for e in extras if e != 'test')})")
    cli.add_argument("--torch", help="install this torch version alongside (torch==VERSION)")
    args = cli.parse_args()
    pin = [f"torch=={args.torch}"] if args.torch else []
    with tempfile.TemporaryDirectory(prefix="trainjob-extras-") as tmp:
        empty, _ = venv_with([], Path(tmp) / "empty")
        base_size, base_packages = venv_with(["."], Path(tmp) / "core")
        print(f"| (trainjob alone) | {base_size:,.0f} MiB ({empty:,.0f} MiB of it an empty venv) | "
              f"{', '.join(sorted(base_packages))} |", flush=True)
        for extra in args.extras or [e for e in extras if e != "test"]:
            where = Path(tmp) / extra
            needs_torch = any(r.startswith("torch") for r in offered[extra])
            size, packages = venv_with([f".[{extra}]", *(pin if needs_torch else [])], where)
            added = sorted(packages - base_packages)
            print(f"| `{extra}` | +{size - base_size:,.0f} MiB | {len(added)} packages: {', '.join(added)} |", flush=True)
            subprocess.run(["rm", "-rf", str(where)], check=True)


if __name__ == "__main__":
    main()
