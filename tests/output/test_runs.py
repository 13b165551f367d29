"""trainmon.output.runs: run/rank/family discovery and exact CSV reading, on files written here as text."""
from __future__ import annotations

import math
import struct

import pandas as pd
import pytest

from trainmon.errors import DamagedFileError
from trainmon.output.runs import (ColumnRoles, column_roles, family_files, find_runs, is_run_dir, rank_dirs, rank_of,
                           read_csv, read_family)

HEADER = "vpp_stage,name,step,norm,mean,shape,dtype\n"


def _write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _run(root, name="run1", ranks=(0,)):
    for r in ranks:
        _write(root / name / f"rank{r}" / "grad_reduced_0-0.csv", HEADER + '0,w,0,1.0,2.0,"[2]",torch.float32\n')
    return root / name


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def test_find_runs_accepts_a_run_or_an_output_dir(tmp_path):
    out = tmp_path / "monitor_output"
    b, a = _run(out, "20260102-000000"), _run(out, "20260101-000000", ranks=(0, 1))
    (out / "notes").mkdir()
    (out / "readme.txt").write_text("x")
    assert find_runs(a) == [a]
    assert find_runs(out) == [a, b]                       # sorted by name
    assert find_runs(tmp_path) == [a, b]                  # the parent of the output dir works too
    assert find_runs(tmp_path, max_depth=1) == []
    assert is_run_dir(a) and not is_run_dir(out)


def test_find_runs_never_takes_event_dirs_for_runs(tmp_path):
    run = _run(tmp_path, "r")
    (run / "tensorboard" / "rank0").mkdir(parents=True)   # has rank dirs, but is the run's TB output
    (tmp_path / "tb_only" / "tensorboard" / "rank0").mkdir(parents=True)
    assert find_runs(tmp_path) == [run]
    assert find_runs(run / "tensorboard") == []


