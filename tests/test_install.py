"""infra/install.py, which `make venv` runs: pip's configuration carried over to uv as pip would apply it, a
setting uv cannot honour sends the install to pip, and both paths install into a real venv from a local wheel."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("install", REPO / "infra" / "install.py")
install = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(install)
# where `make venv` bootstrapped uv (absent in a venv made some other way)
REPO_UV = Path(sys.executable).parent.parent / "uv-tool" / "bin" / "uv"

# `pip config list` on this project's CPU machine, with an [install] section and a [download] one added
LISTING = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.disable-pip-version-check='1'
:env:.find-links='/opt/wheels'
download.index-url='https://elsewhere.example/simple'
global.cert='/etc/other.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/srv/never'
global.index-url='https://mirror.example/simple'
install.index-url='https://install-mirror.example/simple'
"""


def test_pip_settings_take_the_environment_over_install_over_global_and_skip_other_commands() -> None:
    assert install.pip_settings(LISTING) == {
        "cert": "/etc/ssl/certs/ca-certificates.crt", "default-timeout": "180", "disable-pip-version-check": "1",
        "find-links": "/opt/wheels", "constraint": "/etc/xdg/pip/constraints.txt",
        "extra-index-url": "file:///opt/pypi/simple file:///opt/pypi-more/simple",
        "index-url": "https://install-mirror.example/simple"}


def test_uv_gets_every_index_link_and_constraint_with_pips_best_match_and_bytecode() -> None:
    args, env = install.uv_options(install.pip_settings(LISTING))
    assert args == ["--index-strategy", "unsafe-best-match", "--compile-bytecode", "--no-config",
                    "--constraint", "/etc/xdg/pip/constraints.txt",
                    "--extra-index-url", "file:///opt/pypi/simple", "--extra-index-url", "file:///opt/pypi-more/simple",
                    "--find-links", "/opt/wheels", "--index-url", "https://install-mirror.example/simple"]
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt", "UV_HTTP_TIMEOUT": "180"}


@pytest.mark.parametrize("setting", ["require-hashes='1'", "only-binary=':all:'", "pre='1'", "no-index='0'"])
def test_a_setting_uv_would_not_honour_the_same_way_is_named_and_leaves_it_to_pip(setting: str) -> None:
    with pytest.raises(install.Untranslatable, match=setting.split("=")[0]):
        install.uv_options(install.pip_settings(f"global.{setting}\n"))


def wheel(where: Path, name: str = "tinypkg", version: str = "1.0") -> Path:
    """A pure-Python wheel whose module says its version."""
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{name}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                 "Tag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()]
    files[f"{name}-{version}.dist-info/RECORD"] = "\n".join([*record, f"{name}-{version}.dist-info/RECORD,,"]) + "\n"
    path = where / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


def run_install(tmp_path: Path, uv: Path | None) -> subprocess.CompletedProcess:
    """infra/install.py in a fresh venv whose pip sees only a local wheel directory (no index)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel(wheels)
    config = tmp_path / "pip.conf"
    config.write_text(f"[global]\nno-index = true\nfind-links = {wheels}\n")
    venv.create(tmp_path / "v", with_pip=True)
    if uv:
        (tmp_path / "v" / "uv-tool" / "bin").mkdir(parents=True)
        (tmp_path / "v" / "uv-tool" / "bin" / "uv").symlink_to(uv)
    env = {"PIP_CONFIG_FILE": str(config), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "UV_CACHE_DIR": str(tmp_path / "uv-cache")}
    done = subprocess.run([str(tmp_path / "v" / "bin" / "python"), str(REPO / "infra" / "install.py"), "tinypkg"],
                          env=env, capture_output=True, text=True, timeout=240)
    imported = subprocess.run([str(tmp_path / "v" / "bin" / "python"), "-c", "import tinypkg; print(tinypkg.VERSION)"],
                              capture_output=True, text=True)
    assert done.returncode == 0 and imported.stdout == "1.0\n", done.stderr + imported.stderr
    return done


@pytest.mark.servers
def test_without_uv_to_be_had_pip_installs_from_its_own_configuration(tmp_path: Path) -> None:
    # no index and no uv wheel among the links: the bootstrap fails and pip installs instead
    done = run_install(tmp_path, uv=None)
    assert "installing with pip: uv>=0.11,<1 could not be installed by pip" in done.stderr


@pytest.mark.servers
@pytest.mark.skipif(not REPO_UV.exists(), reason="no uv beside this venv (`make venv` bootstraps it)")
def test_uv_installs_from_pips_configuration(tmp_path: Path) -> None:
    done = run_install(tmp_path, uv=REPO_UV)
    [line] = [line for line in done.stderr.splitlines() if line.startswith("installed with uv (")]
    assert f"--find-links {tmp_path / 'wheels'}" in line and "--no-index" in line
