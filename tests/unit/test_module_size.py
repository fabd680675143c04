"""No module of the package grows past about 400 lines: a module that does
several jobs is split by job (docs/architecture.md says where each goes)."""

from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "ds_pipe_ckpt"
MAX_LINES = 450  # "about 400": the largest today are planning/stage.py and pipe.py, 436 and 419


def test_no_module_is_over_the_limit():
    sizes = {path.relative_to(PACKAGE_ROOT).as_posix(): len(path.read_text().splitlines())
             for path in PACKAGE_ROOT.rglob("*.py")}
    assert sizes, PACKAGE_ROOT
    over = {name: lines for name, lines in sizes.items() if lines > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by job): {over}"
