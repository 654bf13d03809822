"""Console tables (``report.console``): aligned, numbers right-aligned, cell text taken literally."""

from fa3_numerics.report.console import table_text


def test_columns_align_and_numbers_right_align():
    text = table_text(["variant", "rmse"], [["fa3-fp8", "1.0e-02"], ["a-much-longer-name", "2"]], [False, True])
    lines = text.splitlines()
    assert lines[0].split() == ["variant", "rmse"] and set(lines[1].strip()) == {"─"}
    ends = {len(line.rstrip()) for line in (lines[0], lines[2], lines[3])}
    assert len(ends) == 1  # the numeric column ends where its header does
    assert lines[2].startswith("fa3-fp8 ") and lines[3].startswith("a-much-longer-name ")


def test_cell_text_is_never_markup():
    text = table_text(["variant"], [["fa3-fp8 [decode head]"], ["[bold]x[/bold]"]])
    assert "fa3-fp8 [decode head]" in text and "[bold]x[/bold]" in text
