"""Saving tuned tables (moebench/tuning/save.py): merged over an older table
of the same device, refusals as problems, rows with no correct tactic named."""

from pathlib import Path
from types import SimpleNamespace

from moebench.kernels.tactic import default_fp8_tactic, default_tactic
from moebench.models import get_preset
from moebench.tuning.save import merge_tables, save_tables, untuned_rows
from moebench.kernels.table import ShapeClass, TableEntry, TuningTable, read_table
from moebench.tuning.table import write_table

SHAPE = ShapeClass.of(get_preset("dsv41-flash").shard(4))
T1, T2 = (default_tactic(SHAPE.gemm_shape, s, 6) for s in (1, 2))
F1, F2 = (default_fp8_tactic(SHAPE.gemm_shape, s, 6) for s in (1, 2))


def _table(rows=(1, 2), fp8=False, device="NVIDIA H200", us=10.0) -> TuningTable:
    entries = {(s, r): TableEntry((F1, F2)[s - 1] if fp8 else (T1, T2)[s - 1], us + r, us, us + 2 * r)
               for s in (1, 2) for r in rows}  # fmt: skip
    return TuningTable(SHAPE, {"name": device, "sm_count": 132}, {} if fp8 else entries,
                       fp8_entries=entries if fp8 else {})  # fmt: skip


def _outcome(tables, untuned=()):
    results = {(4, 1): SimpleNamespace(results={1: SimpleNamespace(entry=object()),
                                                **{r: SimpleNamespace(entry=None) for r in untuned}})}  # fmt: skip
    return SimpleNamespace(tables=tables, results=results)


def test_a_new_table_is_written_and_an_empty_one_skipped(tmp_path):
    empty = TuningTable(SHAPE, {"name": "NVIDIA H200", "sm_count": 132}, {})
    saved, problems = save_tables(_outcome([empty, _table()]), tmp_path)
    assert problems == [] and len(saved) == 1
    assert saved[0].path == tmp_path / _table().file_name and read_table(saved[0].path).entries == _table().entries
    assert saved[0].key() == ("NVIDIA H200", SHAPE, 132)


def test_the_other_family_and_rows_not_retuned_stay(tmp_path):
    write_table(_table(rows=(1, 2, 3), fp8=True), tmp_path)
    old_bf16 = _table(rows=(5,), us=50.0)
    (saved,), problems = save_tables(_outcome([old_bf16]), tmp_path)
    (saved_again,), _ = save_tables(_outcome([_table(rows=(1,))]), tmp_path)
    back = read_table(saved_again.path)
    assert problems == [] and len(back.fp8_entries) == 6  # the FP8 family's entries stay
    assert set(back.entries) == {(1, 1), (2, 1), (1, 5), (2, 5)}  # the re-tuned rows and the others
    assert back.entries[1, 1].median_us == 11.0 and back.entries[1, 5].median_us == 55.0
    assert saved_again.table.entries == back.entries


def test_a_table_of_another_device_is_a_problem_unless_forced(tmp_path):
    other = _table(device="NVIDIA H200 NVL")
    other.device["sm_count"] = 114
    path = write_table(other, tmp_path)
    saved, problems = save_tables(_outcome([_table()], untuned=(7, 8)), tmp_path, label="dsv41-flash BF16")
    assert saved == [] and len(problems) == 2 and path.name in problems[0]
    assert problems[1] == "no correct tactic for dsv41-flash BF16 TP4 GEMM1 rows=7, dsv41-flash BF16 TP4 GEMM1 rows=8"
    saved, problems = save_tables(_outcome([_table()]), tmp_path, force=True)
    assert problems == [] and read_table(saved[0].path).device["sm_count"] == 132


def test_untuned_rows():
    assert untuned_rows(_outcome([])) == []
    assert untuned_rows(_outcome([], untuned=(3,))) == ["TP4 GEMM1 rows=3"]


def test_tables_dir_is_out_else_the_first_env_dir_else_tuning_tables(tmp_path, monkeypatch):
    import os

    from moebench.tuning.save import tables_dir

    monkeypatch.delenv("MOEBENCH_TUNING_DIR", raising=False)
    assert tables_dir(None) == Path("tuning-tables") and tables_dir(tmp_path) == tmp_path
    monkeypatch.setenv("MOEBENCH_TUNING_DIR", os.pathsep.join(["/a", "/b"]))
    assert tables_dir(None) == Path("/a")


