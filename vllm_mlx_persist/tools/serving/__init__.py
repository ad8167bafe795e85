"""Real `vllm-mlx serve` processes for every tool and test: one server (server.py), started through a
fork server where the tests ask for it (forkserver.py), watched for memory (rss.py), on what the host
offers (machine.py); the compared systems' servers by name (systems.py); a throwaway Redis
(redis_server.py)."""

from .machine import cpu_name, openblas_path
from .rss import RssSampler
from .redis_server import RedisServer
from .server import VLLM_MLX, Server, free_port
from .systems import COMMON_ARGS, SERVER_SYSTEMS, system_flags, system_server

__all__ = ["COMMON_ARGS", "SERVER_SYSTEMS", "VLLM_MLX", "RedisServer", "RssSampler", "Server", "cpu_name", "free_port",
           "openblas_path", "system_flags", "system_server"]
