"""Pipeline layer split: how many decoder layers each pipeline stage (and each virtual chunk of it) builds,
and which layouts megatron-core 0.16.1 refuses, without importing megatron.

megatron splits `num_layers` evenly over pp x vpp chunks unless one of its uneven forms is set:
`num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage` (the named stages take that many
layers, the middle stages share the rest evenly), or `account_for_embedding_in_pipeline_split` /
`account_for_loss_in_pipeline_split` (the embedding and the loss count as one layer each, so the first and
last chunks build one decoder layer fewer: Qwen3-235B-A22B's 94 layers + 2 at PP = 8 are 12 per stage).
`chunk_layer_counts` mirrors megatron's `get_num_layers_to_build` / `get_transformer_layer_offset` and
`split_errors` its TransformerConfig.__post_init__ checks plus the asserts of `get_num_layers_to_build`
(tests/test_pipeline_split.py compares both with megatron's own functions). The plan (rlconf.plan.compile)
shows the per-stage counts and the validator (rlconf.validate_pipeline) reports the errors under rule
`layers-divisible-by-pp`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineSplit:
    """The pipeline-split options of one role (megatron TransformerConfig fields of the same names)."""

    num_layers: int
    pp: int
    vpp: int | None = None
    first: int | None = None
    last: int | None = None
    embedding: bool = False
    loss: bool = False

    @property
    def uneven(self) -> bool:
        """Whether any of megatron's uneven forms is set."""
        return self.first is not None or self.last is not None or self.embedding or self.loss


def split_errors(s: PipelineSplit) -> list[str]:
    """megatron's reasons to refuse this split (empty: megatron builds it). The messages say what megatron
    checks, in its own terms."""
    pp, v = s.pp, s.vpp
    if (s.first is not None or s.last is not None) and (s.embedding or s.loss):
        return [
            "num_layers_in_first/last_pipeline_stage cannot be set together with "
            "account_for_embedding/loss_in_pipeline_split (megatron refuses the combination)"
        ]
    if s.first is not None or s.last is not None:
        if pp == 1:  # megatron takes it and builds nonsense counts (its first stage is also its last)
            return ["num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1"]
        errs = []
        layers, stages = s.num_layers, pp
        for name, n in (
            ("num_layers_in_first_pipeline_stage", s.first),
            ("num_layers_in_last_pipeline_stage", s.last),
        ):
            if n is None:
                continue
            if n <= 0:
                return [f"{name} = {n} must be larger than 0"]
            if v is not None and n % v:
                errs.append(f"{name} = {n} is not divisible by virtual_pipeline_model_parallel_size = {v}")
            layers -= n
            stages -= 1
        if layers < 0:
            return [f"the first and last stages take more than num_layers = {s.num_layers} layers"]
        if v is not None and stages == 0:  # get_transformer_layer_offset divides by the middle stages
            errs.append(
                "with virtual pipeline stages megatron-core 0.16.1 needs a middle pipeline stage when both "
                "num_layers_in_first_pipeline_stage and num_layers_in_last_pipeline_stage are set (pp > 2)"
            )
        if bool(layers) != bool(stages):
            errs.append(
                f"{layers} layers remain for {stages} middle pipeline stages (num_layers = {s.num_layers}, "
                f"pp = {pp}); megatron needs middle layers exactly when there are middle stages"
            )
        elif stages and layers % stages:
            errs.append(
                f"the {layers} middle layers are not divisible by the {stages} middle pipeline stages"
            )
        elif stages and v is not None and (layers // stages) % v:
            errs.append(
                f"each middle stage's {layers // stages} layers are not divisible by "
                f"virtual_pipeline_model_parallel_size = {v}"
            )
        return errs
    total = s.num_layers + int(s.embedding) + int(s.loss)
    what = "num_layers" + (" + embedding" if s.embedding else "") + (" + loss" if s.loss else "")
    if total % pp:
        return [f"{what} = {total} is not divisible by pipeline_model_parallel_size = {pp}"]
    if v is not None and (total // pp) % v:
        return [
            f"the {total // pp} layers of each stage ({what} = {total} / pp = {pp}) are not divisible by "
            f"virtual_pipeline_model_parallel_size = {v}"
        ]
    return []


def chunk_layer_counts(s: PipelineSplit) -> list[list[int]]:
    """Decoder layers of each chunk: [stage][virtual chunk] (one chunk per stage without vpp). Model order
    is (virtual chunk, stage): chunk v of stage p follows chunk v of stage p - 1, and chunk v + 1 of stage 0
    follows chunk v of the last stage. Only meaningful when `split_errors(s)` is empty."""
    pp, v = s.pp, s.vpp if s.vpp is not None and s.pp > 1 else None
    vs = v or 1
    counts = []
    for p in range(pp):
        if s.first is not None or s.last is not None:
            middle_layers = s.num_layers - (s.first or 0) - (s.last or 0)
            middle_stages = pp - (s.first is not None) - (s.last is not None)
            per_stage = middle_layers // middle_stages if middle_stages > 0 else 0
            if p == 0 and s.first is not None:
                per_stage = s.first
            if p == pp - 1 and s.last is not None:
                per_stage = s.last
        else:
            per_stage = (s.num_layers + int(s.embedding) + int(s.loss)) // pp
        row = []
        for k in range(vs):
            n = per_stage // vs
            if s.embedding and k == 0 and p == 0:
                n -= 1
            if s.loss and k == vs - 1 and p == pp - 1:
                n -= 1
            row.append(n)
        counts.append(row)
    return counts


def chunk_starts(counts: list[list[int]]) -> list[list[int]]:
    """First global layer index (0-based) of each chunk of `chunk_layer_counts`, in model order."""
    pp, vs = len(counts), len(counts[0])
    starts = [[0] * vs for _ in range(pp)]
    at = 0
    for k in range(vs):
        for p in range(pp):
            starts[p][k] = at
            at += counts[p][k]
    return starts
