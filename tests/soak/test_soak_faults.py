"""`kvpack soak --only`: which faults a run injects (no server is started here)."""

from __future__ import annotations

import pytest

from kvpack.tools.soak import SoakConfig, main
from kvpack.tools.soak.faults import SCHEDULE, holder_stopped, selected


def test_only_picks_the_named_faults_in_schedule_order() -> None:
    assert selected() == SCHEDULE
    picked = selected(("corrupt_objects", "holder_stopped"))
    assert [f.fn.__name__ for f in picked] == ["holder_stopped", "corrupt_objects"]  # schedule order
    assert picked[0].fn is holder_stopped


def test_an_unknown_fault_is_refused_at_start_with_the_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="unknown fault holder_paused .*holder_stopped"):
        SoakConfig(only_faults=("holder_paused",))
    with pytest.raises(SystemExit) as exc:
        main(["--only", "holder_stopped,holder_paused"])
    assert exc.value.code == 2
    assert "--only: unknown fault holder_paused" in capsys.readouterr().err
