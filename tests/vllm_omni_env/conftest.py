"""Shared fixtures of the vllm-omni test env (marked vllm_omni_env: run with
.venv-vllm-omni/bin/python -m pytest -o addopts=-ra -m vllm_omni_env tests/vllm_omni_env)."""

from __future__ import annotations

import socket

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def vllm_cpu_layers():
    """vLLM linear layers need a VllmConfig and a TP group; on CPU: DeviceConfig('cpu') + a 1-rank gloo group.
    Session-scoped: vLLM's model-parallel groups can be initialised only once per process."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    import vllm.lora.lora_model as lora_model_module

    ctx = set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu")))
    ctx.__enter__()
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{_free_port()}", backend="gloo")
    initialize_model_parallel(1, 1)
    # Without a detected platform vLLM assumes pinned memory is available; pinning needs a CUDA driver.
    saved_pin = lora_model_module.PIN_MEMORY
    lora_model_module.PIN_MEMORY = False
    from vllm.model_executor.layers import linear

    yield linear
    lora_model_module.PIN_MEMORY = saved_pin
    ctx.__exit__(None, None, None)
