"""The optional packages behind `run`, `probe` and `trace`, checked up front with the extra that installs them."""

from __future__ import annotations

import importlib.util

from vram_planner.errors import VramPlanError

TRAIN_EXTRA = "pip install 'vram-plan[train]'"
TRAIN_PACKAGES = ("torch", "transformers", "peft", "trl")


def require_train_extra(what: str) -> None:
    """torch, transformers, PEFT and TRL are installed, or one line says `what` needs them and how to install them.
    Found, not imported: importing them takes seconds, which bad input should not wait for."""
    for package in TRAIN_PACKAGES:
        if importlib.util.find_spec(package) is None:
            raise VramPlanError(f"{what} needs torch, transformers, TRL and PEFT ({package} cannot be imported): "
                                f"{TRAIN_EXTRA}")


def require_bitsandbytes(why: str) -> None:
    """bitsandbytes must be installed, at a version transformers accepts, for `why` (e.g. '--optim adamw_8bit')."""
    import importlib.metadata

    from packaging.version import Version
    from transformers.utils.import_utils import BITSANDBYTES_MIN_VERSION

    if importlib.util.find_spec("bitsandbytes") is None:
        raise VramPlanError(f"{why} needs bitsandbytes, which is not installed: {TRAIN_EXTRA}")
    try:
        version = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:  # importable without metadata (a source checkout): trust it
        return
    if Version(version) < Version(BITSANDBYTES_MIN_VERSION):
        raise VramPlanError(f"{why} needs bitsandbytes {BITSANDBYTES_MIN_VERSION} or newer (installed: {version}): "
                            f"{TRAIN_EXTRA}")
