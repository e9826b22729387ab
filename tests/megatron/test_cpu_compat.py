"""One test per CUDA assumption of megatron-core that the device layer's cpu case redirects on CPU.

The cpu case is rltrain.megatron.cpu_compat, reached through rltrain.device (`prepare_process("cpu")`,
`device_context("cpu")`), as every run reaches it. If a megatron upgrade moves one of these assumptions, the
matching test names what broke."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.megatron._common import spawn

# megatron-core warns about missing apex / Transformer Engine and deprecated arguments on every build.
_QUIET = [
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
]
pytestmark = _QUIET


@pytest.fixture()
def compat(mp_world):
    from rltrain import device as devices
    from rltrain.megatron import cpu_compat

    devices.prepare_process("cpu", local_rank=0)
    assert cpu_compat.is_enabled()
    return cpu_compat


def test_device_context_is_the_rewrite_mode_on_cpu_only(compat):
    # The engine, checkpoint and export code enter rltrain.device.device_context around megatron calls.
    from rltrain.device import device_context

    with device_context("cpu"):
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    with device_context("cuda"), pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def test_enable_is_idempotent(compat):
    before = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.get_rng_state)
    compat.enable_cpu_compat()
    assert (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.get_rng_state) == before
    assert compat.is_enabled()


def test_current_device_is_cpu(compat):
    # megatron: device=torch.cuda.current_device() in layers, rotary embedding, grad buffers, p2p shapes.
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"


def test_synchronize_is_noop(compat):
    # megatron: p2p_communication, parallel_state barriers, DDP offload.
    assert torch.cuda.synchronize() is None


def test_rng_tracker_forks_cpu_state(compat):
    # megatron.core.tensor_parallel.random: CudaRNGStatesTracker.add/fork and model_parallel_cuda_manual_seed
    # call torch.cuda.get_rng_state / manual_seed and megatron's _get/_set_cuda_rng_state.
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(123)
    tracker = get_cuda_rng_tracker()
    outside_state = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside_state), "fork must restore the default CPU state"
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b), "the tracked state must advance across forks"
    model_parallel_cuda_manual_seed(123)
    with get_cuda_rng_tracker().fork():
        c = torch.rand(3)
    assert torch.equal(a, c), "re-seeding reproduces the tracked stream"


def test_cuda_rng_functions_redirect(compat):
    import megatron.core.tensor_parallel.random as mp_random

    torch.cuda.manual_seed(5)
    state = torch.cuda.get_rng_state()
    x = torch.rand(2)
    mp_random._set_cuda_rng_state(state)
    assert torch.equal(torch.rand(2), x)
    assert torch.equal(mp_random._get_cuda_rng_state(), torch.get_rng_state())


def test_literal_cuda_device_is_rewritten(compat):
    # megatron: schedules (total_num_tokens), optimizer (found_inf, _scale_one), clip_grads, utils l2 norm.
    from megatron.core.utils import local_multi_tensor_l2_norm

    with compat.cuda_to_cpu():
        assert torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
        assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
        norm, _ = local_multi_tensor_l2_norm(0, None, [[torch.ones(4)]], False)
    assert norm.item() == pytest.approx(2.0)


def test_tensor_cuda_and_to_cuda(compat):
    # megatron: .cuda() in distrib_optimizer (gloo gather), optimizer state reload, utils param hashes.
    t = torch.ones(2)
    with compat.cuda_to_cpu():
        assert t.cuda() is t
        assert t.to("cuda").device.type == "cpu"
        assert t.to(device="cuda:0").device.type == "cpu"
        assert t.to(torch.float64).dtype == torch.float64


def test_type_names_report_cuda(compat):
    # megatron: distrib_optimizer / optimizer / clip_grads compare Tensor.type() to 'torch.cuda.*Tensor'.
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    with compat.cuda_to_cpu():
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    assert torch.zeros(1).type() == "torch.FloatTensor", "outside the mode types are untouched"
    assert p.grad[0].item() == pytest.approx(0.5, rel=1e-4)


def test_mode_is_per_thread_and_reentrant(compat):
    errors: list[BaseException] = []

    def other_thread():
        try:
            with compat.cuda_to_cpu():
                assert torch.zeros(1, device="cuda").device.type == "cpu"
        except BaseException as e:
            errors.append(e)

    with compat.cuda_to_cpu(), compat.cuda_to_cpu():
        th = threading.Thread(target=other_thread)
        th.start()
        th.join()
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    assert not errors
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def test_cpu_config_uses_unbatched_p2p(mp_world):
    # gloo matches p2p messages by posting order; megatron's batched p2p swaps tensors with PP=2 + VPP.
    from rlconf.plan import small_plan
    from rltrain.megatron.model import transformer_config

    from ._common import tiny_model_cfg

    spec = small_plan(tiny_model_cfg(), "cpu").engine("actor")
    assert transformer_config(spec.model.arch, spec.layout, spec.settings, "cpu").batch_p2p_comm is False


def test_cuda_streams_are_cpu_stand_ins(compat):
    # megatron MoE alltoall dispatcher: torch.cuda.Stream() once per process for its device-to-host copies,
    # current_stream() compared with it, torch.cuda.stream(s) around the copies, record_event().synchronize().
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    side = torch.cuda.Stream()
    assert torch.cuda.current_stream() == side  # one CPU stream: no side stream to wait for
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = torch.ones(2) * 3
    side.record_event().synchronize()
    assert x.tolist() == [3.0, 3.0]
    assert MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None or isinstance(
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream, compat.CpuStream
    )


def test_dispatcher_split_sizes_become_numpy(compat):
    # megatron MoE alltoall dispatcher: maybe_move_tensor_to_cpu(splits, as_numpy=True) converts only CUDA
    # tensors; all_to_all_single refuses tensor split sizes.
    import numpy as np
    from megatron.core.transformer.moe import token_dispatcher

    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([2, 3]), as_numpy=True)
    assert isinstance(splits, np.ndarray) and splits.tolist() == [2, 3]
    counts = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([4, 1]))
    assert torch.is_tensor(counts) and counts.tolist() == [4, 1]
    assert token_dispatcher.maybe_move_tensor_to_cpu(None) is None


def test_moe_router_runs_without_transformer_engine(mp_world):
    # megatron-core 0.16.1 moe_utils reads te_general_gemm even when Transformer Engine is absent (NameError);
    # rltrain.megatron.model.define_missing_te_names gives it None, so the router takes its torch.mm path.
    from megatron.core.transformer.moe import moe_utils

    from rltrain.megatron.model import define_missing_te_names

    define_missing_te_names()
    x, w = torch.randn(5, 8), torch.randn(4, 8)
    assert torch.allclose(moe_utils.router_gating_linear(x, w, None, torch.float32), x @ w.t())


def _crossing_sends(rank: int, port: int, out_dir: str) -> None:
    """Both ranks send to each other first and receive after, through megatron's `_p2p_ops` as the
    pipeline calls it: with sends that wait for their receive (plain gloo) neither rank gets to its
    receive; with cpu_compat's deferred sends both complete."""
    import os

    from megatron.core.pipeline_parallel import p2p_communication

    from rltrain import device as devices
    from rltrain.megatron.parallel import init_distributed

    init_distributed("cpu", rank=rank, world_size=2, master_port=port)
    devices.prepare_process("cpu", local_rank=0)
    group = torch.distributed.new_group([0, 1])
    peer = 1 - rank
    big = torch.full((1 << 20,), float(rank))  # 4 MiB: larger than a socket buffer, so a plain send blocks
    got = torch.empty_like(big)
    for req in p2p_communication._p2p_ops(tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=big,
                                          tensor_recv_next=None, group=group, prev_pipeline_rank=peer,
                                          next_pipeline_rank=peer).values():  # fmt: skip
        req.wait()  # the pipeline waits for what _p2p_ops returns: here, nothing
    for req in p2p_communication._p2p_ops(tensor_send_prev=None, tensor_recv_prev=got, tensor_send_next=None,
                                          tensor_recv_next=None, group=group, prev_pipeline_rank=peer,
                                          next_pipeline_rank=peer).values():  # fmt: skip
        req.wait()
    from rltrain.megatron import cpu_compat

    cpu_compat._reap_sends(wait=True)
    torch.save(got[:4].clone(), os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def _crossing_worker(rank: int, port: int, out_dir: str) -> None:
    from ._common import run_spawned

    run_spawned(_crossing_sends, rank, port, out_dir)


@pytest.mark.multiproc
@pytest.mark.slow
def test_pipeline_sends_do_not_wait_for_their_receive(tmp_path):
    """The CP x VPP hang: a pipeline send on gloo waited until its peer posted the receive, which megatron's
    interleaved schedule posts only in a later call (NCCL lets the send finish)."""
    from ._common import free_port

    ctx = spawn(_crossing_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=False)
    import time

    deadline = time.monotonic() + 120
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):  # returns as each process exits
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("two ranks that send to each other before receiving hung")
    assert torch.load(tmp_path / "rank0.pt").tolist() == [1.0] * 4
    assert torch.load(tmp_path / "rank1.pt").tolist() == [0.0] * 4
