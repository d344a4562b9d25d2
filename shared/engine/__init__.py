"""The paged-KV engine shared by both worker roles (docs/architecture.md, "Engine").

``core.py`` (``EngineCore``), ``scheduler.py``, ``kv_cache_manager.py``, ``block_pool.py``,
``request.py``, ``sampling_params.py``, ``outputs.py`` and ``connector.py`` are plain Python: no
torch import, testable with a fake model runner. Only ``model_runner.py`` and ``sampler.py``
(and ``shared/models``) touch tensors. ``llm.py`` is the offline ``LLM`` API.
"""

from shared.config import EngineArgs
from shared.engine.core import (
    DuplicateRequestError,
    EngineCore,
    EngineStats,
    InvalidRequestError,
    PromptTooLongError,
    RequestFailedError,
)
from shared.engine.llm import LLM
from shared.engine.request import RequestStatus
from shared.engine.sampling_params import SamplingParams, SamplingParamsError

__all__ = [
    "LLM",
    "EngineArgs",
    "EngineCore",
    "EngineStats",
    "SamplingParams",
    "SamplingParamsError",
    "InvalidRequestError",
    "PromptTooLongError",
    "DuplicateRequestError",
    "RequestFailedError",
    "RequestStatus",
]
