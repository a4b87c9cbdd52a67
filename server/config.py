"""ServerConfig: what the HTTP front end needs beyond the engine's EngineConfig (listen address, auth, the
served model name, admission and body-size limits). A frozen dataclass, validated on construction; the CLI
fills it from flags. The server's environment variables are read here and nowhere else: DDTREE_API_KEY (the
API key when --api-key is not given, so that the secret need not appear in `ps`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from engine.config import opt

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
API_KEY_ENV = "DDTREE_API_KEY"


def api_key_from_env() -> Optional[str]:
    """DDTREE_API_KEY, surrounding whitespace removed (a trailing newline from a secret file); unset or empty
    means no key (as vLLM treats VLLM_API_KEY)."""
    key = os.environ.get(API_KEY_ENV, "").strip()
    return key or None


@dataclass(frozen=True)
class ServerConfig:
    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(8000, "port to listen on")
    api_key: Optional[str] = opt(None, "require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                                       "(default: $DDTREE_API_KEY, which keeps the key out of `ps`)")
    served_model_name: Optional[str] = opt(None, "the model id clients send (default: from MODEL)")
    chat_template: Optional[str] = opt(None, "chat template to use instead of the model's: a file path, or the "
                                             "Jinja template itself (as vLLM's flag)")
    max_queue_len: int = opt(1024, "engine requests in flight (running + waiting) beyond which requests get a 429")
    max_body_bytes: int = opt(4 << 20, "request bodies above this size get a 413", kind="bytes")
    drain_timeout_s: float = opt(30.0, "on SIGTERM: seconds open requests get in total before they are cut",
                                 flag="--drain-timeout")
    log_level: str = opt("info", "log level", choices=("debug", "info", "warning", "error"))
    access_log: bool = opt(True, "log every HTTP request")

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1, got {self.max_queue_len}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout must be >= 0 seconds, got {self.drain_timeout_s}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty")
        if self.chat_template is not None and not self.chat_template.strip():
            raise ValueError("chat_template must not be empty")

    def model_name(self, model_path: Optional[str]) -> str:
        """The id clients send as `model`: the flag, else the checkpoint's folder or file name."""
        if self.served_model_name:
            return self.served_model_name
        if model_path is None:
            return EMBEDDED_MODEL_NAME
        name = os.path.basename(os.path.normpath(os.path.expanduser(model_path)))
        return name.removesuffix(".gguf") or model_path
