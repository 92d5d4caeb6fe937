"""Model configs from the Hugging Face hub, through transformers (imported only here).

Offline, huggingface_hub retries a failed metadata request five times with exponential backoff (1+2+4+8+8 s)
and logs two lines per try, before transformers gives up: half a minute and a dozen lines for an answer that one
request gives. So the hub is asked once first, without retries; when it does not answer, only the local cache is
read (no network, no retries). Online, transformers loads the config as it always does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from vram_planner.errors import HubUnavailableError, first_line

# Long enough for a slow link to answer a HEAD request, short enough to answer a user who is offline at once.
HUB_PROBE_TIMEOUT_S = 4.0


def hub_unreachable_reason(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the Hugging Face hub cannot be reached now, in a few words (None when it answers, or when there is no
    huggingface_hub to ask with).

    One HEAD request to the hub's endpoint through huggingface_hub's own client (so HF_ENDPOINT, proxies and
    certificates are as for every download), without retries. HF_HUB_OFFLINE counts as unreachable. Call it before
    anything that downloads from the hub (transformers, datasets) to fail fast, or read only the cache, offline.
    """
    try:
        from huggingface_hub import constants, get_session
    except ImportError:
        return None
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout_s)  # any answer, even an error status, will do
    except Exception as exc:  # the client's transport errors (its HTTP library is huggingface_hub's choice)
        return f"{constants.ENDPOINT} did not answer: {first_line(exc, f'no answer within {timeout_s:g} s', 120)}"
    return None


@contextlib.contextmanager
def quiet_hub_logs() -> Iterator[None]:
    """Silence huggingface_hub's and transformers' warnings (retries, deprecations) for the duration: the caller
    reports failures in its own one line. Import the libraries first: importing them sets their loggers' levels."""
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "transformers")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def fetch_hub_config(hub_id: str) -> dict[str, Any]:
    """The config.json of a hub repository as a dict; a clear error when offline or unknown."""
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.utils import validate_repo_id
    except ImportError as exc:
        raise HubUnavailableError(
            f"{hub_id!r} is not in the catalog, and reading it from the hub needs transformers "
            "(pip install 'vram-plan[train]'); or pass a local config.json") from exc
    try:
        validate_repo_id(hub_id)
    except ValueError as exc:  # huggingface_hub's HFValidationError; its text ends by quoting the id
        rule = str(exc).splitlines()[0].split(": '")[0][:200]
        shown = repr(hub_id) if len(hub_id) <= 80 else repr(hub_id[:76] + "...")
        raise HubUnavailableError(f"{shown} is neither a catalog model (`vram-plan models`) nor a hub id: "
                                  f"{rule}") from exc
    offline = hub_unreachable_reason()
    if offline is not None and not isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
        raise HubUnavailableError(
            f"cannot read {hub_id!r}: the Hugging Face hub cannot be reached ({offline}) and it is not in the "
            "local cache; check the network, or pass a local config.json or model folder")
    return _load_config(hub_id, local_files_only=offline is not None)


def _load_config(hub_id: str, local_files_only: bool) -> dict[str, Any]:
    try:
        from transformers import AutoConfig  # before quiet_hub_logs: importing it sets its logger's level
    except ImportError as exc:
        raise HubUnavailableError(
            f"{hub_id!r} is not in the catalog, and reading it from the hub needs transformers "
            "(pip install 'vram-plan[train]'); or pass a local config.json") from exc
    try:
        with quiet_hub_logs():
            config = AutoConfig.from_pretrained(hub_id, local_files_only=local_files_only)
    except OSError as exc:
        raise HubUnavailableError(
            f"cannot read {hub_id!r} from the Hugging Face hub ({first_line(exc, limit=200)}); "
            "check the id and the network, or pass a local config.json or model folder") from exc
    except ValueError as exc:
        raise HubUnavailableError(f"transformers cannot read the config of {hub_id!r}: {first_line(exc, limit=200)}"
                                  ) from exc
    return config.to_dict()
