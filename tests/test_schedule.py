"""The one learning-rate schedule (impl/schedule.py): the four training loops' former hand-written
schedules reproduced to the bit, the torch scheduler following the same law, and bad arguments refused."""

import math

import pytest
import torch

from impl.schedule import lr_at, warmup_decay_scheduler


def _old_cosine(step, lr, warm, steps):  # models/train.py, vskipper/flexidepth.py before the helper
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def _old_linear(step, lr, warm, steps):  # models/adapter_train.py before the helper
    if step < warm:
        return lr * (step + 1) / warm
    return lr * max(0.0, (steps - step) / max(1, steps - warm))


@pytest.mark.parametrize("lr,warm,steps", [(3e-3, 50, 800), (5e-3, 4, 60), (3e-3, 0, 7), (1e-4, 10, 10)])
def test_bit_identical_to_the_former_schedules(lr, warm, steps):
    for s in range(steps + 3):
        assert lr_at(s, lr=lr, warmup=warm, steps=steps) == _old_cosine(s, lr, warm, steps)
        if warm:
            assert lr_at(s, lr=lr, warmup=warm, steps=steps, decay="linear", floor=0.0) == _old_linear(s, lr, warm, steps)


def test_shape_of_the_law():
    lrs = [lr_at(s, lr=1.0, warmup=4, steps=20) for s in range(20)]
    assert lrs[0] == 0.25 and lrs[3] == 1.0  # the first step already trains (warm-up from step 1)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))  # non-increasing after warm-up
    assert lr_at(10**6, lr=1.0, warmup=4, steps=20) == pytest.approx(0.1)  # the floor, clipped past the end
    assert lr_at(20, lr=2.0, warmup=4, steps=20, decay="linear", floor=0.0) == 0.0


def test_scheduler_follows_lr_at():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=2e-3)
    sched = warmup_decay_scheduler(opt, warmup=3, steps=12)
    seen = []
    for _ in range(14):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == [2e-3 * lr_at(s, lr=1.0, warmup=3, steps=12) for s in range(14)]


@pytest.mark.parametrize("kw", [dict(warmup=-1), dict(steps=0), dict(floor=1.5), dict(decay="step")])
def test_bad_arguments(kw):
    args = dict(lr=1.0, warmup=2, steps=10, **{k: v for k, v in kw.items() if k not in ("warmup", "steps")})
    args.update({k: v for k, v in kw.items() if k in ("warmup", "steps")})
    with pytest.raises(ValueError, match="lr_at"):
        lr_at(5, **args)
    with pytest.raises(ValueError, match="lr_at"):
        warmup_decay_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
                               **{k: v for k, v in args.items() if k != "lr"})
