"""``forward_to_loggers``: trainmon's summary in the trainers' own loggers, read back from what
those loggers stored (Lightning's ``CSVLogger`` file, the HF Trainer's TensorBoard event files and
the ``logs`` its callbacks receive), checked against trainmon's CSV rows of the same steps."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from tests._support.runs import only_run_dir, read_family
from trainmon.output.layout import rank_dir_name

pytestmark = pytest.mark.slow

CFG = dict(wg_distribution=True, ur_distribution=True, ops=["norm", "max"])


def csv_rows(output_root: Path, family: str) -> pd.DataFrame:
    return read_family(only_run_dir(output_root) / rank_dir_name(0), family)


def expected_keys(output_root: Path, step: int) -> dict[str, float]:
    """The default summary of ``step``, computed from trainmon's CSV files (float64)."""
    want: dict[str, float] = {}
    grads = csv_rows(output_root, "grad_reduced")
    grads = grads[grads["step"] == step]
    for name, norm in zip(grads["name"], grads["norm"]):
        want[f"trainmon/grad_reduced/norm/{name}"] = float(norm)
    want["trainmon/grad_reduced/norm"] = math.sqrt(float(np.sum(grads["norm"].to_numpy(np.float64) ** 2)))
    ratios = csv_rows(output_root, "update_ratio")
    ratios = ratios[ratios["step"] == step]
    for name, ratio in zip(ratios["name"], ratios["update_ratio"]):
        want[f"trainmon/update_ratio/update_ratio/{name}"] = float(ratio)
    return want


def assert_trainmon_keys_equal(got: dict[str, float], want: dict[str, float], rtol: float) -> None:
    got = {k: v for k, v in got.items() if k.startswith("trainmon/") and k != "trainmon/step"}
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=rtol, atol=0, err_msg=key)


def no_trainmon_warning(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("trainmon") and r.levelno >= logging.WARNING]


# ----------------------------------------------------------------------------- Lightning


SMALL_GPT = dict(vocab=32, seq=8, dim=16, heads=2, layers=1)


def lit_module(L):
    """A LightningModule training a one-layer TinyGPT with AdamW, logging its loss as the
    Trainer's own metric ``train_loss``; ``Lit.data(batch, count)``: ``count`` batches of ``batch``."""
    from trainmon.testing.tiny_gpt import GPTConfig, TinyGPT, synthetic_batches

    small = GPTConfig(**SMALL_GPT)

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = TinyGPT(small)

        def training_step(self, batch, batch_idx):
            loss = self.net.loss(batch)
            self.log("train_loss", loss)  # the Trainer's own metric, beside trainmon's
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        @staticmethod
        def data(batch: int, count: int):
            return torch.utils.data.DataLoader(list(synthetic_batches(small, batch, count, seed=1)), batch_size=None)

    return Lit


def test_lightning_csv_logger_holds_the_summary_of_every_recorded_step(output_root, make_config, tmp_path, caplog):
    L = pytest.importorskip("lightning")
    from lightning.pytorch.loggers import CSVLogger

    from trainmon.integrations.lightning import TrainerMonCallback
    Lit = lit_module(L)

    logger = CSVLogger(str(tmp_path / "lightning_logs"), name="run")
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, accumulate_grad_batches=2, logger=logger, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[TrainerMonCallback(make_config(**CFG), forward_to_loggers=True)],
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        trainer.fit(Lit(), Lit.data(4, 8))
    assert trainer.global_step == 4
    assert not no_trainmon_warning(caplog)

    stored = pd.read_csv(Path(logger.log_dir) / "metrics.csv")
    assert "train_loss" in stored  # the Trainer's own metrics are still there
    ours = stored.dropna(subset=["trainmon/grad_reduced/norm"])
    assert sorted(ours["step"].tolist()) == [0, 1, 2, 3]  # every recorded step, under trainmon's step
    for _, row in ours.iterrows():
        got = {k: row[k] for k in stored.columns if k.startswith("trainmon/") and not pd.isna(row[k])}
        assert_trainmon_keys_equal(got, expected_keys(output_root, int(row["step"])), rtol=1e-12)


