"""The megatron-core engine of rltrain: one engine for CPU (gloo, CI) and GPU (NCCL).

Modules: `parallel` (process groups), `cpu_compat` (CPU redirects of megatron's CUDA assumptions, cpu only),
`model` (TransformerConfig, GPTModel chunks, DDP, optimizer, lr schedule), `logprob` (vocab-parallel
log-probs and entropy, chunked over tokens), `engine` (batch layout, micro-batching, DP-correct loss
weights, schedules, offload), `offload` (moving parameters / gradients / optimizer state to host memory and
back), `actor` / `critic` (the roles), `inference` (KV-cache generation) and `hf_weights` (Hugging Face
import/export). Nothing is imported here: `import megatron.core` costs seconds.
"""
