"""Dynamic mode end to end: a real training subprocess, real watchdog, real edits of the file.

The training script pauses right after the step boundary of chosen steps and waits for "go" on
stdin; the test edits the config meanwhile and waits until the monitor's log says it has staged
(or rejected) the edit.  An edit made while step k+1 runs is applied at the boundary after step
k+1, so collection with it starts at step k+2: the test knows exactly which steps to expect.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tests._support.runs import only_run_dir, read_family

pytestmark = pytest.mark.slow   # a training child process and a real watchdog observer

REPO = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent("""
    import logging, sys, torch
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    from trainmon import TrainerMon
    from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    pauses = {int(s) for s in sys.argv[2].split(",")}
    mon = TrainerMon(sys.argv[1])
    mon.set_monitor(model, optimizer=opt)
    for step, batch in enumerate(synthetic_batches(model.cfg, 4, int(sys.argv[3]))):
        model.loss(batch).backward()
        opt.step()
        opt.zero_grad()
        if step in pauses:
            grad_hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
            step_hooks = len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
            print(f"paused {step} {grad_hooks} {step_hooks}", flush=True)
            assert sys.stdin.readline().strip() == "go"
    mon.close()
    print("done", flush=True)
""")


class Trainer:
    """The subprocess, with its stdout and stderr read by threads (so neither pipe fills up)."""

    def __init__(self, cfg: Path, pauses: list[int], steps: int, env: dict, cwd: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(cfg), ",".join(map(str, pauses)), str(steps)],
            env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        self.out: queue.Queue[str] = queue.Queue()
        self.err: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        self._cursor = 0
        for stream, q in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, q), daemon=True).start()

    @staticmethod
    def _pump(stream, q: queue.Queue) -> None:
        for line in stream:
            q.put(line.rstrip("\n"))
        q.put(None)

    def next_out(self, timeout: float = 60) -> str:
        line = self.out.get(timeout=timeout)
        assert line is not None, "the trainer ended early:\n" + "\n".join(self.drain_log())
        return line

    def paused(self, step: int) -> tuple[int, int]:
        words = self.next_out().split()
        assert words[:2] == ["paused", str(step)], (words, self.drain_log())
        return int(words[2]), int(words[3])

    def wait_log(self, text: str, timeout: float = 30) -> str:
        """The first log line containing ``text`` after the line the previous wait matched."""
        while True:
            for i in range(self._cursor, len(self.log)):
                if text in self.log[i]:
                    self._cursor = i + 1
                    return self.log[i]
            line = self.err.get(timeout=timeout)
            assert line is not None, f"trainer ended before logging {text!r}:\n" + "\n".join(self.log)
            self.log.append(line)

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def drain_log(self) -> list[str]:
        while True:
            try:
                line = self.err.get(timeout=0.2)
            except queue.Empty:
                return self.log
            if line is None:
                return self.log
            self.log.append(line)


def write_in_place(path: Path, text: str) -> None:
    with open(path, "r+") as f:  # same inode: truncate and rewrite, as many editors do
        f.truncate(0)
        f.write(text)


def write_by_replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a new inode under the same name, as vim, sed -i and atomic savers do


def cfg(**keys) -> str:
    return json.dumps(keys)


# pause step -> (edit, new text, log line to wait for).  Comments: what the edit does, and when.
PLAN = {
    2: (write_in_place, cfg(dynamic_on=True, wg_distribution=True, ops=["norm", "max"]), "version 2 staged"),
    6: (write_by_replace, cfg(dynamic_on=True, param_distribution=True, ops=["min"]), "version 3 staged"),
    9: (write_in_place, '{"dynamic_on": true, "ops": ["norm"', "is NOT applied"),
    11: (write_by_replace, cfg(dynamic_on=False, param_distribution=True), "version 4 staged"),
    14: (write_in_place, cfg(dynamic_on=True, mv_distribution=True, start_step=3, collect_times=2,
                             ops=["norm"]), "version 5 staged"),
    19: (write_in_place, cfg(dynamic_on=True, mv_distribution=True, start_step=3, collect_times=2,
                             ops=["norm"]), "version 6 staged"),
    24: (write_by_replace, cfg(dynamic_on=True, wg_distribution=True, start_step=28, collect_times=1,
                               ops=["mean"]), "version 7 staged"),
}
# whether grad hooks exist at each pause: only while weight grads are collected (steps 4-7);
# idle periods and the param/moment periods have no hook besides the step boundary
HOOKED_AT = {2: False, 6: True, 9: False, 11: False, 14: False, 19: False, 24: False}
SWITCH_LOGS = [
    "step 0: config version 1 has dynamic_on false: staying off",
    "step 4: collecting with config version 2",
    "step 8: collecting with config version 3",
    "step 13: monitoring stopped (config version 4 sets dynamic_on false)",
    "step 16: collecting with config version 5",
    "step 18: monitoring stopped (collect_times (2) reached)",
    "step 21: collecting with config version 6",
    "step 23: monitoring stopped (collect_times (2) reached)",
    "step 26: collecting with config version 7",
    "step 29: monitoring stopped (collect_times (1) reached)",
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("observer", ["native", "polling"])
def test_edits_switch_collection_at_the_expected_steps(tmp_path, output_root, observer):
    folder = tmp_path / "conf"
    folder.mkdir()
    config = folder / "monitor_config.json"
    config.write_text(cfg(dynamic_on=False, wg_distribution=True))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), DYNAMIC_MONITOR="True",
               TRAINMON_WATCH_SETTLE="0.05", MONITOR_OUTPUT_DIR=str(output_root))
    if observer == "polling":
        env.update(TRAINMON_WATCH_POLLING="1", TRAINMON_WATCH_INTERVAL="0.1")
    trainer = Trainer(config, sorted(PLAN), 31, env, tmp_path)
    try:
        trainer.wait_log(f"({observer} observer)")
        for step in sorted(PLAN):
            grad_hooks, step_hooks = trainer.paused(step)
            assert (grad_hooks > 0) == HOOKED_AT[step], step
            assert step_hooks == 2, step  # the controller's pre/post hooks, never nested
            edit, text, wait_for = PLAN[step]
            edit(config, text)
            trainer.wait_log(wait_for)
            trainer.go()
        assert trainer.next_out() == "done"
        assert trainer.proc.wait(timeout=60) == 0
    finally:
        if trainer.proc.poll() is None:
            trainer.proc.kill()
    log = trainer.drain_log()
    warnings = [line for line in log if line.startswith("WARNING")]
    assert not [line for line in log if "Traceback" in line], log
    # the only warnings are the switches themselves (logged so to reach scripts without logging)
    assert all(w.startswith("WARNING trainmon: dynamic: step ") for w in warnings), warnings
    errors = [line for line in log if line.startswith("ERROR")]
    assert len(errors) == 1, errors  # the bad JSON: one message naming the file and the problem
    assert "the edited config is NOT applied" in errors[0] and str(config) in errors[0]
    switches = [line.split("trainmon: dynamic: ", 1)[1] for line in log
                if "collecting with" in line or "monitoring stopped" in line or "staying off" in line]
    assert len(switches) == len(SWITCH_LOGS), switches
    for got, want in zip(switches, SWITCH_LOGS):
        assert got.startswith(want), (got, want)
    assert config.read_text() == PLAN[24][1]  # the user's file is never rewritten

    rank0 = only_run_dir(output_root) / "rank0"  # one run dir across every on/off period
    expect = {  # family -> {step: stat columns}
        "grad_reduced": {**{s: ["norm", "max"] for s in range(4, 8)}, 28: ["mean"]},
        "grad_unreduced": {**{s: ["norm", "max"] for s in range(4, 8)}, 28: ["mean"]},
        "param_origin": {s: ["min"] for s in range(8, 13)},
        "param_updated": {s: ["min"] for s in range(8, 13)},
        "exp_avg": {s: ["norm"] for s in (16, 17, 21, 22)},
        "exp_avg_sq": {s: ["norm"] for s in (16, 17, 21, 22)},
    }
    for family, steps in expect.items():
        files = sorted(rank0.glob(f"{family}_*.csv"))
        seen = {}
        for f in files:
            df = read_family_file(f)
            stats = [c for c in df.columns if c not in ("vpp_stage", "name", "step", "shape", "dtype")]
            for step in df["step"].unique():
                seen[int(step)] = stats
        assert seen == steps, family
        assert len(read_family(rank0, family)) == 29 * len(steps), family
    assert not list(rank0.glob("update_ratio_*.csv"))


def read_family_file(path: Path):
    import pandas as pd
    return pd.read_csv(path)


QUIET_SCRIPT = textwrap.dedent("""
    # A training script that configures no logging at all, as most do.
    import json, sys, time, torch
    torch.set_num_threads(1)
    from trainmon import TrainerMon
    from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = synthetic_batches(model.cfg, 2, 100_000)
    config = sys.argv[1]
    mon = TrainerMon(config)
    mon.set_monitor(model, optimizer=opt)
    driver = mon._driver

    def train_until(done):
        deadline = time.monotonic() + 60
        while not done():
            assert time.monotonic() < deadline, "the edit was never applied"
            model.loss(next(data)).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.01)

    def write(text):
        with open(config, "w") as fh:
            fh.write(text)

    write(json.dumps({"dynamic_on": True, "wg_distribution": True, "ops": ["norm"]}))
    train_until(lambda: driver.session is not None)
    write('{"dynamic_on": false, "ops": [')                # rejected: stays on
    start = time.monotonic()
    train_until(lambda: time.monotonic() - start > 1.5)     # read (and rejected) meanwhile
    assert driver.session is not None
    write(json.dumps({"dynamic_on": False}))
    train_until(lambda: driver.session is None)
    mon.close()
    print("done", flush=True)
