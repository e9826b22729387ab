"""Rollout engines outside the actor: weight sync to a separate engine (weight_sync.py) and the optional
vLLM adapter (vllm_adapter.py; vLLM itself is imported lazily, only when `rollout.engine: vllm`)."""
