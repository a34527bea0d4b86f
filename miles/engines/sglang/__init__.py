"""miles.engines.sglang: the SGLang rollout backend (``--rollout-backend sglang``).

- ``adapter.py``   SGLangEngine — a RolloutEngine over one SGLang HTTP server
- ``config.py``    SGLangConfig (the ``--sglang-*`` flags)
- ``launch.py``    the ``sglang.launch_server`` command line and the server process
- ``client.py``    the aiohttp client (shared session, timeouts, health wait)
- ``responses.py`` request bodies and response parsing (tokens, log-probs, versions, R3)

The package itself does not import sglang: it speaks HTTP, and only launching a server
needs ``pip install 'miles[sglang]'``. Its tests run against ``miles serve``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from miles.engines.sglang.adapter import SGLangEngine
from miles.engines.sglang.client import SGLangError
from miles.engines.sglang.config import SGLangConfig
from miles.engines.sglang.launch import build_launch_command

__all__ = ["SGLangConfig", "SGLangEngine", "SGLangError", "build_launch_command", "build_sglang_engine",
           "run_server_args"]


def run_server_args(cfg: Any) -> dict[str, Any]:
    """SGLang server flags a run's own settings imply, for servers miles launches:
    ``--enable-return-routed-experts`` under routing replay, the speculative section's
    ``--speculative-*``. ``--sglang-*`` passthrough flags override them."""
    from miles.engines.spec import sglang_args

    args: dict[str, Any] = {}
    if cfg.trainer.use_rollout_routing_replay:
        args["enable-return-routed-experts"] = True
    spec = getattr(cfg, "speculative", None)
    if spec is not None:
        args.update(sglang_args(spec))
    return args


def build_sglang_engine(cfg: Any, *, index: int = 0) -> SGLangEngine:
    """The adapter for rollout worker ``index`` of a run (``cfg`` is a MilesConfig with an
    ``sglang`` section): its URL from ``--sglang-urls``, or a server it launches."""
    config: SGLangConfig = cfg.sglang
    config.validate()
    implied = run_server_args(cfg)
    if implied and config.sglang_launch:
        config = msgspec.structs.replace(config, sglang_server_args={**implied, **config.sglang_server_args})
    url = None
    if config.sglang_urls:
        if index >= len(config.sglang_urls):
            raise ValueError(f"rollout worker {index} has no server: --sglang-urls lists "
                             f"{len(config.sglang_urls)} (one per worker)")
        url = config.sglang_urls[index]
    return SGLangEngine(config, url=url, model_path=cfg.rollout.hf_checkpoint,
                        seed=cfg.run.seed + index, index=index)
