"""What rotapipe does with a NaN batch, a shared module and a closed pipeline.

    python examples/reliability.py

Runs in seconds on emulated CPU workers; see docs/reliability.md.
"""

from __future__ import annotations

import torch
from torch import nn

import rotapipe


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 8))


def config(**kw) -> rotapipe.PipeConfig:
    return rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated", **kw)


def batches(n: int, bad: int | None = None):
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
        if i == bad:
            x[5, 2] = float("nan")          # one corrupt sample
        yield x, y


def main() -> None:
    # 1. nonfinite="raise" (the default): the bad call fails and changes nothing.
    net = model()
    with rotapipe.RoundPipe(net, nn.functional.mse_loss, config=config()) as pipe:
        pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-3))
        refused = []
        for i, (x, y) in enumerate(batches(4, bad=2)):
            before = [p.detach().clone() for p in pipe.parameters()]
            try:
                print(f"raise: step {i} loss {pipe.train_step(x, y):.4f}")
            except rotapipe.NonFiniteError as exc:
                same = all(torch.equal(a, b) for a, b in zip(before, pipe.parameters()))
                print(f"raise: step {i} refused ({str(exc).splitlines()[0][:80]}...); "
                      f"weights unchanged: {same}")
                assert same, "a refused call must leave the weights as they were"
                refused.append(i)
        assert refused == [2], refused          # only the corrupt batch

        # 2. One live pipeline per module: a second one over `net` is refused.
        try:
            rotapipe.RoundPipe(net, nn.functional.mse_loss, config=config())
        except rotapipe.ConfigError as exc:
            print("shared module:", str(exc)[:90], "...")
        else:
            raise AssertionError("a second pipeline over the same module was accepted")

    # 3. After close() (the end of the with-block) every call raises at once.
    try:
        pipe.train_step(*next(batches(1)))
    except rotapipe.PipelineClosedError as exc:
        print("closed:", str(exc)[:60], "...")
    else:
        raise AssertionError("a closed pipeline trained")

    # 4. nonfinite="skip" (rotapipe train's default): the bad step is skipped, counted.
    with rotapipe.RoundPipe(model(), nn.functional.mse_loss,
                            config=config(nonfinite="skip",
                                          optimizer_mode="overlap")) as pipe:
        pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-3))
        losses = [pipe.train_step(x, y) for x, y in batches(4, bad=2)]
        pipe.flush()
        print("skip: losses", [round(v, 4) for v in losses], "skipped steps:",
              pipe.nonfinite_skips, "weights finite:",
              all(torch.isfinite(p).all().item() for p in pipe.parameters()))
        assert pipe.nonfinite_skips == 1


if __name__ == "__main__":
    main()
