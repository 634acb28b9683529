"""Installs requirements into a venv the way its pip would, with uv where that is faithful, else with pip.

`make venv` runs it with the venv's interpreter: ``.venv/bin/python infra/install.py 'torch==2.13.0' -e '.[dev]'``.
uv installs the project's ~210 packages in a fraction of pip's time, but it reads none of pip's configuration, and
machines carry theirs there (a constraint file, local wheel directories and indexes, a certificate). So uv is
bootstrapped by the venv's pip (which honours that configuration) and handed pip's own settings, read with
``pip config list``; it takes the best version across all indexes, as pip does, and compiles bytecode, as pip
does (a process under PYTHONDONTWRITEBYTECODE would otherwise recompile every module it imports). pip installs
instead when a setting has no uv equivalent here, when uv cannot be installed, or when uv fails.
Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

UV_SPEC = "uv>=0.11,<1"
# pip settings whose value is a whitespace-separated list, and the uv option each word becomes
LISTS = {"extra-index-url": "--extra-index-url", "find-links": "--find-links", "constraint": "--constraint"}
# pip settings that change nothing uv would install (PIP_CONFIG_FILE's own settings are listed with the rest)
IGNORED = {"disable-pip-version-check", "no-input", "progress-bar", "quiet", "verbose", "root-user-action",
           "no-color", "cache-dir", "no-cache-dir", "retries", "config-file"}
TRUE = {"1", "true", "yes", "on"}


class Untranslatable(ValueError):
    """A pip setting uv would not honour the same way: pip installs instead."""


def pip_settings(listing: str) -> dict[str, str]:
    """What ``pip config list`` printed, as the install command sees it: environment variables over the
    [install] section over [global] (pip's own precedence); lines look like ``global.find-links='/opt/wheels'``."""
    rank = {":env:": 2, "install": 1, "global": 0}
    found: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        name, sep, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if not sep or section not in rank:
            continue  # another command's section ([download], [wheel]...) does not apply to install
        if key not in found or rank[section] >= found[key][0]:
            found[key] = (rank[section], ast.literal_eval(value))
    return {key: value for key, (_, value) in found.items()}


def uv_options(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's options and environment for pip's settings; Untranslatable names the first setting it cannot carry."""
    args, env = ["--index-strategy", "unsafe-best-match", "--compile-bytecode", "--no-config"], {}
    for key, value in sorted(settings.items()):
        if key in LISTS:
            args += [part for word in value.split() for part in (LISTS[key], word)]
        elif key in ("index-url", "i"):
            args += ["--index-url", value]
        elif key == "no-index" and value.lower() in TRUE:
            args.append("--no-index")
        elif key == "cert":
            env["SSL_CERT_FILE"] = value
        elif key in ("timeout", "default-timeout"):
            env["UV_HTTP_TIMEOUT"] = str(round(float(value)))
        elif key not in IGNORED:
            raise Untranslatable(f"pip setting {key}={value!r} has no uv equivalent here")
    return args, env


def run(cmd: list[str], env: dict[str, str] | None = None) -> bool:
    return subprocess.run(cmd, env=os.environ | (env or {})).returncode == 0


def main(requirements: list[str]) -> int:
    python = sys.executable
    pip = [python, "-m", "pip"]
    try:
        listing = subprocess.run([*pip, "config", "list"], capture_output=True, text=True, check=True).stdout
        args, env = uv_options(pip_settings(listing))
        # uv lives beside the venv's packages, not among them: the venv holds what pip would have installed
        tool = Path(python).parent.parent / "uv-tool"
        uv = tool / "bin" / "uv"
        if not uv.exists() and not run([*pip, "install", "-q", "--target", str(tool), UV_SPEC]):
            raise Untranslatable(f"{UV_SPEC} could not be installed by pip")
        if run([str(uv), "pip", "install", "-q", "--python", python, *args, *requirements], env):
            print(f"installed with uv ({' '.join(args)})", file=sys.stderr)
            # pip upgraded too, as the pip path does (`sidecar models fetch` runs the venv's pip); where no
            # index offers one, the venv's own pip stays, as `pip install --upgrade pip` would leave it
            run([str(uv), "pip", "install", "-q", "--python", python, *args, "--upgrade", "pip"], env)
            return 0
        print("uv failed: installing with pip", file=sys.stderr)
    except (Untranslatable, ValueError, SyntaxError, subprocess.CalledProcessError) as why:
        print(f"installing with pip: {why}", file=sys.stderr)
    return 0 if run([*pip, "install", "-q", "--upgrade", "pip"]) and run([*pip, "install", "-q", *requirements]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
