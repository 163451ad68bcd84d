"""scripts/benchlib.py: the section every benchmark appends to docs/benchmarks.md carries the run's date."""

import datetime

from script_loader import script_module


def test_emit_section_stamps_the_date_of_the_run_and_appends(tmp_path, capsys):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("earlier\n")
    with script_module("benchlib") as benchlib:
        benchlib.emit_section("T (x.py)", "notes.", ["| a |", "|---|", "| 1 |"], True, device="cpu", path=doc)
        benchlib.emit_section("U (y.py)", "n.", ["| b |"], False, device="cpu", path=doc)  # printed only
        cpu = benchlib.machine("cpu")
    today = datetime.date.today().isoformat()
    want = f"## T (x.py), {today}, {cpu}\n\nnotes.\n\n| a |\n|---|\n| 1 |\n"
    assert doc.read_text() == "earlier\n\n" + want
    out = capsys.readouterr().out
    assert want in out and f"## U (y.py), {today}, {cpu}" in out
