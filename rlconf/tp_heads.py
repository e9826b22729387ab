"""Which tensor parallel sizes megatron-core 0.16.1 builds attention at: the attention heads divide by tp,
and the KV heads (query groups) either divide by tp or divide tp. In the second case (tp above the KV-head
count, e.g. a rollout at TP = 8 over 4 KV heads) megatron replicates each KV head over tp / groups ranks:
`SelfAttention` gathers the fused q/k/v activations over the TP group, takes its own query group and its
own heads of it, and keeps one KV head per rank (the KV cache of the embedded rollout engine, sized by
`num_query_groups_per_partition`, holds that one head); vLLM does the same. Used by rlconf.validate and
rlconf.plan.compile under rule `heads-divisible-by-tp`.
"""

from __future__ import annotations


def tp_head_errors(heads: int, groups: int, tp: int) -> list[tuple[str, str, str]]:
    """(field, message, fix) for each reason megatron refuses attention with `heads` heads and `groups`
    KV heads at tensor parallel size `tp` (field: num_attention_heads or num_query_groups)."""
    out = []
    if heads % tp:
        out.append(("num_attention_heads", f"num_attention_heads = {heads} is not divisible by tp = {tp}",
                    f"use a tensor parallel size that divides {heads}"))  # fmt: skip
    if groups % tp and tp % groups:
        out.append((
            "num_query_groups",
            f"num_query_groups = {groups} neither divides nor is divisible by tp = {tp} (megatron replicates KV "
            "heads only when tp is a multiple of their count)",
            f"use a tensor parallel size that divides {groups} or is a multiple of it",
        ))  # fmt: skip
    return out