def test_write_gains_summary_writes_markdown_and_json(tmp_path):
    import json

    from moebench.tuning.save import write_gains_summary

    md, js = write_gains_summary(tmp_path / "g" / "gains.md", [], [], tmp_path)
    assert md.is_file() and json.loads(js.read_text()) == [] and js == tmp_path / "g" / "gains.json"
    assert "runs by default" not in md.read_text()


def test_only_the_lines_of_a_stage_and_shape_are_logged():
    from moebench.tuning.save import is_log_line

    assert is_log_line("TP4 GEMM1: preparing weights") and is_log_line("compiling 12 kernels in 3 worker processes")
    assert is_log_line("12 kernels submitted") and not is_log_line("GEMM1 rows=1 tactic 3/10: 12.1 us")


def test_tune_targets_are_checked_before_any_tuning(tmp_path, monkeypatch):
    import pytest

    from moebench.tuning import runner
    from moebench.tuning.save import check_tune_targets

    plan = SimpleNamespace(settings={"device": "cuda:1"})
    asked = []
    monkeypatch.setattr(runner, "require_tuning_device", lambda device=None: asked.append(device))
    assert check_tune_targets(plan, tmp_path / "t", tmp_path / "s" / "g.md") == tmp_path / "t" and asked == ["cuda:1"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="^--out: "):
        check_tune_targets(plan, tmp_path / "file")
    with pytest.raises(ValueError, match="^--summary: "):
        check_tune_targets(plan, tmp_path / "t", tmp_path / "file" / "g.md")

    def no_gpu(device=None):
        raise RuntimeError("moebench tune needs an sm_90 GPU")

    monkeypatch.setattr(runner, "require_tuning_device", no_gpu)
    with pytest.raises(RuntimeError, match="sm_90"):
        check_tune_targets(plan, tmp_path / "t")


def test_an_existing_summary_is_refused_before_any_tuning_unless_forced(tmp_path, monkeypatch):
    import pytest

    from moebench.tuning import runner
    from moebench.tuning.save import check_tune_targets

    # an earlier tune's gains (or any file of the user's by that name) were overwritten at the end of the run
    plan = SimpleNamespace(settings={"device": None})
    monkeypatch.setattr(runner, "require_tuning_device", lambda device=None: None)
    for name in ("g.md", "g.json"):
        (tmp_path / name).write_text("mine")
        with pytest.raises(ValueError, match=f"^--summary: .*{name} exist.*--force"):
            check_tune_targets(plan, tmp_path / "t", tmp_path / "g.md")
        assert check_tune_targets(plan, tmp_path / "t", tmp_path / "g.md", force=True) == tmp_path / "t"
        (tmp_path / name).unlink()
    assert (tmp_path / "t").is_dir() and check_tune_targets(plan, tmp_path / "t", tmp_path / "g.md")


def test_tables_and_summary_are_never_written_into_a_stored_run(tmp_path, monkeypatch):
    import pytest

    from moebench.tuning import runner
    from moebench.tuning.save import check_tune_targets

    # tune --out / --summary inside a (committed) run directory added files among the run's own
    run = tmp_path / "2026-12-06-h100-x"
    run.mkdir()
    (run / "results.parquet").write_bytes(b"")
    (run / "manifest.json").write_text("{}")
    monkeypatch.setattr(runner, "require_tuning_device", lambda device=None: None)
    plan = SimpleNamespace(settings={"device": None})
    with pytest.raises(ValueError, match="^--out: .* is a stored run directory"):
        check_tune_targets(plan, run)
    with pytest.raises(ValueError, match="^--summary: .* is inside the stored run"):
        check_tune_targets(plan, tmp_path / "t", run / "sub" / "g.md")
    assert sorted(p.name for p in run.iterdir()) == ["manifest.json", "results.parquet"]