def test_find_runs_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        find_runs(tmp_path / "missing")
    f = _write(tmp_path / "file.csv", "x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        find_runs(f)
    (tmp_path / "empty").mkdir()
    assert find_runs(tmp_path / "empty") == []


def test_rank_dirs_in_numeric_order(tmp_path):
    for name in ("rank10", "rank2", "rank0", "rankX", "rank_1", "tensorboard"):
        (tmp_path / name).mkdir()
    _write(tmp_path / "rank3", "a file, not a rank dir")
    assert [p.name for p in rank_dirs(tmp_path)] == ["rank0", "rank2", "rank10"]
    assert [rank_of(p) for p in rank_dirs(tmp_path)] == [0, 2, 10]
    assert rank_of(tmp_path / "rankX") is None
    assert rank_dirs(tmp_path / "missing") == []


def test_family_files_by_family_then_window_then_header_variant(tmp_path):
    names = ["exp_avg_sq_10-19.csv", "exp_avg_sq_0-9.csv", "exp_avg_sq_100-109.csv", "exp_avg_0-9.csv",
             "grad_reduced_0-9.1.csv", "grad_reduced_0-9.csv", "grad_reduced_0-9.2.csv", "actv_0-9.csv",
             "stack_info.csv", "anomalies.jsonl", "notes.csv", "grad_reduced_a-b.csv"]
    for n in names:
        _write(tmp_path / n, HEADER)
    files = family_files(tmp_path)
    assert list(files) == ["actv", "exp_avg", "exp_avg_sq", "grad_reduced"]
    assert [f.path.name for f in files["exp_avg_sq"]] == ["exp_avg_sq_0-9.csv", "exp_avg_sq_10-19.csv",
                                                           "exp_avg_sq_100-109.csv"]
    assert [(f.start, f.end, f.part) for f in files["grad_reduced"]] == [(0, 9, 0), (0, 9, 1), (0, 9, 2)]


def test_read_csv_is_exact_and_keeps_names_as_text(tmp_path):
    values = [0.1 + 0.2, 1e-300, 5e-324, 1.7976931348623157e308, -0.0, 2.0 ** -1074 * 3, 1 / 3]
    lines = [f'0,layer{i},0,{v!r},{-v!r},"[64, 32]",torch.float32' for i, v in enumerate(values)]
    lines += ['0,nan,1,nan,inf,"[]",torch.float32', '0,NA,1,-inf,1.0,"[]",torch.float32',
              '0,null,1,1.0,1.0,"[]",torch.float32', '0,1e5,1,1.0,1.0,"[]",torch.bfloat16']
    df = read_csv(_write(tmp_path / "grad_reduced_0-1.csv", HEADER + "\n".join(lines) + "\n"))
    assert [_bits(x) for x in df["norm"][:len(values)]] == [_bits(v) for v in values]
    assert [_bits(x) for x in df["mean"][:len(values)]] == [_bits(-v) for v in values]
    assert df["name"].tolist()[len(values):] == ["nan", "NA", "null", "1e5"]
    assert math.isnan(df["norm"].iloc[-4]) and df["mean"].iloc[-4] == math.inf and df["norm"].iloc[-3] == -math.inf
    assert df["shape"].iloc[0] == "[64, 32]" and df["dtype"].iloc[-1] == "torch.bfloat16"
    assert df["step"].dtype.kind == "i" and df["vpp_stage"].dtype.kind == "i"


def test_read_csv_of_empty_and_header_only_files(tmp_path):
    # The sink never leaves a 0-byte file (issue 12): one is damage, named, not "no rows".
    with pytest.raises(DamagedFileError, match=r"a_0-0.csv: empty file \(0 bytes\)"):
        read_csv(_write(tmp_path / "a_0-0.csv", ""))
    header_only = read_csv(_write(tmp_path / "b_0-0.csv", HEADER))
    assert header_only.empty and list(header_only.columns) == HEADER.strip().split(",")


def test_read_family_joins_windows_and_header_variants_in_step_order(tmp_path):
    row = '0,w,{s},{n},0.5,"[2]",torch.float32\n'
    _write(tmp_path / "grad_reduced_3-5.csv", HEADER + "".join(row.format(s=s, n=s + 0.25) for s in (3, 4)))
    _write(tmp_path / "grad_reduced_0-2.csv", HEADER + "".join(row.format(s=s, n=s + 0.25) for s in (0, 1, 2)))
    # ops changed at step 5: a header variant of the 3-5 window with another stat
    _write(tmp_path / "grad_reduced_3-5.1.csv",
           "vpp_stage,name,step,norm,max,shape,dtype\n" + '0,w,5,5.25,9.0,"[2]",torch.float32\n')
    _write(tmp_path / "exp_avg_0-2.csv", HEADER + row.format(s=0, n=7.0))
    df = read_family(tmp_path, "grad_reduced")
    assert df["step"].tolist() == [0, 1, 2, 3, 4, 5]
    assert df["norm"].tolist() == [0.25, 1.25, 2.25, 3.25, 4.25, 5.25]
    assert df["mean"].iloc[:5].tolist() == [0.5] * 5 and math.isnan(df["mean"].iloc[5])
    assert math.isnan(df["max"].iloc[0]) and df["max"].iloc[5] == 9.0
    assert read_family(tmp_path, "exp_avg")["norm"].tolist() == [7.0]
    assert read_family(tmp_path, "actv").empty


def test_column_roles_for_every_layout(tmp_path):
    plain = read_csv(_write(tmp_path / "grad_reduced_0-0.csv", HEADER + '0,w,0,1.0,2.0,"[2]",torch.float32\n'))
    assert column_roles(plain) == ColumnRoles(("vpp_stage", "name", "step"), (), ("norm", "mean"))
    actv = read_csv(_write(tmp_path / "actv_0-0.csv", "vpp_stage,name,step,micro_step,max,nans,shape,dtype\n"
                           '0,m.output,0,1,2.0,0,"[2]",torch.float32\n'))
    assert column_roles(actv) == ColumnRoles(("vpp_stage", "name", "step", "micro_step"), (), ("max", "nans"))
    comm = read_csv(_write(tmp_path / "comm_0-0.csv", "vpp_stage,name,step,op,call,phase,norm,shape,dtype\n"
                           '0,x,0,all_reduce,3,pre,1.5,"[2]",torch.float32\n'))
    assert column_roles(comm) == ColumnRoles(("vpp_stage", "name", "step"), ("op", "call", "phase"), ("norm",))
    ratio = read_csv(_write(tmp_path / "update_ratio_0-0.csv", "vpp_stage,name,step,update_ratio,shape,dtype\n"
                            '0,w,0,inf,"[2]",torch.float32\n'))
    assert column_roles(ratio).stats == ("update_ratio",)
    # an unknown statistic is recognised by its float values; an int one needs naming
    custom = read_csv(_write(tmp_path / "x_0-0.csv", "vpp_stage,name,step,tag,score,count,shape,dtype\n"
                             '0,w,0,a,0.5,3,"[2]",torch.float32\n'))
    assert column_roles(custom) == ColumnRoles(("vpp_stage", "name", "step"), ("tag",), ("score", "count"))
    assert column_roles(pd.DataFrame(columns=["vpp_stage", "name", "step", "count", "shape", "dtype"]),
                        extra_stats=("count",)).stats == ("count",)
