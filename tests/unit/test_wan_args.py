"""benchmarks.wan's command line: a misspelt method is refused before any host is made."""

import pytest

from benchmarks import wan


def test_unknown_method_is_refused_before_anything_runs(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        wan.main(["--methods", "ddp,gradwire-locl", "--json"])
    assert e.value.code == 2
    assert "unknown method 'gradwire-locl'" in capsys.readouterr().err