def test_tune_and_save_saves_each_config_as_it_is_tuned_then_sums_up(tmp_path, monkeypatch):
    from moebench.tuning import family, runner
    from moebench.tuning.save import tune_and_save

    configs = [SimpleNamespace(preset="dsv41-flash", family="BF16"), SimpleNamespace(preset="dsv4-pro", family="BF16")]
    outcomes = [_outcome([_table()]), _outcome([_table(rows=(3,))], untuned=(8,))]
    for o, stopped in zip(outcomes, ([], ["GEMM2 of dsv4-pro TP4"])):
        o.seconds, o.layers, o.stopped = {(4, 1): 1.5}, {(4, 1): 2}, stopped
        o.results[4, 1].entries = [1]
    events = []

    def tune_many(configs_, *, budget, jobs, progress, on_outcome):
        assert jobs == 0 and budget.deadline is not None
        progress("TP4 GEMM1: preparing weights")
        progress("GEMM1 rows=1 tactic 1/3")  # not a log line
        for c, o in zip(configs_, outcomes):
            on_outcome(c, o)
        return list(zip(configs_, outcomes))

    monkeypatch.setattr(runner, "tune_many", tune_many)
    summed = []
    monkeypatch.setattr(runner, "gains", lambda done, rows: summed.append((done, rows)) or [])
    monkeypatch.setattr(family, "default_families", lambda written, target: summed.append((written, target)) or [])
    written_to = []

    def plan(chosen):  # a stand-in TunePlan: its configs, and the directory tune_and_save writes into
        return SimpleNamespace(
            configs=lambda: chosen, writing_to=lambda target: written_to.append(target) or plan(chosen)
        )

    run = tune_and_save(
        plan(configs),
        tmp_path / "t",
        summary=tmp_path / "g.md",
        budget=60.0,
        jobs=0,
        progress=lambda s, text: events.append(text),
        on_saved=lambda c, o, saved: events.append((c.preset, [s.path.name for s in saved])),
    )
    name = _table().file_name
    assert events == ["TP4 GEMM1: preparing weights", "dsv41-flash TP4 BF16 GEMM1: 1 rows tuned in 1.5 s (2 weight sets)",
                      ("dsv41-flash", [name]), "dsv4-pro TP4 BF16 GEMM1: 1 rows tuned in 1.5 s (2 weight sets)",
                      ("dsv4-pro", [name])]  # fmt: skip
    assert set(read_table(tmp_path / "t" / name).entries) == {(1, 1), (2, 1), (1, 2), (2, 2), (1, 3), (2, 3)}
    assert summed == [
        (list(zip(configs, outcomes)), runner.GAIN_ROWS),
        ([("NVIDIA H200", SHAPE, 132)] * 2, tmp_path / "t"),
    ]
    assert run.records == [] and run.families == []
    assert run.summary_files == (tmp_path / "g.md", tmp_path / "g.json") and (tmp_path / "g.json").is_file()
    assert run.problems == ["no correct tactic for dsv4-pro BF16 TP4 GEMM1 rows=8",
                            "the --budget of 60 s left out: GEMM2 of dsv4-pro TP4"]  # fmt: skip
    assert run.seconds >= 0 and written_to == [tmp_path / "t"]
    (tmp_path / "g").mkdir()
    run = tune_and_save(plan(configs[:1]), tmp_path / "t", force=True, summary=tmp_path / "g",
                        budget=60.0, jobs=0)  # fmt: skip
    assert run.summary_files is None and run.problems[0].startswith(f"cannot write {tmp_path / 'g'}")


def test_merge_tables_is_the_union_later_entries_winning_another_device_refused():
    """rank 0's merge of the ranks' tables (tune under torchrun): one table per
    file name, as one process writing them in turn; another device named."""
    h20 = TuningTable(ShapeClass.of(get_preset("dsv41-flash").shard(2)), {"name": "NVIDIA H200", "sm_count": 132},
                      {(1, 1): _table().entries[1, 1]})  # fmt: skip
    other_sms = _table(rows=(8,))
    other_sms.device["sm_count"] = 114
    tables, problems = merge_tables([_table(rows=(1, 2)), h20, _table(rows=(2, 3), us=30.0), _table(rows=(4,), fp8=True),
                                     other_sms])  # fmt: skip
    assert [t.file_name for t in tables] == [_table().file_name, h20.file_name]
    assert set(tables[0].entries) == {(s, r) for s in (1, 2) for r in (1, 2, 3)} and len(tables[0].fp8_entries) == 2
    assert tables[0].entries[1, 1].median_us == 11.0 and tables[0].entries[1, 2].median_us == 32.0
    assert tables[1].entries == h20.entries
    assert len(problems) == 1 and "114 SMs" in problems[0] and _table().file_name in problems[0]
