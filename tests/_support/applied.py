"""The truth for framework tests: what the optimizer applied, read from the optimizer itself.

``AppliedRecorder`` registers a step post-hook on the real torch optimizer (after
``set_monitor``, so it runs after trainmon's hooks) and reads, per ``step()`` call, the grad
each parameter carries when the step ends (torch optimizers never change ``p.grad``, so this is
the grad the update used, whoever computed it and whenever: inside a closure, after clipping,
after accumulation) and the ``exp_avg`` the step produced, in float64.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests._support.runs import only_run_dir, read_family
from trainmon.output.layout import rank_dir_name


class AppliedRecorder:
    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module):
        self.optimizer = optimizer
        self.names = {p: n for n, p in model.named_parameters() if p.requires_grad}
        self.grad: list[dict[str, float]] = []      # per step: name -> ||grad the update used||
        self.exp_avg: list[dict[str, float]] = []   # per step: name -> ||exp_avg after the step||
        self._handle = optimizer.register_step_post_hook(self._read)

    @torch.no_grad()
    def _read(self, *_: object) -> None:
        grads, moments = {}, {}
        for p, name in self.names.items():
            if p.grad is not None:
                grads[name] = p.grad.detach().double().norm().item()
            state = self.optimizer.state.get(p, {})
            if isinstance(state.get("exp_avg"), torch.Tensor):
                moments[name] = state["exp_avg"].detach().double().norm().item()
        self.grad.append(grads)
        self.exp_avg.append(moments)

    def remove(self) -> None:
        self._handle.remove()


def recorded_norms(rank_dir: Path, family: str) -> dict[int, dict[str, float]]:
    """step -> name -> norm, as written in the family's CSV files."""
    df = read_family(rank_dir, family)
    assert not df.empty, f"no {family} rows in {rank_dir}"
    out: dict[int, dict[str, float]] = {}
    for row in df.itertuples(index=False):
        out.setdefault(int(row.step), {})[str(row.name)] = float(row.norm)
    return out


def assert_recorded_as_applied(output_root: Path, recorder: AppliedRecorder, steps: int,
                               rtol: float = 1e-6, strip_prefix: str = "") -> None:
    """``grad_reduced`` and ``exp_avg`` norms of every step (0 included) equal the applied ones."""
    assert len(recorder.grad) == steps, f"the optimizer stepped {len(recorder.grad)} times, expected {steps}"
    rank_dir = only_run_dir(output_root) / rank_dir_name(0)
    for family, truth in (("grad_reduced", recorder.grad), ("exp_avg", recorder.exp_avg)):
        got = recorded_norms(rank_dir, family)
        assert sorted(got) == list(range(steps)), (family, sorted(got))
        for step in range(steps):
            want = {strip_prefix + n: v for n, v in truth[step].items()}
            assert set(got[step]) == set(want), (family, step, set(got[step]) ^ set(want))
            names = sorted(want)
            np.testing.assert_allclose([got[step][n] for n in names], [want[n] for n in names], rtol=rtol,
                                       atol=0, err_msg=f"{family} step {step}")
