"""The optional packages behind `run`, `probe` and `trace`, checked up front with the extra that installs them."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator

from vram_planner.errors import VramPlanError

TRAIN_EXTRA = "pip install 'vram-plan[train]'"
TRAIN_PACKAGES = ("torch", "transformers", "peft", "trl")
VLLM_EXTRA = "pip install 'vram-plan[vllm]'"
# Libraries whose logger prints through a handler of its own: DeepSpeed's writes to stdout and does not propagate
# (deepspeed/utils/logging.py, LoggerFactory.create_logger). accelerate and transformers import it wherever it is
# installed, and on a machine without CUDA it warns "Setting accelerator to CPU" in the middle of a run's output.
OWN_HANDLER_LOGGERS = ("DeepSpeed",)
# The vLLM releases TRL 1.16 accepts (trl-1.16.0 METADATA: Requires-Dist vllm<=0.31.0,>=0.22.0; extra == "vllm"), as
# pyproject.toml's `vllm` extra pins them; vram_planner/model/vllm.py models their start-up budget.
VLLM_RANGE = ">=0.22.0,<=0.31.0"


def require_train_extra(what: str) -> None:
    """torch, transformers, PEFT and TRL are installed, or one line says `what` needs them and how to install them.
    Found, not imported: importing them takes seconds, which bad input should not wait for."""
    for package in TRAIN_PACKAGES:
        if importlib.util.find_spec(package) is None:
            raise VramPlanError(f"{what} needs torch, transformers, TRL and PEFT ({package} cannot be imported): "
                                f"{TRAIN_EXTRA}")


@contextlib.contextmanager
def library_log_warnings_hidden() -> Iterator[None]:
    """Only errors from libraries that log without setting logging up.

    Their records reach stderr through logging's last-resort handler, which prints warnings: bitsandbytes 0.50,
    which PEFT imports, warns on every CPU with AVX512-BF16 that the optional `kernels` package is missing. Such a
    line is not the command's; `run --verbose` shows it. A filter on the logger, not a level, holds back those with
    a handler of their own (OWN_HANDLER_LOGGERS), since such a library sets its logger's level when it is imported,
    which may happen inside the block.
    """
    handler = logging.lastResort
    level = handler.level if handler is not None else None  # None: the application turned the last resort off
    if handler is not None:
        handler.setLevel(max(handler.level, logging.ERROR))
    own_handlers = [logging.getLogger(name) for name in OWN_HANDLER_LOGGERS]
    for logger in own_handlers:
        logger.addFilter(_errors_only)
    try:
        yield
    finally:
        for logger in own_handlers:
            logger.removeFilter(_errors_only)
        if handler is not None:
            handler.setLevel(level)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def require_bitsandbytes(why: str) -> None:
    """bitsandbytes must be installed, at a version transformers accepts, for `why` (e.g. '--optim adamw_8bit')."""
    from packaging.version import Version
    from transformers.utils import import_utils

    # the transformers 4 releases TRL 0.14 ran with (4.48, 4.52) name no least bitsandbytes: any installed one is taken
    least = getattr(import_utils, "BITSANDBYTES_MIN_VERSION", None)
    version = _installed_version("bitsandbytes", f"{why} needs bitsandbytes, which is not installed: {TRAIN_EXTRA}")
    if version is not None and least is not None and Version(version) < Version(least):
        raise VramPlanError(f"{why} needs bitsandbytes {least} or newer (installed: {version}): {TRAIN_EXTRA}")


def require_kernels(why: str) -> None:
    """The kernels package, at the releases the installed transformers loads the Hub's kernels with, for `why`
    ('--use-kernels'): from_pretrained refuses use_kernels=True without it (a dependency of transformers 5.25 on)."""
    from transformers import __version__ as transformers_version
    from transformers.utils.import_utils import KERNELS_MAX_VERSION, KERNELS_MIN_VERSION, is_kernels_available

    if not is_kernels_available():
        raise VramPlanError(f"{why} needs the kernels package ({KERNELS_MIN_VERSION} or newer, below "
                            f"{KERNELS_MAX_VERSION}), which transformers {transformers_version} loads the Hub's kernels "
                            f"with: pip install 'kernels>={KERNELS_MIN_VERSION},<{KERNELS_MAX_VERSION}'")


def require_vllm(why: str) -> None:
    """vLLM must be installed at a release TRL 1.16 accepts (VLLM_RANGE) for `why` (e.g. '--use-vllm'). Found, not
    imported: importing vLLM takes seconds and initialises CUDA."""
    from packaging.specifiers import SpecifierSet

    version = _installed_version("vllm", f"{why} needs vLLM {VLLM_RANGE}, which is not installed: {VLLM_EXTRA}")
    if version is not None and not SpecifierSet(VLLM_RANGE).contains(version, prereleases=True):
        raise VramPlanError(f"{why} needs vLLM {VLLM_RANGE}, the releases TRL 1.16 accepts (installed: {version}): "
                            f"{VLLM_EXTRA}")


def _installed_version(package: str, missing: str) -> str | None:
    """The installed version of `package`; VramPlanError(`missing`) when it cannot be imported, None when it can but
    has no metadata (a source checkout: trusted)."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise VramPlanError(missing)
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
