"""What runs only where a GPU is: CUDA training state (fused AdamW, a CUDA GradScaler under
fp16 autocast, dropout on the CUDA generator, a scheduler) saved by each save mode and by
the fast tier, and resumed by a fresh Checkpointer in the same process, bit-identical to a
run that never stopped; a write through ``.data`` queued right after an overlap save is
caught. Skipped without CUDA (the GPU paths' logic has CPU tests with a stand-in for
``torch.cuda`` in tests/io/test_staging.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpckpt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

Parts = tuple[
    nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler
]


def build(seed: int) -> Parts:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Dropout(0.2), nn.Linear(512, 8)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12, growth_interval=2)
    return model, optimizer, scheduler, scaler


def train_step(parts: Parts, step: int) -> float:
    model, optimizer, scheduler, scaler = parts
    batch = torch.Generator().manual_seed(step)  # the data is the step's, not the RNG's
    x = torch.randn(32, 64, generator=batch).cuda(non_blocking=True)
    y = torch.randn(32, 8, generator=batch).cuda(non_blocking=True)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    return float(loss.detach())


def everything(parts: Parts) -> list[torch.Tensor]:
    model, optimizer, scheduler, scaler = parts
    moments = [v for state in optimizer.state.values() for v in state.values()]
    rng = [torch.cuda.get_rng_state(), torch.get_rng_state()]
    scalars = torch.tensor([scaler.get_scale(), scheduler.last_epoch, *scheduler.get_last_lr()])
    return [*model.state_dict().values(), *moments, *rng, scalars]


def run(
    directory: Path, steps: range, parts: Parts, mode: bool | str, fast: bool
) -> tuple[int | None, list[float]]:
    """Train ``steps`` under a Checkpointer that first resumes; the step it resumed
    from and the losses. ``fast``: a fast-tier save every step, a durable one rarely."""
    model, optimizer, scheduler, scaler = parts
    tiers: dict = {"every_steps": 3}
    if fast:
        tiers = {"every_steps": 100, "fast_tier": directory.with_name(directory.name + "-fast")}
    with ddpckpt.Checkpointer(
        directory, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
        async_save=mode, **tiers,
    ) as ckpt:  # fmt: skip
        info = ckpt.resume()
        start = steps.start if info is None else info.step + 1
        losses = []
        for step in range(start, steps.stop):
            losses.append(train_step(parts, step))
            if ckpt.should_save(step):
                ckpt.save(step)
    return (None if info is None else info.step), losses


@pytest.mark.parametrize(
    ("mode", "fast"),
    [(False, False), (True, False), ("overlap", False), ("overlap", True)],
    ids=["sync", "async", "overlap", "fast-tier"],
)
def test_a_resume_on_cuda_continues_bit_identically(tmp_path, mode, fast) -> None:
    straight = build(seed=0)
    _, reference = run(tmp_path / "straight", range(1, 9), straight, mode, fast)

    stopped = build(seed=0)
    run(tmp_path / "stopped", range(1, 6), stopped, mode, fast)  # saved at 3 (fast: at 5)
    fresh = build(seed=1)  # other weights, and the CUDA generator moved on
    resumed_at, losses = run(tmp_path / "stopped", range(1, 9), fresh, mode, fast)

    assert resumed_at == (5 if fast else 3)
    assert losses == reference[resumed_at:]
    for a, b in zip(everything(fresh), everything(straight), strict=True):
        assert a.device == b.device and torch.equal(a, b)


class SlowCopies:
    """torch.cuda, but each copy stream first sleeps about 0.1 s of GPU time: a write the
    training stream runs right after save() lands before the copy starts, every time."""

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)

    def Stream(self, device):
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)
        return stream


def test_a_data_write_queued_right_after_an_overlap_save_is_caught(
    tmp_path, caplog, monkeypatch
) -> None:
    """``p.data.mul_`` on the training stream right after ``save()``: the write leaves the
    version counter alone and lands before the copy starts, so the copy holds the later
    value whole (a sum taken after the copy agreed with it). The sum taken at ``save()``
    tells: the checkpoint holds one value, and a WARNING says so."""
    from ddpckpt._io import staging

    monkeypatch.setattr(staging, "_cuda", SlowCopies())
    model = nn.ParameterDict(
        {"big": nn.Parameter(torch.randn(1 << 20, device="cuda")),
         "small": nn.Parameter(torch.ones(1024, device="cuda"))}
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ddpckpt.Checkpointer(
        tmp_path / "run", model=model, optimizer=optimizer, async_save="overlap", every_steps=1
    ) as ckpt, caplog.at_level(logging.WARNING, logger="ddpckpt"):  # fmt: skip
        ckpt.resume()
        ckpt.save(1)
        model["small"].data.mul_(2)
        ckpt.wait()
    saved = ddpckpt.load_state_dict(tmp_path / "run" / "step-00000001")
    assert torch.equal(saved["big"], model["big"].detach().cpu())
    assert torch.equal(saved["small"], torch.full((1024,), 2.0))  # one value: the later
    assert "small" in caplog.text and "not exact" in caplog.text, caplog.text


def test_a_digest_allocates_nothing_the_size_of_the_tensor() -> None:
    """The save-time sum runs on the training stream: widening every word to 64 bits first
    took twice the tensor's size in GPU memory at every overlap save."""
    from ddpckpt._io import copy_checks

    for dtype, numel in ((torch.float32, 64 << 20), (torch.bfloat16, (64 << 20) + 1)):
        x = torch.ones(numel, dtype=dtype, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        int(copy_checks.digest(x))
        assert torch.cuda.max_memory_allocated() - before < 128 << 20, dtype  # one chunk
