"""The megatron-core engine of rltrain: one engine for CPU (gloo, CI) and GPU (NCCL).

Modules: `parallel` (process groups), `cpu_compat` (CPU redirects of megatron's CUDA assumptions, cpu only),
`model` (TransformerConfig, GPTModel chunks, DDP, optimizer, lr schedule), `logprob` (vocab-parallel
log-probs and entropy), `engine` (batch layout and schedules), `actor` / `critic` (the roles) and
`hf_weights` (Hugging Face import/export). Nothing is imported here: `import megatron.core` costs seconds.
"""
