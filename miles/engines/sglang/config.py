"""SGLangConfig: how rollout workers reach SGLang servers (``--rollout-backend sglang``).

Field names are the CLI flags (``sglang_weight_update`` ↔ ``--sglang-weight-update``). Every
field starts with ``sglang_``, so none collides with another section's flags; the passthrough
``--sglang-<server-flag> value`` options that ``miles.config`` collects land in
``sglang_server_args`` and go to the launched server verbatim. The defaults describe no
deployment (no URL, no launch); ``validate`` is called when the backend is built, not at
config load, so runs with the embedded backend never trip over it.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

PauseMode = Literal["auto", "in_place", "retract", "abort"]


class SGLangConfig(msgspec.Struct, kw_only=True):
    # Connect: rollout worker i drives sglang_urls[i] (one server per worker: each worker
    # updates its server's weights). Or launch one server per worker on the worker's host.
    sglang_urls: list[str] = []
    sglang_launch: bool = False  # launch one SGLang server per rollout worker instead of connecting
    # The launch command before the flags; empty = [python, -m, sglang.launch_server].
    # (["python", "-m", "miles", "serve"] launches the embedded engine instead.)
    sglang_launch_command: list[str] = []
    sglang_host: str = "127.0.0.1"  # launched servers bind here
    sglang_port: int = 30000  # worker i's launched server listens on port + i (0: any free port)
    # --sglang-<flag> passthrough: SGLang ServerArgs flags for launched servers
    sglang_server_args: dict[str, Any] = {}
    # How committed weights reach the server: NCCL/gloo broadcast from the worker's process
    # (/update_weights_from_distributed), or a safetensors directory the server can read
    # (/update_weights_from_disk; a shared or local filesystem).
    sglang_weight_update: Literal["distributed", "disk"] = "distributed"
    sglang_weight_backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl with CUDA
    sglang_weight_master_address: str | None = None  # this host as the server sees it (auto)
    sglang_weight_master_port: int = 0  # 0: a free port
    sglang_weight_dir: str | None = None  # disk updates; None: a temporary directory
    # /pause_generation mode around a weight update. auto: in_place when the worker keeps
    # the KV cache, else abort (requests come back partial and resume on the new weights).
    # retract needs SGLang >= 0.5.23 (0.5.15.post1 cannot flush the cache after it).
    sglang_pause_mode: PauseMode = "auto"
    sglang_timeout_s: float = 600.0  # control calls and weight transfers
    sglang_startup_timeout_s: float = 900.0  # until /health_generate answers 200

    def validate(self) -> None:
        if not self.sglang_urls and not self.sglang_launch:
            raise ValueError("--rollout-backend sglang needs --sglang-urls URL ... or --sglang-launch")
        if self.sglang_urls and self.sglang_launch:
            raise ValueError("give either --sglang-urls (connect) or --sglang-launch, not both")
        for url in self.sglang_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--sglang-urls: {url!r} is not an http(s) URL")
        if self.sglang_timeout_s <= 0 or self.sglang_startup_timeout_s <= 0:
            raise ValueError("--sglang-timeout-s and --sglang-startup-timeout-s must be > 0")
        if not 0 <= self.sglang_port < 65536 or not 0 <= self.sglang_weight_master_port < 65536:
            raise ValueError("ports must be in [0, 65536)")
