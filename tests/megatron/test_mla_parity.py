"""megatron-core 0.16.1's MLA and DeepSeek routing (rltrain.megatron.mla: MLATransformerConfig, the local
spec with SDPA core attention, the HF -> megatron mapping) against transformers' DeepseekV3ForCausalLM on
tiny random folders made by transformers: MLA with q_lora_rank set and unset, 2 dense + 2 MoE layers,
group-limited sigmoid routing with a non-zero e_score_correction_bias, a shared expert; fp32 CPU, TP = 1."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from ._common import init_groups

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow]

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8,
            n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=2, max_position_embeddings=64,
            num_nextn_predict_layers=0)  # fmt: skip
"""topk / topk_group = 2: megatron scores a group by its top (topk / group_topk) experts, transformers by 2."""


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q-lora", "no-q-lora"])
def test_megatron_mla_logits_match_transformers(mp_world, q_lora_rank):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from safetensors.torch import load_file

    from rlconf.model_spec import read_model_arch
    from rltrain.megatron.cpu_compat import cuda_to_cpu
    from rltrain.megatron.mla import hf_to_megatron, local_mla_block_spec, mla_config_kwargs

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**TINY, q_lora_rank=q_lora_rank, attn_implementation="eager")
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in hf.model.layers[2:]:  # the score bias must steer the choice, as DeepSeek trained it
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.05)
            layer.mlp.gate.weight.normal_(0, 0.5)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        arch = read_model_arch(tmp)
        state = load_file(str(Path(tmp) / "model.safetensors"))
    mcfg = MLATransformerConfig(**mla_config_kwargs(arch), use_cpu_initialization=True,
                                params_dtype=torch.float32)  # fmt: skip
    with cuda_to_cpu():
        model = GPTModel(mcfg, local_mla_block_spec(mcfg), vocab_size=64, max_sequence_length=64,
                         position_embedding_type="none", share_embeddings_and_output_weights=False).eval()  # fmt: skip
        missing, unexpected = model.load_state_dict(hf_to_megatron(arch, state), strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(12)[None].expand(2, -1)
        with torch.no_grad():
            got = model(ids, pos, attention_mask=None)
            want = hf(ids).logits
    # fp32, reductions over <= 48 terms through 4 layers: differences are rounding (~1e-6 of |logit| ~ 1)
    diff = (got - want).abs().max().item()
    print(f"max |logit diff| megatron MLA vs transformers ({q_lora_rank=}): {diff:.3g}")
    assert diff < 1e-5
    lp_got, lp_want = torch.log_softmax(got, -1), torch.log_softmax(want, -1)
    assert (lp_got - lp_want).abs().max().item() < 1e-5

    # Back to Hugging Face: bit-identical tensors, and an export folder transformers loads as deepseek_v3
    # with the same logits.
    import json

    from safetensors.torch import save_file

    from rlconf.model_spec import hf_config
    from rltrain.megatron.mla import megatron_to_hf

    meg = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    back = megatron_to_hf(arch, meg)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    with tempfile.TemporaryDirectory() as tmp:
        save_file({k: v.contiguous() for k, v in back.items()}, str(Path(tmp) / "model.safetensors"))
        (Path(tmp) / "config.json").write_text(json.dumps(hf_config(arch, "float32")))
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager").eval()
        assert again.config.model_type == "deepseek_v3"
        with torch.no_grad():
            assert torch.equal(again(ids).logits, want)


def _ep_worker(rank: int, world: int, port: int, folder: str, ids: torch.Tensor, out: str) -> None:
    from ._common import run_spawned

    run_spawned(_ep_forward, rank, world, port, folder, ids, out)


def _ep_forward(rank: int, world: int, port: int, folder: str, ids: torch.Tensor, out: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from safetensors.torch import load_file

    from rlconf.config import MegatronConfig
    from rlconf.model_spec import read_model_arch
    from rltrain.megatron.cpu_compat import cuda_to_cpu
    from rltrain.megatron.mla import hf_to_megatron, local_mla_block_spec, mla_config_kwargs
    from rltrain.megatron.parallel import destroy_parallel

    init_groups(MegatronConfig(expert_model_parallel_size=2), "cpu", rank=rank, world_size=world,
                  master_port=port)  # fmt: skip
    assert parallel_state.get_expert_model_parallel_world_size() == 2
    arch = read_model_arch(folder)
    mcfg = MLATransformerConfig(**mla_config_kwargs(arch), expert_model_parallel_size=2,
                                use_cpu_initialization=True, params_dtype=torch.float32)  # fmt: skip
    state = hf_to_megatron(arch, load_file(str(Path(folder) / "model.safetensors")), rank, 2)
    with cuda_to_cpu():
        model = GPTModel(mcfg, local_mla_block_spec(mcfg), vocab_size=64, max_sequence_length=64,
                         position_embedding_type="none", share_embeddings_and_output_weights=False).eval()  # fmt: skip
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), missing
        with torch.no_grad():
            logits = model(
                ids, torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1), attention_mask=None
            )
    torch.save(logits, f"{out}/logits{rank}.pt")
    destroy_parallel()


@pytest.mark.multiproc
def test_megatron_mla_logits_match_transformers_at_ep2(tmp_path):
    """Experts split over two expert-parallel ranks (4 each; tokens exchanged by megatron's alltoall
    dispatcher over gloo): both ranks' logits equal transformers' within fp32 rounding."""
    import torch.multiprocessing as mp

    from ._common import free_port

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**TINY, q_lora_rank=24, attn_implementation="eager")
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in hf.model.layers[2:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.05)
            layer.mlp.gate.weight.normal_(0, 0.5)
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    mp.spawn(_ep_worker, args=(2, free_port(), str(folder), ids, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        diff = (torch.load(tmp_path / f"logits{rank}.pt") - want).abs().max().item()
        print(f"EP=2 rank {rank}: max |logit diff| vs transformers {diff:.3g}")
        assert diff < 1e-5
