"""Flag values out of range are refused as they are parsed (titanlite.utils.argtypes), one ``error:`` line naming the
flag and the range, exit status 2, before any work and with nothing written.

- ``estimate``: a negative, NaN or infinite price; NaN or infinite tokens (inf overflowed int()); MFU outside
  (0, 1]; no GPU.
- ``plot --smooth`` outside [0, 1) (1e9 drew a flat line of the first loss).
- The parser itself: in-range values pass, and the range text says what is expected.
"""

from __future__ import annotations

import argparse
import json

import pytest

from titanlite import cli
from titanlite.utils.argtypes import number

ESTIMATE = ["estimate", "--model.flavor", "debugmodel", "--gpu", "H100", "--num-gpus", "8"]


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``titanlite <argv>`` in this process: (exit status, stdout, stderr)."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize(
    "flags, flag, expected",
    [
        (["--tokens", "1e9", "--price-per-gpu-hour", "-3"], "--price-per-gpu-hour", "finite number >= 0"),
        (["--tokens", "1e9", "--price-per-gpu-hour", "nan"], "--price-per-gpu-hour", "finite number >= 0"),
        (["--tokens", "1e9", "--price-per-gpu-hour", "inf"], "--price-per-gpu-hour", "finite number >= 0"),
        (["--tokens", "inf"], "--tokens", "finite number > 0"),
        (["--tokens", "nan"], "--tokens", "finite number > 0"),
        (["--tokens", "-5"], "--tokens", "finite number > 0"),
        (["--tokens", "1e9", "--mfu", "0"], "--mfu", "finite number > 0 and <= 1"),
        (["--tokens", "1e9", "--mfu", "nan"], "--mfu", "finite number > 0 and <= 1"),
    ],
)
def test_estimate_refuses_values_out_of_range(flags, flag, expected, capsys):
    code, out, err = run_cli([*ESTIMATE, *flags], capsys)
    assert not out
    assert_one_line_error(code, err, f"argument {flag}: expected a {expected}")


def test_estimate_accepts_a_zero_price_and_prices_the_run(capsys):
    """The range check keeps valid runs: a free GPU costs 0, and a priced one costs hours x GPUs x price."""
    code, out, err = run_cli([*ESTIMATE, "--tokens", "1e9", "--price-per-gpu-hour", "0", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["cost"] == 0
    code, out, err = run_cli([*ESTIMATE, "--tokens", "1e9", "--price-per-gpu-hour", "2.5", "--json"], capsys)
    plan = json.loads(out)
    assert code == 0 and plan["cost"] == pytest.approx(plan["wall_s"] / 3600 * 8 * 2.5)


@pytest.mark.parametrize("smooth", ["1e9", "1", "-0.1", "nan"])
def test_plot_refuses_a_smoothing_outside_0_1(smooth, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    out_file = tmp_path / "curves.png"
    code, _, err = run_cli(["plot", str(run), "-o", str(out_file), "--smooth", smooth], capsys)
    assert_one_line_error(code, err, "argument --smooth: expected a finite number >= 0 and < 1", repr(smooth))
    assert not out_file.exists()


def test_number_reads_in_range_values_and_names_the_range():
    price = number(at_least=0)
    assert price("0") == 0.0 and price("2.5") == 2.5
    seed = number(int, at_least=-(2**63), at_most=2**64 - 1)
    assert seed(str(2**64 - 1)) == 2**64 - 1 and seed("-7") == -7
    for bad in (str(2**64), "1e23", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected an integer >= {-(2**63)} and <= {2**64 - 1}"):
            seed(bad)
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected a finite number > 0 and < 1, got 'abc'"):
        number(above=0, below=1)("abc")
