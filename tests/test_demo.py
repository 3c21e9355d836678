"""The `fusedpar demo` main job: a short real run, its --help, and an up-front config error."""

import pytest

from fusedpar.demo import main


def test_demo_short_run_passes(capsys):
    assert main(["demo", "--world-size", "2", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "All configurations match." in out
    for label in ("static TP=2", "static SP=2", "shift (SP=2,TP=1) <-> TP=2"):
        assert label in out


def test_demo_help_explains_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--world-size", "--sp", "--tp", "--threshold", "--layers", "--seed"):
        assert option in out


@pytest.mark.parametrize(("argv", "match"), [
    (["demo", "--world-size", "3"], "intermediate_size=512 is not divisible by sp\\*tp=1\\*3=3"),
    (["demo", "--sp", "3"], "--sp 3 x --tp 1 must equal --world-size 4"),
])
def test_demo_rejects_impossible_layouts_up_front(argv, match):
    with pytest.raises(SystemExit, match=match):
        main(argv)
