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
import pytest
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
                grads[name] = _full(p.grad).double().norm().item()
            state = self.optimizer.state.get(p, {})
            if isinstance(state.get("exp_avg"), torch.Tensor):
                moments[name] = _full(state["exp_avg"]).double().norm().item()
        self.grad.append(grads)
        self.exp_avg.append(moments)

    def remove(self) -> None:
        self._handle.remove()


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 shard (a DTensor) is gathered from every rank (a collective)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def recorded_norms(rank_dir: Path, family: str) -> dict[int, dict[str, float]]:
    """step -> name -> norm, as written in the family's CSV files."""
    df = read_family(rank_dir, family)
    assert not df.empty, f"no {family} rows in {rank_dir}"
    out: dict[int, dict[str, float]] = {}
    for row in df.itertuples(index=False):
        out.setdefault(int(row.step), {})[str(row.name)] = float(row.norm)
    return out


def assert_recorded_as_applied(output_root: Path, recorder: AppliedRecorder, steps: int,
                               rtol: float = 1e-6, strip_prefix: str = "", rank: int = 0) -> None:
    """``grad_reduced`` and ``exp_avg`` norms of every step (0 included) equal the applied ones."""
    assert len(recorder.grad) == steps, f"the optimizer stepped {len(recorder.grad)} times, expected {steps}"
    rank_dir = only_run_dir(output_root) / rank_dir_name(rank)
    for family, truth in (("grad_reduced", recorder.grad), ("exp_avg", recorder.exp_avg)):
        got = recorded_norms(rank_dir, family)
        assert sorted(got) == list(range(steps)), (family, sorted(got))
        for step in range(steps):
            want = {strip_prefix + n: v for n, v in truth[step].items()}
            assert set(got[step]) == set(want), (family, step, set(got[step]) ^ set(want))
            names = sorted(want)
            np.testing.assert_allclose([got[step][n] for n in names], [want[n] for n in names], rtol=rtol,
                                       atol=0, err_msg=f"{family} step {step}")


class LocalGradRecorder:
    """Data parallel: this rank's own grads before the reduce, and the grads the update applies.

    A post-accumulate-grad hook per param keeps a float64 copy of the param's grad after each
    backward (torch runs it before DDP's reducer writes the mean back at the end of backward;
    with ``no_sync`` accumulation the last copy is this rank's accumulated local grad).  A step
    post-hook files, per ``step()``, those local copies and the grads the update applied (reduced
    and clipped; a post-hook, not a pre-hook, because a ``step(closure)`` runs the last backward
    after the pre-hooks).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module):
        self.names = {p: n for n, p in model.named_parameters() if p.requires_grad}
        self._latest: dict[str, torch.Tensor] = {}
        self.local: list[dict[str, torch.Tensor]] = []     # per step: name -> this rank's pre-reduce grad
        self.applied: list[dict[str, torch.Tensor]] = []   # per step: name -> the grad the update used
        self._handles = [p.register_post_accumulate_grad_hook(self._keep) for p in self.names]
        self._handles.append(optimizer.register_step_post_hook(self._file))

    @torch.no_grad()
    def _keep(self, p: torch.Tensor) -> None:
        self._latest[self.names[p]] = p.grad.detach().double().clone()

    @torch.no_grad()
    def _file(self, *_: object) -> None:
        self.local.append(dict(self._latest))
        self.applied.append({n: p.grad.detach().double().clone() for p, n in self.names.items() if p.grad is not None})

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def assert_data_parallel_grads(rank_dir: Path, recorder: LocalGradRecorder, steps: int, clip: float,
                               rtol: float = 1e-6) -> None:
    """Each rank's ``grad_unreduced`` norms equal its own pre-reduce grads, and those local grads
    really are the pre-reduce ones: their mean over the ranks, clipped to ``clip`` (active: the
    mean's norm is above it), is the grad the update applied.  A collective: call on every rank."""
    import torch.distributed as dist

    got = recorded_norms(rank_dir, "grad_unreduced")
    assert sorted(got) == list(range(steps)) and len(recorder.local) == steps, (sorted(got), len(recorder.local))
    world = dist.get_world_size()
    for step in range(steps):
        local, applied = recorder.local[step], recorder.applied[step]
        assert set(got[step]) == set(local) == set(applied), (step, set(got[step]) ^ set(local))
        names = sorted(local)
        np.testing.assert_allclose([got[step][n] for n in names], [local[n].norm().item() for n in names],
                                   rtol=rtol, atol=0, err_msg=f"grad_unreduced step {step}")
        mean = {n: local[n].clone() for n in names}
        for n in names:
            dist.all_reduce(mean[n])
            mean[n] /= world
        assert any(not torch.equal(mean[n], local[n]) for n in names), "the ranks' local grads are all equal"
        mean_norm = torch.stack([mean[n].norm() for n in names]).norm().item()
        applied_norm = torch.stack([applied[n].norm() for n in names]).norm().item()
        assert mean_norm > 2 * clip and applied_norm == pytest.approx(clip, rel=1e-4), (step, mean_norm, applied_norm)
        for n in names:
            np.testing.assert_allclose(applied[n].numpy(), (mean[n] * (applied_norm / mean_norm)).numpy(),
                                       rtol=1e-5, atol=1e-6 * applied[n].abs().max().item(), err_msg=f"{n} {step}")