""")


def test_switches_and_a_rejected_config_reach_stderr_without_any_logging_setup(tmp_path, output_root):
    """Issue 34, item 23: a script that configures no logging still tells its user, once per
    change, that monitoring switched on or off and that an edited config was rejected."""
    config = tmp_path / "monitor_config.json"
    config.write_text(cfg(dynamic_on=False, wg_distribution=True))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), DYNAMIC_MONITOR="true",
               TRAINMON_WATCH_SETTLE="0.05", MONITOR_OUTPUT_DIR=str(output_root))
    done = subprocess.run([sys.executable, "-c", QUIET_SCRIPT, str(config)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
    lines = done.stderr.splitlines()

    def said(text: str) -> list[str]:
        return [line for line in lines if text in line]

    assert len(said("step 0: config version 1 has dynamic_on false: staying off")) == 1, lines
    on = said("collecting with config version 2")
    assert len(on) == 1 and on[0].startswith("trainmon: dynamic: step "), lines
    rejected = said("the edited config is NOT applied")
    assert len(rejected) == 1 and rejected[0].startswith("trainmon: ") and str(config) in rejected[0], lines
    off = said("monitoring stopped (config version 3 sets dynamic_on false)")
    assert len(off) == 1 and off[0].startswith("trainmon: dynamic: step "), lines
    assert not said("Traceback"), lines
