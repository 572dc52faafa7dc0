"""Where an adapter folder is, and the Hugging Face Hub: `locate` turns a local folder or a Hub
repo id (with an optional `subfolder`) into the folder to read, downloading only the adapter's
own files (`huggingface_hub.snapshot_download`); `push_folder` creates a repo and uploads a
freshly written folder. It reads no file itself: `sparsekv.scoring.files` does."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparsekv.io import as_path, only_a_path
from sparsekv.scoring.adapter_config import LORA_DIR, _version
from sparsekv.scoring.files import (
    CARD_NAME,
    CONFIG_NAME,
    LEGACY_CONFIG_NAME,
    LEGACY_WEIGHTS_NAME,
    WEIGHTS_NAME,
)

__all__ = ["locate", "push_folder"]


def _escapes(subfolder: str) -> bool:
    """Whether `subfolder` could leave the folder it is inside: absolute (any platform's
    spelling) or holding a ".." part ("x/../../other")."""
    from pathlib import PurePosixPath, PureWindowsPath

    parts = subfolder.replace("\\", "/").split("/")
    return (
        PurePosixPath(subfolder).is_absolute()
        or PureWindowsPath(subfolder).is_absolute()
        or bool(PureWindowsPath(subfolder).drive)
        or ".." in parts
    )


def locate(path_or_repo_id: str | os.PathLike, subfolder: str | None = None, **hub: Any) -> Path:
    """The adapter folder of a local folder, else of a Hub repo (downloaded with `hub`'s
    `revision`, `cache_dir`, `local_files_only`, `token`, `force_download`; `HF_HUB_OFFLINE=1`
    searches only the local Hub cache), `subfolder` inside it. A `subfolder` that leaves the
    root, a file, and a missing path that cannot be a repo id are refused by name."""
    if subfolder is not None and (
        not isinstance(subfolder, str)
        or subfolder.startswith(("/", ".."))
        or _escapes(subfolder)
    ):
        raise ValueError(
            f"subfolder={subfolder!r} must be a relative path inside the folder or repo"
        )
    root = as_path(path_or_repo_id, "path_or_repo_id")
    if root.is_dir():
        return root / subfolder if subfolder else root
    if root.exists():
        raise ValueError(
            f"{str(path_or_repo_id)!r} is a file; expected an adapter folder or a Hub repo id"
        )
    if only_a_path(path_or_repo_id):
        raise FileNotFoundError(
            f"adapter folder {str(path_or_repo_id)!r} does not exist (and a path is not a "
            "Hugging Face Hub repo id, which is 'name' or 'namespace/name')"
        )
    snap = _download(str(path_or_repo_id), subfolder=subfolder, **hub)
    return snap / subfolder if subfolder else snap


def _download(repo_id: str, subfolder: str | None, **kwargs: Any) -> Path:
    from huggingface_hub import constants, snapshot_download

    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    names = (CONFIG_NAME, WEIGHTS_NAME, CARD_NAME, LEGACY_CONFIG_NAME, LEGACY_WEIGHTS_NAME)
    patterns = [prefix + n for n in names] + [f"{prefix}{LORA_DIR}/*"]
    try:
        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=patterns,
                library_name="sparsekv",
                library_version=_version(),
                **kwargs,
            )
        )
    except Exception as e:  # HF raises many kinds: invalid id, offline, not found, network
        offline = (
            " (HF_HUB_OFFLINE=1: only the local Hub cache is searched)"
            if constants.HF_HUB_OFFLINE
            else ""
        )
        raise OSError(
            f"{repo_id!r} is not a local adapter folder, and downloading it from the "
            f"Hugging Face Hub failed{offline}: {type(e).__name__}: {e}"
        ) from e


def push_folder(
    write: Callable[[Path], Path],
    repo_id: str,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload sparsekv scorer adapter",
    revision: str | None = None,
):
    """Create `repo_id` if needed and upload the folder `write(path)` writes (into a temporary
    folder); returns the `CommitInfo`."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    with tempfile.TemporaryDirectory(prefix="sparsekv-push-") as tmp:
        folder = write(Path(tmp) / "adapter")
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            repo_type="model",
            commit_message=commit_message,
            revision=revision,
        )