def test_lightning_forward_off_by_default_and_a_family_list_selects_every_stat(
    output_root, make_config, tmp_path, monkeypatch
):
    L = pytest.importorskip("lightning")
    from lightning.pytorch.loggers import CSVLogger

    from trainmon.integrations.lightning import TrainerMonCallback
    Lit = lit_module(L)

    def fit(root: Path, **kwargs) -> pd.DataFrame:
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(root / "monitor_output"))
        logger = CSVLogger(str(root), name="run")
        trainer = L.Trainer(
            accelerator="cpu", max_epochs=1, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            callbacks=[TrainerMonCallback(make_config(**CFG), **kwargs)],
        )  # fmt: skip
        trainer.fit(Lit(), Lit.data(4, 2))
        return pd.read_csv(Path(logger.log_dir) / "metrics.csv")

    assert not [c for c in fit(tmp_path / "off").columns if c.startswith("trainmon/")]
    stored = fit(tmp_path / "on", forward_to_loggers=["grad_reduced"])
    cols = [c for c in stored.columns if c.startswith("trainmon/")]
    assert cols and all(c.startswith("trainmon/grad_reduced/") for c in cols)
    assert {c.split("/")[2] for c in cols} == {"norm", "max"}  # every stat the config records
    grads = read_family(only_run_dir(tmp_path / "on" / "monitor_output") / rank_dir_name(0), "grad_reduced")
    row = stored.dropna(subset=["trainmon/grad_reduced/max"]).iloc[0]
    step_rows = grads[grads["step"] == int(row["step"])]
    assert row["trainmon/grad_reduced/max"] == step_rows["max"].max()


def test_lightning_mlflow_logger_run_gets_trainmons_mlflow_output(output_root, make_config, tmp_path, caplog):
    """``"format": ["csv", "mlflow"]`` with Lightning's ``MLFlowLogger`` (which makes its run with
    ``MlflowClient``, so MLflow has no active run): trainmon logs into that run, no run of its own,
    every value equal to the CSV's, Lightning's own metric beside them."""
    L = pytest.importorskip("lightning")
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow import MlflowClient

    from trainmon.integrations.lightning import TrainerMonCallback
    from trainmon.sinks import mlflow as mlflow_sink
    Lit = lit_module(L)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MLFlowLogger(experiment_name="lit", tracking_uri=uri)
    config = make_config(format=["csv", "mlflow"], wg_distribution=True, ops=["norm"], mlflow={"timeout_s": 180})
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[TrainerMonCallback(config)],
    )  # fmt: skip
    with caplog.at_level(logging.WARNING):
        trainer.fit(Lit(), Lit.data(4, 3))
    assert not no_trainmon_warning(caplog)
    assert not mlflow_sink._TRAINER_RUNS  # forgotten at the end of training
    client = MlflowClient(uri)
    (run,) = client.search_runs([logger.experiment_id])
    assert run.info.run_id == logger.run_id and "train_loss" in run.data.metrics
    grads = csv_rows(output_root, "grad_reduced")
    assert len(grads) == 3 * grads["name"].nunique()
    for name, rows in grads.groupby("name"):
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"grad_reduced/norm/{name}")}
        assert got == dict(zip(rows["step"].astype(int), rows["norm"].astype(float))), name


# ----------------------------------------------------------------------------- HF Trainer


def test_hf_trainer_report_to_tensorboard_logs_the_summary_with_the_trainers_loss(
    output_root, make_config, tmp_path, caplog
):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainmon.integrations.hf import TrainerMonCallback

    vocab, seq = 64, 12

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int):
            self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(3))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class SeenLogs(transformers.TrainerCallback):
        """A user callback after trainmon's: the ``logs`` every callback is handed."""

        def __init__(self):
            self.logs: list[tuple[int, dict]] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append((state.global_step, dict(logs)))

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=16,
                                                                 n_layer=2, n_head=2))  # fmt: skip
    tb_dir = tmp_path / "hf"  # the TensorBoard integration writes under output_dir/runs/
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        num_train_epochs=1, learning_rate=1e-3, report_to=["tensorboard"], use_cpu=True,
        save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    seen = SeenLogs()
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(16),
        callbacks=[TrainerMonCallback(make_config(**CFG), forward_to_loggers=True), seen],
    )
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer.state.global_step == 4
    assert not no_trainmon_warning(caplog)  # on_log never waited in vain for a summary

    # every logging step carries the summary of the step just finished (the Trainer's global_step
    # after trainmon's step s is s + 1, as for its own loss), exactly as trainmon's CSV holds it
    train_logs = [(g, logs) for g, logs in seen.logs if "loss" in logs]
    assert [g for g, _ in train_logs] == [1, 2, 3, 4]
    for global_step, logs in train_logs:
        assert logs["trainmon/step"] == global_step - 1
        assert_trainmon_keys_equal(logs, expected_keys(output_root, global_step - 1), rtol=1e-12)

    # TensorBoard's integration stored them (as float32 scalars, under its "train/" prefix)
    acc = EventAccumulator(str(next(p.parent for p in tb_dir.rglob("events.out.tfevents.*"))))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "train/loss" in tags
    stored = {t[len("train/") :]: {e.step: e.value for e in acc.Scalars(t)} for t in tags if "trainmon/" in t}
    for global_step, _ in train_logs:
        got = {k: v[global_step] for k, v in stored.items()}
        assert_trainmon_keys_equal(got, expected_keys(output_root, global_step - 1), rtol=1e-6)
