"""The alpha-beta fit recovers known constants; a tiny real calibration writes a loadable table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.__main__ import build_parser, main
from autopar.cost import Link, collective_time, load_hardware
from autopar.cost.calibrate import Sample, fit_alpha_beta, fit_error, measure_collectives


def _synthetic(link: Link, group: int) -> list[Sample]:
    return [
        Sample(kind, n, group, collective_time(kind, n, 4, group, link))
        for kind in ("all_reduce", "all_gather")
        for n in (1, 64, 4096, 2**18, 2**22)
    ]


@pytest.mark.parametrize("group", [2, 4, 8])
def test_fit_recovers_alpha_and_bandwidth(group: int) -> None:
    link = Link(alpha=150e-6, bandwidth=0.8e9)
    samples = _synthetic(link, group)
    alpha, bandwidth = fit_alpha_beta(samples)
    assert alpha == pytest.approx(link.alpha, rel=1e-6)
    assert bandwidth == pytest.approx(link.bandwidth, rel=1e-6)
    assert fit_error(samples, alpha, bandwidth) == pytest.approx(0.0, abs=1e-6)


def test_fit_clamps_negative_latency() -> None:
    # pure bandwidth, with the smallest message a little faster than the model: alpha would go negative
    link = Link(alpha=0.0, bandwidth=1e9)
    samples = _synthetic(link, 4)
    samples[0] = Sample(samples[0].kind, samples[0].elements, 4, samples[0].seconds * 0.5)
    alpha, bandwidth = fit_alpha_beta(samples)
    assert alpha == 0.0 and bandwidth > 0


def test_parser_has_calibrate_subcommand() -> None:
    args = build_parser().parse_args(["calibrate", "--ranks", "2", "--quick"])
    assert (args.command, args.ranks, args.quick, args.out) == ("calibrate", 2, True, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


def test_quick_calibration_writes_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--quick", "--ranks", "2", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    hw = load_hardware(out)
    assert hw.name == "cpu-gloo"
    assert hw.peak("float32") > 1e8  # any CPU core does better than 0.1 GFLOP/s
    assert hw.memory_bandwidth > 1e8
    assert hw.intra_node.bandwidth > 0 and hw.intra_node.alpha >= 0
    raw = json.loads(out.read_text())["calibration"]
    assert {row[0] for row in raw} == {"all_reduce", "all_gather"} and all(row[2] == 2 for row in raw)
    assert "measured" in hw.source["all"]
    assert hw.intra_node.call == 0.0  # nothing to keep: a new file
    table = json.loads(out.read_text())
    table["intra_node"]["call"] = 0.002
    table["source"]["call"] = "read off a profile"
    out.write_text(json.dumps(table))
    assert main(["calibrate", "--quick", "--ranks", "2", "--out", str(out)]) == 0  # measured again
    again = load_hardware(out)
    assert (again.intra_node.call, again.inter_node.call, again.source["call"]) == (0.002, 0.002, "read off a profile")


def test_in_job_timing_measures_every_group_size_and_writes_how(tmp_path: Path) -> None:
    """`--groups`: all ranks busy, each call on subgroups of each size; samples per group size, and
    the table says how it was measured."""
    samples = measure_collectives(4, sizes=(1, 64), repeats=2, groups=(2, 4), busy_s=0.0005)
    assert [(s.kind, s.elements, s.group_size) for s in samples] == [
        (kind, n * g if kind == "all_gather" else n, g)
        for g in (2, 4)
        for n in (1, 64)
        for kind in ("all_reduce", "all_gather")
    ]
    assert all(s.seconds >= 0 for s in samples)
    with pytest.raises(ValueError, match="do not divide"):
        measure_collectives(4, sizes=(1,), groups=(3,))
    args = build_parser().parse_args(["calibrate", "--ranks", "8", "--groups", "2,4,8", "--busy-ms", "3"])
    assert (args.groups, args.busy_ms) == ("2,4,8", 3.0)
