"""Use a trained model: an OpenAI-compatible HTTP server and an interactive terminal chat.

    posttrain serve runs/sft/final --port 8000 [--api-key KEY] [--engine hf|vllm]
    posttrain chat runs/sft/final [--system "You are terse."]

    from posttrain.serve import make_backend, start_server
    with start_server(make_backend("runs/sft/final"), "final") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

Requests share the engine through continuous batching (`posttrain.rollout.continuous`); docs/serve.md has the
endpoints, the error rules and measured throughput.
"""

from posttrain.serve.app import create_app
from posttrain.serve.backends import Backend, HFBackend, VLLMBackend
from posttrain.serve.errors import APIError, ServeError
from posttrain.serve.server import (ServerHandle, free_port, load_engine, make_backend, serve, serving_threads,
                                   start_server)
from posttrain.serve.chat import ChatSettings, run_chat

__all__ = [
    "APIError",
    "Backend",
    "ChatSettings",
    "HFBackend",
    "ServeError",
    "ServerHandle",
    "VLLMBackend",
    "create_app",
    "free_port",
    "load_engine",
    "make_backend",
    "run_chat",
    "serve",
    "serving_threads",
    "start_server",
]
